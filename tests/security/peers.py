"""What the security tests share: the token the attacks never present, and ways to look at a
server process from outside (its listening ports, memory and threads) and to load its ports."""
from __future__ import annotations

import socket
import time

import psutil

TOKEN = "flood-test-" + "9f" * 16
MiB = 1 << 20


def listening_ports(pid: int) -> list[int]:
    """The TCP ports a process listens on."""
    conns = psutil.Process(pid).net_connections(kind="tcp")
    return sorted({c.laddr.port for c in conns if c.status == psutil.CONN_LISTEN})


def rss(pid: int) -> int:
    """The larger of a process's resident set and its peak (VmHWM): compared before and after
    an attack, it shows growth that lasted and growth that came and went above earlier peaks."""
    with open(f"/proc/{pid}/status") as f:
        hwm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    return max(psutil.Process(pid).memory_info().rss, hwm)


def threads(pid: int) -> int:
    return psutil.Process(pid).num_threads()


def open_idle(port: int, n: int) -> list[socket.socket]:
    """``n`` TCP connections to 127.0.0.1:port that send nothing (refused ones are skipped)."""
    out = []
    for _ in range(n):
        s = socket.socket()
        s.settimeout(2.0)
        try:
            s.connect(("127.0.0.1", port))
        except OSError:
            s.close()
            continue
        out.append(s)
    return out


def close_all(socks) -> None:
    for s in socks:
        s.close()


def settle(seconds: float) -> None:
    time.sleep(seconds)
