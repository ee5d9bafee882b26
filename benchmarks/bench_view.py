"""The client's residency view: memory per key and the cost of a probe of a page chain, in process.

    python benchmarks/bench_view.py [--keys 1000000] [--reps 20000]

Builds the view's key set (client/digests.py) from ``--keys`` digests of SGLang page keys
(SHA-256 page hashes, parts k and v) as a snapshot delivers them, and reports its bytes per key
(numpy array plus the delta sets, by tracemalloc) against a Python set of the 16-byte digests.
Then a probe of a stored chain of 128 pages, p50 and p99 over ``--reps`` calls, for a client
that wrote none of the keys: ``exists`` of the chain's keys (hashing included; 128 keys of an
MLA chain, 256 of an MHA one) and ``exists_pages`` of its page hashes (what the SGLang backend
calls: no keys built, digests from the hashes), with an empty delta and with a delta of 10k
entries; also this thread's CPU time a call (timing included). Writes ``results/bench_view.json``.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time
import tracemalloc

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import write_json  # noqa: E402

from hicache_mc import residency as R  # noqa: E402
from hicache_mc.client.digests import DigestSet  # noqa: E402
from hicache_mc.client.view import ResidencyView, Space  # noqa: E402
from hicache_mc.keys import batch_page_keys  # noqa: E402

NS = "0123456789abcdef"
CHAIN = 128


def timed(call, reps: int) -> dict:
    """Wall time per call (p50, p99), and this thread's CPU time per call (the mean over the
    reps: what the call costs when it has a core; wall time on a shared host adds waiting)."""
    times = []
    cpu0 = time.thread_time()
    for _ in range(reps):
        t = time.perf_counter()
        call()
        times.append(time.perf_counter() - t)
    cpu = (time.thread_time() - cpu0) / reps
    return {"p50_us": float(np.median(times) * 1e6), "p99_us": float(np.percentile(times, 99) * 1e6),
            "cpu_us": cpu * 1e6}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--keys", type=int, default=1_000_000)
    ap.add_argument("--reps", type=int, default=20_000)
    args = ap.parse_args()
    hashes = [hashlib.sha256(i.to_bytes(8, "little")).hexdigest() for i in range(args.keys // 2)]
    keys = batch_page_keys(NS, hashes, ("k", "v"))
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
    print(f"{len(keys)} keys: view {view_bytes / len(keys):.1f} B/key, "
          f"Python set of digests {set_bytes / len(keys):.1f} B/key")

    view = ResidencyView(None, "tcp://127.0.0.1:1", "", 1.0)
    view.spaces[NS] = Space(NS, keys=ds, synced=True, need=False, heard=time.monotonic() + 3600)
    chain = hashes[5000:5000 + CHAIN]
    mha, mla = batch_page_keys(NS, chain, ("k", "v")), batch_page_keys(NS, chain, ("k",))
    probes = {"exists(keys), MLA chain (128 keys)": (lambda: view.exists(mla), CHAIN),
              "exists(keys), MHA chain (256 keys)": (lambda: view.exists(mha), 2 * CHAIN),
              "exists_pages(hashes), MLA chain": (lambda: view.exists_pages(NS, chain, ("k",)), CHAIN),
              "exists_pages(hashes), MHA chain": (lambda: view.exists_pages(NS, chain, ("k", "v")), CHAIN)}
    results = {"keys": len(keys), "view_bytes_per_key": view_bytes / len(keys),
               "set_bytes_per_key": set_bytes / len(keys), "probes": {}}
    for label in ("empty delta", "10k-entry delta"):
        if label != "empty delta":
            extra = batch_page_keys(NS, [hashlib.sha256(b"x%d" % i).hexdigest() for i in range(5000)], ("k",))
            ds.apply(R.digests(extra), R.digests(keys[:5000]))
        for name, (call, want) in probes.items():
            assert call() == want, name
            r = results["probes"][f"{name}, {label}"] = timed(call, args.reps)
            print(f"{name:38} {label:16}: p50 {r['p50_us']:6.1f} us, p99 {r['p99_us']:6.1f} us, "
                  f"CPU {r['cpu_us']:5.1f} us a call")
    print("wrote", write_json("bench_view.json", {"args": vars(args), **results}))


if __name__ == "__main__":
    main()
