"""Shared benchmark helpers: a store subprocess, timing, tables and JSON."""
from __future__ import annotations

import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def store_process(dram: str = "2GiB", extra_env: dict | None = None):
    """``hicache-mc serve`` in its own process, so bytes really cross processes."""
    port = free_port()
    env = dict(os.environ, HICACHE_MC_PREFAULT="1", HICACHE_MC_MASTER_METRICS_PORT="0", HICACHE_MC_PUBLISH_PORT="0",
               **(extra_env or {}))     # metrics: any free port (the last store may hold 9370)
    p = subprocess.Popen([sys.executable, "-m", "hicache_mc.cli", "serve", "--port", str(port),
                          "--dram", dram], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    master = f"tcp://127.0.0.1:{port}"
    wait = subprocess.run([sys.executable, "-m", "hicache_mc.cli", "wait", "--master", master,
                           "--timeout", "300"], env=env, capture_output=True, text=True)
    if wait.returncode:
        p.kill()
        raise RuntimeError(f"store did not start: {wait.stderr.strip()}\n"
                           + p.stderr.read().decode()[-2000:])
    try:
        yield master
    finally:
        p.terminate()
        p.wait(30)


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def median(xs):
    return statistics.median(xs)


def machine() -> dict:
    return {"python": platform.python_version(), "cpus": os.cpu_count(), "platform": platform.platform(),
            "date": time.strftime("%Y-%m-%d %H:%M:%S")}


def table(rows: list[dict], cols: list[tuple[str, str]]) -> str:
    """Rows as an aligned text table; cols = [(key, format)]."""
    heads = [k for k, _ in cols]
    cells = [[format(r[k], f) if isinstance(r.get(k), (int, float)) else str(r.get(k, "")) for k, f in cols]
             for r in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(heads)]
    line = lambda xs: "  ".join(x.rjust(w) for x, w in zip(xs, widths))  # noqa: E731
    return "\n".join([line(heads), line(["-" * w for w in widths])] + [line(c) for c in cells])


def _relative(value):
    """``value`` with every path inside the checkout made relative to it (results are committed:
    no absolute path of the machine that ran them)."""
    if isinstance(value, dict):
        return {k: _relative(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_relative(v) for v in value]
    if isinstance(value, str) and value.startswith(CHECKOUT + os.sep):
        return os.path.relpath(value, CHECKOUT)
    return value


def write_json(name: str, doc: dict) -> str:
    os.makedirs(RESULTS, exist_ok=True)
    path = os.path.join(RESULTS, name)
    with open(path, "w") as f:
        json.dump(_relative({"machine": machine(), **doc}), f, indent=2)
    return path
