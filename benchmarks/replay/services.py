"""The L3 stores of a replay, each started fresh in its own processes on 127.0.0.1.

- hicache-mc: ``hicache-mc serve`` (master + one node: DRAM tier, optional SSD tier).
- hicache-mc cluster: ``hicache-mc master`` and N ``hicache-mc node`` processes, any of which
  the replay may kill (``NodeCluster``).
- Mooncake Store: ``mooncake_master`` plus a holder process that contributes the memory
  segment (``MooncakeDistributedStore.setup`` with ``global_segment_size`` = the capacity),
  as in docs section 3 of the Mooncake reference; instances are pure clients.

Each context manager yields a ``Store``: the spec instances open (``backends.open_l3``) and a
``stats()`` of the store's own counters, read before it stops.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
from common import free_port  # noqa: E402

START_TIMEOUT_S = 60.0


@dataclass
class Store:
    spec: dict
    stats: Callable[[], dict] = field(default=lambda: {})


@contextmanager
def no_store():
    yield Store({"kind": "none"})


def _stop(p: subprocess.Popen) -> None:
    if p.stdin:
        p.stdin.close()             # a holder's signal to close its client and exit
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            pass
    if p.poll() is None:
        p.terminate()
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(10)


@contextmanager
def hicache_store(dram: int, ssd: int = 0, transport: str = "auto", view: str = "off"):
    """``hicache-mc serve`` with ``dram`` bytes of DRAM (at least 1 MiB) and ``ssd`` of SSD;
    its clients answer exists from a residency view with ``view="on"``."""
    from hicache_mc.client import StoreClient
    port = free_port()
    tmp = tempfile.mkdtemp(prefix="replay-hicache-")
    args = [sys.executable, "-m", "hicache_mc.cli", "serve", "--port", str(port),
            "--dram", str(max(dram, 1 << 20))]
    if ssd:
        args += ["--ssd", str(ssd), "--ssd-dir", os.path.join(tmp, "ssd")]
    log = open(os.path.join(tmp, "serve.log"), "ab")
    # data_dir: the node's files stay in the temporary folder, removed afterwards
    env = dict(os.environ, HICACHE_MC_DATA_DIR=tmp, HICACHE_MC_MASTER_METRICS_PORT="0",
               HICACHE_MC_PUBLISH_PORT="0")
    p = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env)
    log.close()
    master = f"tcp://127.0.0.1:{port}"
    try:
        # the first answer waits for the node to fault in its whole DRAM segment (seconds per GiB)
        with StoreClient(master, timeout_s=START_TIMEOUT_S) as c:
            end = time.monotonic() + START_TIMEOUT_S
            while not ((c.stats()["cluster"] or {}).get("nodes")):
                if time.monotonic() > end or p.poll() is not None:
                    raise RuntimeError("hicache-mc serve did not start:\n" + _tail(log.name))
                time.sleep(0.1)

            def stats() -> dict:
                cl = c.stats()["cluster"] or {}
                node = (cl.get("nodes") or [{}])[0]
                keep = ("objects", "objects_total", "used", "capacity", "evictions", "demotions",
                        "promotions", "ssd_used", "ssd_objects", "ssd_evictions")
                return {"keys": cl.get("keys"), **{k: node[k] for k in keep if k in node}}
            yield Store({"kind": "hicache-mc", "master": master, "transport": transport,
                         "view": view}, stats)
    finally:
        _stop(p)
        shutil.rmtree(tmp, ignore_errors=True)


def mooncake_master_binary() -> str:
    here = os.path.join(os.path.dirname(sys.executable), "mooncake_master")
    found = here if os.path.exists(here) else shutil.which("mooncake_master")
    if not found:
        raise RuntimeError("mooncake_master not found: pip install mooncake-transfer-engine-non-cuda")
    return found


@contextmanager
def mooncake_store(capacity: int):
    """``mooncake_master`` (default flags, loopback) and one holder of ``capacity`` bytes."""
    rpc, metrics = free_port(), free_port()
    tmp = tempfile.mkdtemp(prefix="replay-mooncake-")
    master_log, holder_log = os.path.join(tmp, "master.log"), os.path.join(tmp, "holder.log")
    quiet = dict(os.environ, GLOG_minloglevel=os.environ.get("GLOG_minloglevel", "1"))
    procs: list[subprocess.Popen] = []
    try:
        with open(master_log, "ab") as log:
            procs.append(subprocess.Popen(
                [mooncake_master_binary(), "--rpc_address=127.0.0.1", f"--rpc_port={rpc}",
                 "--metrics_host=127.0.0.1", f"--metrics_port={metrics}"],
                stdout=log, stderr=subprocess.STDOUT))
        master = f"127.0.0.1:{rpc}"
        _wait_http(f"http://127.0.0.1:{metrics}/health", procs[0], master_log)
        with open(holder_log, "ab") as log:
            procs.append(subprocess.Popen(
                [sys.executable, os.path.join(HERE, "mooncake_holder.py"), master, str(capacity)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, env=quiet))
        line = procs[1].stdout.readline().decode().strip()
        if line != "ready":
            raise RuntimeError(f"Mooncake holder did not start ({line!r}):\n" + _tail(holder_log))

        def stats() -> dict:
            return _mooncake_summary(f"http://127.0.0.1:{metrics}/metrics/summary")
        yield Store({"kind": "mooncake", "master": master}, stats)
    finally:
        for p in reversed(procs):
            _stop(p)
        shutil.rmtree(tmp, ignore_errors=True)


def _tail(path: str, n: int = 3000) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()[-n:]
    except OSError:
        return f"(no log at {path})"


def _wait_http(url: str, proc: subprocess.Popen, log_path: str) -> None:
    end = time.monotonic() + START_TIMEOUT_S
    while True:
        try:
            urllib.request.urlopen(url, timeout=1).read()
            return
        except OSError:
            if time.monotonic() > end or proc.poll() is not None:
                raise RuntimeError(f"{url} did not answer:\n" + _tail(log_path))
            time.sleep(0.1)


def _mooncake_summary(url: str) -> dict:
    """Keys held and memory evictions from the master's one-line summary."""
    try:
        text = urllib.request.urlopen(url, timeout=5).read().decode()
    except OSError:
        return {}
    out = {}
    m = re.search(r"Keys: (\d+)", text)
    if m:
        out["keys"] = int(m.group(1))
    m = re.search(r"Mem Eviction: Success/Attempts=(\d+)/(\d+), keys=(\d+)", text)
    if m:
        out["eviction_rounds"] = int(m.group(1))
        out["evictions"] = int(m.group(3))
    m = re.search(r"Mem Storage: ([^|]+?) \|", text)
    if m:
        out["mem_storage"] = m.group(1).strip()
    return out


