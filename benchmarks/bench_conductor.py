"""The Conductor's decision latency and its block index's memory, on one core.

    python benchmarks/bench_conductor.py [--workers 32] [--prompt 131072] [--page 64]

A fleet of ``--workers`` instances whose L1 and L2 hold chains as KV events built them (every
worker holds a different share of the request's prefix: the walk over the chain cannot stop
early), each with queued and decoding requests of its own; then ``Conductor.route`` for
prompts of ``--prompt`` tokens (2,048 pages of 64 tokens at 128k), with predictive admission
(the costliest: it projects the decode batch of the candidates). Reported: p50 / p99 of the
decision over ``--decisions`` calls, with the parts measured alone in the same run (the
chain's index lookup, the shared L3 lookup, which is a Python set here and the residency
view in production); the floor is ``map(dict.get)`` over the chain, the least any
hash-indexed router does per request. Then the index's bytes per block (tracemalloc, and what
``memory()`` reports for /metrics), events applied per second, and the cost of hashing a
prompt's tokens into its chain (chain.py; the server pays it once per request).
"""
from __future__ import annotations

import argparse
import gc
import os
import random
import sys
import time
import tracemalloc
from itertools import repeat

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from benchmarks.common import pct, table, write_json  # noqa: E402
from hicache_mc.conductor.api import (  # noqa: E402
    BlocksStored, Decision, Finished, Request, Started, Tier, WorkerSpec)
from hicache_mc.conductor.chain import block_hash, chain  # noqa: E402
from hicache_mc.conductor.core import Admission, Conductor, ConductorConfig  # noqa: E402
from hicache_mc.conductor.index import BlockIndex  # noqa: E402


def hexes(rng: random.Random, n: int) -> list[str]:
    return [f"{rng.getrandbits(256):064x}" for _ in range(n)]


class SetL3:
    def __init__(self, held):
        self.held = set(held)

    def __call__(self, hashes):
        held = self.held
        return next((i for i, h in enumerate(hashes) if h not in held), len(hashes))


