"""Master: key lookups per second in 128-key batches, master memory per key, and what one
client can make the master do (issue 28).

    python benchmarks/bench_master.py [--keys 1000000] [--seconds 5] [--wide 4] [--namespaces 200000]

A real ``hicache-mc master`` process is fed ``--keys`` synthetic keys by a stand-in node that
speaks the node protocol (Register, Committed, Heartbeat), so no object bytes are needed.
Reported: the master's RSS growth per key (from /proc), ``Exists`` and ``Locate`` throughput
from one client thread (keys/s and p50 latency of a 128-key call), and the index's own Python
memory per key measured in-process with tracemalloc. Then, on the same master:

- wide lookups: ``--wide`` Locates of MAX_KEYS keys, one namespace each, sent at once; the stand-in
  node's heartbeat round trips and a 128-key Exists while they run, against the same before them;
- namespace churn: a key committed in each of ``--namespaces`` namespaces, then evicted; the
  master's RSS after, against before, and the namespaces its publisher still numbers;
- unread replies: 2,000 snapshots of a 16k-key namespace asked on a connection that never
  reads; the master's RSS growth and the requests refused as busy.
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

MAX_KEYS = P.MAX_KEYS


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

    def heartbeat_forever(self, every_s: float = 0.5):
        """Heartbeat every ``every_s``; each round trip (seconds) lands in ``self.rtts``."""
        self.rtts: list[tuple[float, float]] = []     # (when sent, round trip)
        while not self.stop.wait(every_s):
            t0 = time.perf_counter()
            self.call(P.HeartbeatRequest("bench-node", {"used": 0}))
            self.rtts.append((t0, time.perf_counter() - t0))


def request(master: str, msg, timeout_s: float = 60.0):
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(master)
    try:
        sock.send(P.encode(msg, 1))
        assert sock.poll(int(timeout_s * 1000)), f"no reply to {type(msg).__name__}"
        return P.decode(sock.recv(), request=False).msg
    finally:
        sock.close()


def wide_lookups(master: str, node: FakeNode, n: int) -> dict:
    """``n`` Locates of MAX_KEYS keys (a namespace each; a Locate looks at every key, where an
    Exists stops at its first miss) at once: heartbeat round trips and a 128-key Exists while
    they run, against the same before."""
    probe = [key(i) for i in range(128)]

    def exists_ms(reps: int) -> list[float]:
        out = []
        for _ in range(reps):
            t0 = time.perf_counter()
            request(master, P.ExistsRequest(probe))
            out.append((time.perf_counter() - t0) * 1e3)
        return out
    time.sleep(1.0)
    start = time.perf_counter()
    idle_probe = exists_ms(20)
    idle_hb = [rtt for t, rtt in node.rtts if t >= start - 2]
    wide = [f"w{i:06x}/{i:064x}/k" for i in range(MAX_KEYS)]
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(master)
    frame = P.encode(P.LocateRequest(wide), 1)
    t0 = time.perf_counter()
    for _ in range(n):
        sock.send(frame)
    busy_probe = exists_ms(20)
    for _ in range(n):
        assert sock.poll(300_000), "a wide Locate was never answered"
        sock.recv()
    took = time.perf_counter() - t0
    sock.close()
    during = [rtt for t, rtt in node.rtts if t0 <= t <= t0 + took]
    return {"wide_requests": n, "keys_each": MAX_KEYS, "all_answered_s": took,
            "heartbeat_rtt_ms_before": {"p50": median(idle_hb) * 1e3, "max": max(idle_hb) * 1e3},
            "heartbeat_rtt_ms_during": {"p50": median(during) * 1e3, "max": max(during) * 1e3,
                                        "count": len(during)},
            "exists128_ms_before": median(idle_probe), "exists128_ms_during": median(busy_probe)}


def namespace_churn(master: str, node: FakeNode, pid: int, n: int) -> dict:
    """Twice: a key committed in each of ``n`` namespaces (new ones each round), then evicted.
    RSS after each round: state kept per namespace ever used would grow it round by round."""
    rounds, seq = [], 0
    before = rss(pid)
    for r in range(2):
        keys = [f"churn{r}-{i:07x}/{i:064x}/k" for i in range(n)]
        for i in range(0, n, 4096):
            chunk = keys[i:i + 4096]
            node.call(P.CommittedRequest("bench-node", chunk, [1] * len(chunk), [0] * len(chunk)))
        peak = rss(pid)
        for i in range(0, n, 4096):
            seq += 1
            assert isinstance(node.call(P.EvictedRequest("bench-node", keys[i:i + 4096], seq)), P.OkReply)
        time.sleep(1.5)
        rounds.append({"rss_mib_with_keys": peak / 2**20, "rss_mib_after": rss(pid) / 2**20})
    stats = request(master, P.StatsRequest()).stats
    return {"namespaces": n, "rss_mib_before": before / 2**20, "rounds": rounds,
            "publisher_namespaces_after": stats["residency_namespaces"]}


def unread_snapshots(master: str, node: FakeNode, pid: int) -> dict:
    """2,000 snapshots of a 16k-key namespace (256 KiB each) on a connection that never reads."""
    keys = [f"snap/{i:064x}/k" for i in range(16384)]
    for i in range(0, len(keys), 4096):
        node.call(P.CommittedRequest("bench-node", keys[i:i + 4096], [1] * 4096, [0] * 4096))
    busy0 = request(master, P.StatsRequest()).stats["rejected"].get("busy", 0)
    base = rss(pid)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, 1)
    sock.setsockopt(zmq.RCVBUF, 4096)
    sock.connect(master)
    for rid in range(2000):
        sock.send(P.encode(P.SnapshotRequest("snap"), rid))
    time.sleep(5.0)
    grew, stats = rss(pid) - base, request(master, P.StatsRequest()).stats
    sock.close()
    return {"requests": 2000, "reply_bytes_each": 16 * len(keys), "rss_growth_mib": grew / 2**20,
            "refused_busy": stats["rejected"].get("busy", 0) - busy0,
            "dropped_unread": stats["unsent"]["peer_not_reading"]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--keys", type=int, default=1_000_000)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--wide", type=int, default=4, help="wide Locates in flight at once (0: skip)")
    ap.add_argument("--namespaces", type=int, default=200_000, help="namespaces churned (0: skip)")
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
        hb = threading.Thread(target=node.heartbeat_forever, args=(0.05,), daemon=True)
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
        if args.wide:
            results["wide_lookups"] = wide_lookups(master, node, args.wide)
        if args.namespaces:
            results["namespace_churn"] = namespace_churn(master, node, proc.pid, args.namespaces)
        results["unread_snapshots"] = unread_snapshots(master, node, proc.pid)
        results["nodes_expired"] = request(master, P.StatsRequest()).stats["nodes_expired"]
        node.stop.set()
    finally:
        proc.terminate()
        proc.wait(10)
    print(f"{args.keys} keys: master RSS +{rss_per_key:.0f} B/key; index alone {index_bytes:.0f} B/key "
          f"(tracemalloc; key strings included)")
    for name in ("exists", "locate"):
        r = results[name]
        print(f"{name:>6} 128 keys/call, one client thread: {r['keys_per_s'] / 1e3:.0f}k keys/s, "
              f"p50 {r['p50_ms']:.3f} ms, p99 {r['p99_ms']:.3f} ms")
    w = results.get("wide_lookups")
    if w:
        print(f"{w['wide_requests']} Locates of {w['keys_each']} keys (a namespace each) at once: all "
              f"answered in {w['all_answered_s']:.1f} s; heartbeat round trip p50/max "
              f"{w['heartbeat_rtt_ms_before']['p50']:.1f}/{w['heartbeat_rtt_ms_before']['max']:.1f} ms "
              f"before, {w['heartbeat_rtt_ms_during']['p50']:.1f}/{w['heartbeat_rtt_ms_during']['max']:.1f}"
              f" ms during ({w['heartbeat_rtt_ms_during']['count']} heartbeats); a 128-key Exists "
              f"{w['exists128_ms_before']:.2f} ms before, {w['exists128_ms_during']:.2f} ms during")
    c = results.get("namespace_churn")
    if c:
        steps = " -> ".join(f"{r['rss_mib_with_keys']:.0f} -> {r['rss_mib_after']:.0f}" for r in c["rounds"])
        print(f"{c['namespaces']} namespaces with a key, then none, twice: master RSS "
              f"{c['rss_mib_before']:.0f} -> {steps} MiB; the publisher numbers "
              f"{c['publisher_namespaces_after']} namespaces after")
    u = results["unread_snapshots"]
    print(f"{u['requests']} unread snapshots of {u['reply_bytes_each'] >> 10} KiB: master RSS "
          f"{u['rss_growth_mib']:+.1f} MiB, {u['refused_busy']} refused as busy, "
          f"{u['dropped_unread']} replies dropped unread; nodes expired: {results['nodes_expired']}")
    print("wrote", write_json("bench_master.json", {"args": vars(args), "rss_bytes_per_key": rss_per_key,
                                                     "index_bytes_per_key": index_bytes, **results}))


if __name__ == "__main__":
    main()
