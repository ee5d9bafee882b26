"""The client's residency view: memory per key and the cost of a 128-key lookup, in process.

    python benchmarks/bench_view.py [--keys 1000000]

Builds the view's key set (client/digests.py) from ``--keys`` digests as a snapshot delivers
them, and reports its bytes per key (numpy array plus the delta sets, by tracemalloc) against
a Python set of the 16-byte digests; then ``ResidencyView.exists`` of 128 keys (hashing
included), p50 over 20k calls, with an empty delta and with a delta of 10k entries.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import tracemalloc

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from hicache_mc import residency as R  # noqa: E402
from hicache_mc.client.digests import DigestSet  # noqa: E402
from hicache_mc.client.view import ResidencyView, Space  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--keys", type=int, default=1_000_000)
    args = ap.parse_args()
    ns = "0123456789abcdef"
    keys = [f"{ns}/{i:064x}/k" for i in range(args.keys)]
    snap = R.digests(keys)
    tracemalloc.start()
    t0 = tracemalloc.get_traced_memory()[0]
    ds = DigestSet(snap)
    view_bytes = tracemalloc.get_traced_memory()[0] - t0
    t0 = tracemalloc.get_traced_memory()[0]
    pyset = {snap[i:i + 16] for i in range(0, len(snap), 16)}
    set_bytes = tracemalloc.get_traced_memory()[0] - t0
    tracemalloc.stop()
    del pyset
    print(f"{args.keys} keys: view {view_bytes / args.keys:.1f} B/key, "
          f"Python set of digests {set_bytes / args.keys:.1f} B/key")

    view = ResidencyView(None, "tcp://127.0.0.1:1", "", 1.0)
    sp = Space(ns, keys=ds, synced=True, need=False, heard=time.monotonic() + 3600)
    view.spaces[ns] = sp
    batch = keys[5000:5128]
    for label in ("empty delta", "10k-entry delta"):
        if label != "empty delta":
            extra = [f"{ns}/{i:064x}/v" for i in range(10_000)]
            ds.apply(R.digests(extra[:5000]), R.digests(keys[:5000]))
        times = []
        for _ in range(20_000):
            t = time.perf_counter()
            n = view.exists(batch)
            times.append(time.perf_counter() - t)
        assert n == 128, n
        print(f"exists(128) from the view, {label}: p50 {np.median(times) * 1e6:.1f} us, "
              f"p99 {np.percentile(times, 99) * 1e6:.1f} us")


if __name__ == "__main__":
    main()
