"""Real store processes on 127.0.0.1 for tests: master, nodes, or the embedded ``serve``."""
from __future__ import annotations

import glob
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Callable, Optional

import zmq

from hicache_mc import protocol as P
from hicache_mc.auth import credential, secure_client


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def lasting_port(low: int = 10000, high: int = 21999) -> int:
    """A port free now, for a server that binds it only minutes later (a live SGLang server):
    never one the kernel hands out, since ``free_port``'s may meanwhile become the local end of
    any connection on the machine, and below 22000 (SGLang picks its own from 22000 up)."""
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        high = min(high, int(f.read().split()[0]) - 1)
    for port in random.sample(range(low, high + 1), 64):
        if port in _lasting:            # handed out already, maybe not bound yet
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _lasting.add(port)
        return port
    raise RuntimeError(f"no free port in {low}-{high}")


_lasting: set[int] = set()


def _stopped(stat_path: str) -> bool:
    """Whether the thread whose /proc .../stat this is has stopped (state T), or is gone."""
    try:
        with open(stat_path) as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return True


def request(address: str, msg: P.Message, timeout_s: float = 2.0, token: str = "") -> Optional[P.Message]:
    """One raw request (CURVE with ``token``); None when the server drops the connection (a
    failed handshake too) or nothing answers in time."""
    sock = secure_client(zmq.Context.instance().socket(zmq.DEALER), credential(token))
    return _exchange(sock, address, [P.encode(msg, 1)], timeout_s)