def fleet(args, rng, shared: list[str]) -> tuple[Conductor, SetL3]:
    """Workers whose caches hold parts of ``shared`` plus filler chains, with load."""
    l3 = SetL3(shared[: len(shared) * 3 // 4])
    cfg = ConductorConfig(admission=Admission.PREDICTIVE, ttft_slo_s=1e9, tbt_slo_s=1e9)
    c = Conductor(l3, cfg)
    blocks = [block_hash(h) for h in shared]
    for i in range(args.workers):
        name = f"w{i}"
        c.add_worker(WorkerSpec(name, page_tokens=args.page, page_bytes=args.page << 17,
                                host_bw=20e9, l3_bw=5e9))
        # the worker's share: a GPU prefix and a longer host prefix, different per worker
        g = rng.randint(len(blocks) // 2, len(blocks))
        c.observe_events([BlocksStored(name, Tier.GPU, blocks[:g]),
                          BlocksStored(name, Tier.HOST, blocks)])
        filler = [rng.getrandbits(63) for _ in range(args.filler)]
        c.observe_events([BlocksStored(name, Tier.HOST, filler)])
    for k in range(args.workers * args.running):        # decoding batches, then queues
        d = c.route(Request(f"run{k}", 0.0, 4096, []), 0.0)
        c.observe_started(Started(d.worker, f"run{k}", 0.0))
    for k in range(args.workers * args.queued):
        c.route(Request(f"q{k}", 0.0, 4096, []), 0.0)
    return c, l3


def timed(fn, n: int) -> tuple[list[float], list[float]]:
    """Wall and CPU (this thread's) seconds of each call: on a shared host the CPU time is
    the decision's own cost, the wall time adds whatever else ran meanwhile."""
    wall, cpu = [], []
    for _ in range(n):
        t, c = time.perf_counter(), time.thread_time()
        fn()
        cpu.append(time.thread_time() - c)
        wall.append(time.perf_counter() - t)
    return wall, cpu


def decisions(c: Conductor, shared: list[str], args) -> tuple[list[float], list[float]]:
    blocks = [block_hash(h) for h in shared]
    wall, cpu = [], []
    for k in range(args.decisions):
        req = Request(f"r{k}", 0.0, args.prompt, shared, max_new_tokens=256, block_hashes=blocks)
        t, tc = time.perf_counter(), time.thread_time()
        d = c.route(req, 0.0)
        cpu.append(time.thread_time() - tc)
        wall.append(time.perf_counter() - t)
        assert isinstance(d, Decision), d
        # keep the fleet's in-flight count steady: the request starts and ends at once
        c.observe_started(Started(d.worker, req.rid, 0.0))
        c.observe_finished(Finished(d.worker, req.rid, 0.0, args.prompt, 256, {}, ttft_s=1.0))
    return wall, cpu


def index_memory(args, rng) -> dict:
    ix = BlockIndex(max_blocks=args.index_blocks)
    names = [f"w{i}" for i in range(args.workers)]
    for w in names:
        ix.add_worker(w)
    hashes = [rng.getrandbits(63) for _ in range(args.index_blocks)]
    gc.collect()
    tracemalloc.start()
    t = time.perf_counter()
    per = len(hashes) // args.workers
    for i, w in enumerate(names):                 # each block on 2 workers, GPU and host
        part = hashes[i * per:(i + 1) * per]
        ix.apply([BlocksStored(w, Tier.GPU, part)])
        ix.apply([BlocksStored(names[(i + 1) % len(names)], Tier.HOST, part)])
    elapsed = time.perf_counter() - t
    traced = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    mem = ix.memory()
    return {"blocks": mem.blocks, "traced_bytes_per_block": traced / mem.blocks,
            "reported_bytes_per_block": mem.bytes_per_block,
            "blocks_applied_per_s": 2 * per * args.workers / elapsed}


def row(label: str, wall: list[float], cpu: list[float]) -> dict:
    return {"what": label, "p50_ms": pct(wall, 50) * 1e3, "p99_ms": pct(wall, 99) * 1e3,
            "cpu_p50_ms": pct(cpu, 50) * 1e3, "cpu_p99_ms": pct(cpu, 99) * 1e3}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workers", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=131072)
    ap.add_argument("--page", type=int, default=64)
    ap.add_argument("--decisions", type=int, default=2000)
    ap.add_argument("--filler", type=int, default=20_000, help="other blocks per worker")
    ap.add_argument("--running", type=int, default=32, help="decoding requests per worker")
    ap.add_argument("--queued", type=int, default=4, help="queued requests per worker")
    ap.add_argument("--index-blocks", type=int, default=1 << 20)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    pages = args.prompt // args.page
    shared = hexes(rng, pages)
    c, l3 = fleet(args, rng, shared)
    blocks = [block_hash(h) for h in shared]
    table_get = dict.fromkeys(blocks, 1).get
    rows = []
    for label, fn in [
        ("floor: map(dict.get) over the chain", lambda: list(map(table_get, blocks, repeat(0)))),
        ("index lookup (all workers, both tiers)", lambda: c.index.prefixes(blocks)),
        ("L3 lookup (a Python set here)", lambda: l3(shared)),
    ]:
        rows.append(row(label, *timed(fn, args.decisions)))
    rows.append(row("route(): the whole decision", *decisions(c, shared, args)))
    floor = rows[0]["p50_ms"]
    for r in rows:
        r["x_floor_p50"] = r["p50_ms"] / floor
    tokens = [rng.randrange(150_000) for _ in range(args.prompt)]
    hash_ms = [t * 1e3 for t in timed(lambda: chain(tokens, args.page), 20)[1]]
    mem = index_memory(args, rng)
    print(f"{args.workers} workers, {args.prompt}-token prompts = {pages} pages of {args.page}, "
          f"{args.decisions} decisions, predictive admission")
    print(table(rows, [("what", ""), ("p50_ms", ".3f"), ("p99_ms", ".3f"), ("cpu_p50_ms", ".3f"),
                       ("cpu_p99_ms", ".3f"), ("x_floor_p50", ".1f")]))
    print(f"chain of {args.prompt} tokens (chain.py, once per request in the server): "
          f"CPU p50 {pct(hash_ms, 50):.2f} ms; load average {os.getloadavg()[0]:.1f}")
    print(f"index: {mem['blocks']} blocks, {mem['traced_bytes_per_block']:.0f} B/block traced, "
          f"{mem['reported_bytes_per_block']:.0f} B/block reported by memory(); "
          f"{mem['blocks_applied_per_s'] / 1e6:.2f} M blocks/s applied")
    path = write_json("bench_conductor.json", {
        "args": vars(args), "decision": rows, "chain_cpu_ms_p50": pct(hash_ms, 50), "index": mem,
        "load_average": os.getloadavg()[0],
        "target": {"decision_p99_ms": 1.0}})
    print("wrote", path)


if __name__ == "__main__":
    main()