class NodeCluster:
    """A master and nodes as separate processes on 127.0.0.1; ``kill_holder`` SIGKILLs one."""

    def __init__(self, tmp: str, nodes: int, dram: int, heartbeat_s: float):
        port = free_port()
        self.master = f"tcp://127.0.0.1:{port}"
        self.env = dict(os.environ, HICACHE_MC_DATA_DIR=tmp, HICACHE_MC_MASTER_METRICS_PORT="-1", HICACHE_MC_PUBLISH_PORT="0",
                        HICACHE_MC_NODE_METRICS_PORT="-1",
                        HICACHE_MC_HEARTBEAT_INTERVAL_S=str(heartbeat_s))
        self.tmp = tmp
        self.procs: list[subprocess.Popen] = []
        self._start("master", ["master", "--port", str(port)])
        self.nodes = {}     # address -> process
        for i in range(nodes):
            node_port = free_port()
            self.nodes[f"tcp://127.0.0.1:{node_port}"] = self._start(
                f"node{i}", ["node", "--master", self.master, "--node-port", str(node_port),
                             "--dram", str(dram)])
        wait = subprocess.run([sys.executable, "-m", "hicache_mc.cli", "wait", "--master",
                               self.master, "--nodes", str(nodes), "--timeout", str(START_TIMEOUT_S)],
                              env=self.env, capture_output=True, text=True)
        if wait.returncode:
            self.stop()
            raise RuntimeError(f"the cluster did not start: {wait.stderr.strip()}")

    def _start(self, name: str, args: list[str]) -> subprocess.Popen:
        with open(os.path.join(self.tmp, f"{name}.log"), "ab") as log:
            p = subprocess.Popen([sys.executable, "-m", "hicache_mc.cli", *args], env=self.env,
                                 stdout=log, stderr=subprocess.STDOUT)
        self.procs.append(p)
        return p

    def nodes_now(self) -> list[dict]:
        from hicache_mc import protocol as P
        return self._ask(P.StatsRequest()).stats["nodes"]

    def _ask(self, msg):
        import zmq
        from hicache_mc.rpc import Channel
        ch = Channel(zmq.Context.instance(), self.master)
        try:
            return ch.call(msg, 10.0)
        finally:
            ch.close()

    def kill_holder(self, key: str) -> dict:
        """SIGKILL the node holding ``key``; its id and its share of the bytes held then."""
        from hicache_mc import protocol as P
        node_id = self._ask(P.LocateRequest([key])).located()[0][0]
        nodes = self.nodes_now()
        node = next(n for n in nodes if n["node_id"] == node_id)
        self.nodes[node["address"]].kill()
        used = sum(n.get("used", 0) for n in nodes)
        return {"node": node_id, "share": node.get("used", 0) / used if used else 0.0,
                "used": used}

    def stop(self) -> None:
        for p in reversed(self.procs):
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()


@contextmanager
def hicache_cluster(nodes: int, dram: int, heartbeat_s: float = 1.0):
    """``NodeCluster`` of ``nodes`` nodes of ``dram`` bytes each, stopped afterwards."""
    tmp = tempfile.mkdtemp(prefix="replay-cluster-")
    c = NodeCluster(tmp, nodes, dram, heartbeat_s)
    try:
        yield c
    finally:
        c.stop()
        shutil.rmtree(tmp, ignore_errors=True)