def raw_request(address: str, frames: list, timeout_s: float = 5.0) -> Optional[P.Message]:
    """Send raw ``frames`` on a fresh DEALER (no CURVE); the reply, or None as ``request``."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    return _exchange(sock, address, frames, timeout_s)


def _exchange(sock, address: str, frames: list, timeout_s: float) -> Optional[P.Message]:
    """Send ``frames`` on ``sock`` (then closed) and wait for one reply. A drop is seen as it
    happens, through a socket monitor: a test of a refused peer does not wait out its timeout."""
    monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    poller.register(monitor, zmq.POLLIN)
    sock.connect(address)
    try:
        sock.send_multipart(frames, copy=False)
        end = time.monotonic() + timeout_s
        while (left := end - time.monotonic()) > 0:
            ready = dict(poller.poll(int(left * 1000) + 1))
            if sock in ready:
                return P.decode(sock.recv(), request=False).msg
            if monitor in ready:        # dropped: a reply that came before is queued already
                return P.decode(sock.recv(), request=False).msg if sock.poll(0) else None
        return None
    finally:
        sock.disable_monitor()
        monitor.close()
        sock.close()


class Proc:
    """One ``hicache-mc`` subprocess; its log goes to a file for post-mortems."""

    def __init__(self, args: list[str], log_path: str, env: Optional[dict] = None, preexec=None):
        self.args = args
        self.log_path = log_path
        self.env = env
        self.preexec = preexec
        self.p: Optional[subprocess.Popen] = None

    def start(self) -> "Proc":
        log = open(self.log_path, "ab")
        env = dict(os.environ, PYTHONUNBUFFERED="1", **(self.env or {}))
        self.p = subprocess.Popen([sys.executable, "-m", "hicache_mc.cli", *self.args],
                                  stdout=log, stderr=subprocess.STDOUT, env=env,
                                  preexec_fn=self.preexec)
        log.close()
        return self

    def kill(self, sig=signal.SIGKILL, wait: bool = True) -> None:
        """Send ``sig``; with ``wait``, a signal that ends the process returns once it has."""
        if self.p and self.p.poll() is None:
            self.p.send_signal(sig)
            if wait and sig in (signal.SIGKILL, signal.SIGTERM, signal.SIGINT):
                self.p.wait(10)

    def wait(self, timeout_s: float = 10.0) -> None:
        """Return once the process has ended (TimeoutExpired after ``timeout_s``)."""
        if self.p:
            self.p.wait(timeout_s)

    def pause(self, timeout_s: float = 5.0) -> None:
        """SIGSTOP, and return once every thread of the process has stopped: the signal is
        delivered asynchronously, and a thread that has not stopped yet may still serve a
        request sent right after ``kill``."""
        self.kill(signal.SIGSTOP)
        end = time.monotonic() + timeout_s
        while not all(_stopped(t) for t in glob.glob(f"/proc/{self.p.pid}/task/*/stat")):
            if time.monotonic() > end:
                raise TimeoutError(f"pid {self.p.pid} did not stop in {timeout_s} s")
            time.sleep(0.005)

    def stop(self) -> None:
        self.kill(signal.SIGTERM)

    @property
    def alive(self) -> bool:
        return self.p is not None and self.p.poll() is None

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()


class Cluster:
    """A master and any number of nodes as separate processes (or one ``serve``)."""

    def __init__(self, tmp_path, heartbeat_s: float = 0.2, liveness: int = 3, token: str = ""):
        self.tmp = tmp_path
        self.port = free_port()
        self.master = f"tcp://127.0.0.1:{self.port}"
        # the master's metrics on any free port, not 9370: clusters of several tests may overlap
        self.env = {"HICACHE_MC_HEARTBEAT_INTERVAL_S": str(heartbeat_s),
                    "HICACHE_MC_LIVENESS": str(liveness), "HICACHE_MC_MASTER_METRICS_PORT": "0",
                    "HICACHE_MC_PUBLISH_PORT": "0"}
        if token:
            self.env["HICACHE_MC_TOKEN"] = token
        self.token = token
        self.heartbeat_s = heartbeat_s
        self.liveness = liveness
        self.master_proc: Optional[Proc] = None
        self.nodes: list[Proc] = []
        self.serve_proc: Optional[Proc] = None

    def _proc(self, name: str, args: list[str]) -> Proc:
        return Proc(args, str(self.tmp / f"{name}.log"), self.env)

    def start_serve(self, dram: str = "256MiB", wait: bool = True) -> "Cluster":
        self.serve_proc = self._proc("serve", ["serve", "--port", str(self.port), "--dram", dram]).start()
        if wait:
            self.wait_nodes(1)
        return self

    def start_master(self, args: tuple = ()) -> Proc:
        self.master_proc = self._proc("master", ["master", "--port", str(self.port), *args]).start()
        return self.master_proc

    def add_node(self, dram: str = "256MiB", port: Optional[int] = None, args: tuple = (),
                 preexec=None) -> Proc:
        """Start a node process; ``args`` adds CLI flags (e.g. --ssd 64MiB --ssd-dir D)."""
        port = port or free_port()
        node = Proc(["node", "--master", self.master, "--node-port", str(port), "--dram", dram, *args],
                    str(self.tmp / f"node{len(self.nodes)}.log"), self.env, preexec).start()
        node.port = port
        node.address = f"tcp://127.0.0.1:{port}"
        self.nodes.append(node)
        return node

    def stats(self, timeout_s: float = 2.0) -> Optional[dict]:
        reply = request(self.master, P.StatsRequest(), timeout_s, self.token)
        return reply.stats if isinstance(reply, P.StatsReply) else None

    def wait_nodes(self, n: int, timeout_s: float = 20.0) -> dict:
        """Wait until the master lists exactly ``n`` live nodes."""
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            st = self.stats(0.5)
            if st is not None and len(st["nodes"]) == n:
                return st
            time.sleep(0.05)
        raise TimeoutError(f"master did not see {n} nodes in {timeout_s}s; logs:\n{self.logs()}")

    def wait_keys(self, n: int, timeout_s: float = 20.0, at_least: bool = False) -> dict:
        """Wait until the master indexes ``n`` keys (``at_least``: ``n`` or more)."""
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            st = self.stats(0.5)
            if st is not None and (st["keys"] >= n if at_least else st["keys"] == n):
                return st
            time.sleep(0.05)
        raise TimeoutError(f"master did not reach {n} keys in {timeout_s}s")

    def wait_objects(self, n: int, timeout_s: float = 20.0) -> dict:
        """Wait until the nodes' heartbeats report ``n`` objects in all; returns address -> count."""
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            st = self.stats(0.5)
            if st is not None and sum(x.get("objects", 0) for x in st["nodes"]) == n:
                return {x["address"]: x["objects"] for x in st["nodes"]}
            time.sleep(0.05)
        raise TimeoutError(f"nodes did not report {n} objects in {timeout_s}s")

    def procs(self) -> list[Proc]:
        return [p for p in [self.serve_proc, self.master_proc, *self.nodes] if p is not None]

    def logs(self) -> str:
        return "\n".join(f"--- {p.log_path}\n{p.log()[-3000:]}" for p in self.procs())

    def stop(self) -> None:
        """SIGTERM every process at once, then wait for each: they shut down side by side."""
        procs = self.procs()
        for p in procs:
            p.kill(signal.SIGTERM, wait=False)
        for p in procs:
            p.wait()


class Store:
    """An embedded store (``hicache-mc serve``) that a test can stop and start again."""

    def __init__(self, tmp_path, dram: str = "256MiB"):
        self.cluster = Cluster(tmp_path)
        self.dram = dram
        self.master = self.cluster.master

    def start(self) -> "Store":
        self.cluster.start_serve(self.dram)
        return self

    def stop(self) -> None:
        self.cluster.stop()

    def kill(self) -> None:
        self.cluster.serve_proc.kill()


def in_threads(work: Callable[[int], None], n: int) -> list[BaseException]:
    """Run ``work(0)`` .. ``work(n - 1)`` in ``n`` threads at once; the exceptions they raised."""
    errors: list[BaseException] = []

    def run(t: int) -> None:
        try:
            work(t)
        except Exception as exc:  # collected for the caller to assert on
            errors.append(exc)
    threads = [threading.Thread(target=run, args=(t,)) for t in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors
