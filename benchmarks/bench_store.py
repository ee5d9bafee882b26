"""Store throughput: 128-object batches put then get through shm and tcp, beside memcpy.

    python benchmarks/bench_store.py [--sizes 1MiB,4MiB] [--batch 128] [--iters 5]

For each object size: a plain memcpy of the same bytes (numpy copyto, same buffers), then for
each transport ``batch_put_from`` of fresh keys and ``batch_get_into`` of them, against a
``hicache-mc serve`` in another process. Reports GB/s, the ratio to memcpy measured in the
same run, p50/p99 batch latency, and ``batch_exists`` of 128 keys (p50/p99).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import median, pct, store_process, table, write_json  # noqa: E402

from hicache_mc.client import StoreClient  # noqa: E402
from hicache_mc.config import parse_size  # noqa: E402


def memcpy_gbps(srcs, dsts, iters) -> tuple[float, list[float]]:
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        for s, d in zip(srcs, dsts):
            np.copyto(d, s)
        times.append(time.perf_counter() - t0)
    nbytes = sum(s.nbytes for s in srcs)
    return nbytes / median(times) / 1e9, times


def run_transport(master, transport, size, batch, iters, srcs, dsts, tag):
    ptr_s = [a.ctypes.data for a in srcs]
    ptr_d = [a.ctypes.data for a in dsts]
    sizes = [size] * batch
    put_t, get_t = [], []
    with StoreClient(master, transport=transport, timeout_s=60) as c:
        for it in range(iters):
            keys = [f"bench/{tag}/{transport}/{it}/{i}" for i in range(batch)]
            t0 = time.perf_counter()
            ok = c.batch_put_from(keys, ptr_s, sizes)
            put_t.append(time.perf_counter() - t0)
            assert all(ok), f"put failed: {sum(ok)}/{batch}"
            t0 = time.perf_counter()
            ok = c.batch_get_into(keys, ptr_d, sizes)
            get_t.append(time.perf_counter() - t0)
            assert all(ok), f"get failed: {sum(ok)}/{batch}"
            assert all(np.array_equal(s, d) for s, d in zip(srcs[:2], dsts[:2]))
            c.clear(f"bench/{tag}/{transport}/{it}/")
    nbytes = size * batch
    return {
        "put_gbps": nbytes / median(put_t) / 1e9, "get_gbps": nbytes / median(get_t) / 1e9,
        "put_p50_ms": median(put_t) * 1e3, "put_p99_ms": pct(put_t, 99) * 1e3,
        "get_p50_ms": median(get_t) * 1e3, "get_p99_ms": pct(get_t, 99) * 1e3,
    }


def exists_latency(master, n=128, reps=2000) -> dict:
    with StoreClient(master) as c:
        keys = [f"bench/exists/{i}" for i in range(n)]
        buf = np.zeros(64, dtype=np.uint8)
        c.batch_put_from(keys, [buf.ctypes.data] * n, [64] * n)
        lat = []
        for _ in range(reps):
            t0 = time.perf_counter()
            assert c.batch_exists(keys) == n
            lat.append(time.perf_counter() - t0)
    return {"keys": n, "p50_ms": median(lat) * 1e3, "p99_ms": pct(lat, 99) * 1e3}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="1MiB,4MiB")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--dram", default="3GiB")
    args = ap.parse_args()
    rows = []
    with store_process(args.dram) as master:
        for size in [parse_size(s) for s in args.sizes.split(",")]:
            rng = np.random.default_rng(size)
            srcs = [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(args.batch)]
            dsts = [np.zeros(size, dtype=np.uint8) for _ in range(args.batch)]
            base, _ = memcpy_gbps(srcs, dsts, args.iters)
            for transport in ("shm", "tcp"):
                r = run_transport(master, transport, size, args.batch, args.iters, srcs, dsts, size)
                rows.append({"object": f"{size >> 10} KiB", "transport": transport,
                             "memcpy_gbps": base, **r,
                             "put_x_memcpy": r["put_gbps"] / base, "get_x_memcpy": r["get_gbps"] / base})
            del srcs, dsts
        ex = exists_latency(master)
    cols = [("object", ""), ("transport", ""), ("memcpy_gbps", ".2f"), ("put_gbps", ".2f"),
            ("put_x_memcpy", ".2f"), ("get_gbps", ".2f"), ("get_x_memcpy", ".2f"),
            ("put_p50_ms", ".1f"), ("put_p99_ms", ".1f"), ("get_p50_ms", ".1f"), ("get_p99_ms", ".1f")]
    print(f"batches of {args.batch} objects, {args.iters} iterations, medians")
    print(table(rows, cols))
    print(f"batch_exists({ex['keys']} keys): p50 {ex['p50_ms']:.3f} ms, p99 {ex['p99_ms']:.3f} ms")
    path = write_json("bench_store.json", {"args": vars(args), "rows": rows, "exists": ex})
    print("wrote", path)


if __name__ == "__main__":
    main()
