"""Master: key lookups per second in 128-key batches, and master memory per key.

    python benchmarks/bench_master.py [--keys 1000000] [--seconds 5]

A real ``hicache-mc master`` process is fed ``--keys`` synthetic keys by a stand-in node that
speaks the node protocol (Register, Committed, Heartbeat), so no object bytes are needed.
Reported: the master's RSS growth per key (from /proc), ``Exists`` and ``Locate`` throughput
from one client thread (keys/s and p50 latency of a 128-key call), and the index's own Python
memory per key measured in-process with tracemalloc.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import threading
import time
import tracemalloc

import zmq

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import free_port, median, pct, write_json  # noqa: E402

from hicache_mc import protocol as P  # noqa: E402
from hicache_mc.master.index import KeyIndex  # noqa: E402


def key(i: int) -> str:
    # the shape of a real page key: namespace / sha256 hex / part
    return f"0123456789abcdef/{hashlib.sha256(i.to_bytes(8, 'little')).hexdigest()}/k"


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


class FakeNode:
    """Speaks the node side of the protocol; holds no bytes."""

    def __init__(self, master: str):
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.connect(master)
        self.info = P.NodeInfo("bench-node", "tcp://127.0.0.1:1", "bench-host", "/nonexistent", 1 << 40)
        self.stop = threading.Event()
        self.lock = threading.Lock()

    def call(self, msg):
        with self.lock:
            self.sock.send(P.encode(msg, 1))
            assert self.sock.poll(30_000)
            return P.decode(self.sock.recv(), request=False).msg

    def heartbeat_forever(self):
        while not self.stop.wait(0.5):
            self.call(P.HeartbeatRequest("bench-node", {"used": 0}))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--keys", type=int, default=1_000_000)
    ap.add_argument("--seconds", type=float, default=5.0)
    args = ap.parse_args()
    keys = [key(i) for i in range(args.keys)]

    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    idx = KeyIndex()
    for i, k in enumerate(keys):
        idx.add(k, 0, 4 << 20, i)
    index_bytes = (tracemalloc.get_traced_memory()[0] - before) / args.keys
    tracemalloc.stop()
    del idx

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "hicache_mc.cli", "master", "--port", str(port),
                             "--metrics-port", "0", "--publish-port", "0"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    master = f"tcp://127.0.0.1:{port}"
    try:
        time.sleep(1.0)
        node = FakeNode(master)
        assert isinstance(node.call(P.RegisterRequest(node.info.to_dict())), P.RegisterReply)
        hb = threading.Thread(target=node.heartbeat_forever, daemon=True)
        hb.start()
        rss0 = rss(proc.pid)
        for i in range(0, len(keys), 4096):
            chunk = keys[i:i + 4096]
            assert isinstance(node.call(P.CommittedRequest("bench-node", chunk, [4 << 20] * len(chunk),
                                                           list(range(len(chunk))))), P.OkReply)
        time.sleep(0.5)
        rss_per_key = (rss(proc.pid) - rss0) / len(keys)

        from hicache_mc.client import StoreClient
        results = {}
        with StoreClient(master, timeout_s=10) as c:
            for name, call in (("exists", lambda b: c.batch_exists(b)),
                               ("locate", lambda b: c._master(P.LocateRequest(b), time.monotonic() + 10))):
                lat, n, i = [], 0, 0
                end = time.perf_counter() + args.seconds
                while time.perf_counter() < end:
                    batch = keys[i:i + 128]
                    i = (i + 128) % (len(keys) - 128)
                    t0 = time.perf_counter()
                    call(batch)
                    lat.append(time.perf_counter() - t0)
                    n += 128
                results[name] = {"keys_per_s": n / sum(lat), "p50_ms": median(lat) * 1e3,
                                 "p99_ms": pct(lat, 99) * 1e3}
        node.stop.set()
    finally:
        proc.terminate()
        proc.wait(10)
    print(f"{args.keys} keys: master RSS +{rss_per_key:.0f} B/key; index alone {index_bytes:.0f} B/key "
          f"(tracemalloc; key strings included)")
    for name, r in results.items():
        print(f"{name:>6} 128 keys/call, one client thread: {r['keys_per_s'] / 1e3:.0f}k keys/s, "
              f"p50 {r['p50_ms']:.3f} ms, p99 {r['p99_ms']:.3f} ms")
    print("wrote", write_json("bench_master.json", {"args": vars(args), "rss_bytes_per_key": rss_per_key,
                                                     "index_bytes_per_key": index_bytes, **results}))


if __name__ == "__main__":
    main()
