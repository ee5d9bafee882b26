"""The client's residency view: memory per key and the cost of a probe, in process.

    python benchmarks/bench_view.py [--keys 1000000] [--reps 20000] [--baseline main --rounds 3]

Builds the view's key set (client/digests.py) from ``--keys`` digests of SGLang page keys
(SHA-256 page hashes, parts k and v) as a snapshot delivers them, and reports its bytes per key
(numpy array plus the delta sets, by tracemalloc) against a Python set of the 16-byte digests.
Then probes that hit, p50 and p99 wall time over ``--reps`` calls and this thread's CPU time a
call, for a client that wrote none of the keys: a stored chain of 128 pages by ``exists`` of
its keys (hashing included; 128 keys of an MLA chain, 256 of an MHA one), by ``exists_pages``
of its page hashes (the SGLang backend's ``batch_exists``: no keys built) and by ``contains``
of its keys (the hybrid backend's ``batch_exists_v2``), and 128 stored keys that are no page
keys; each with an empty delta and with one of 10k entries.

``--baseline REV`` measures REV's code (``git archive REV hicache_mc``, imported first) and
this checkout's in turns, ``--rounds`` times each, in fresh processes, and reports the median
of each side's rounds and their ratio (this checkout over REV: below 1 is faster). Results in
``results/bench_view.json``, or ``results/bench_view_vs_baseline.json``.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
import tracemalloc

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from common import median, table, write_json  # noqa: E402

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


def key_set(n_keys: int):
    hashes = [hashlib.sha256(i.to_bytes(8, "little")).hexdigest() for i in range(n_keys // 2)]
    keys = batch_page_keys(NS, hashes, ("k", "v"))
    others = [f"{NS}/obj{i}" for i in range(CHAIN)]
    return hashes, keys, others, R.digests(keys + others)


def memory(snap: bytes, n: int) -> dict:
    tracemalloc.start()
    t0 = tracemalloc.get_traced_memory()[0]
    ds = DigestSet(snap)
    view_bytes = tracemalloc.get_traced_memory()[0] - t0
    t0 = tracemalloc.get_traced_memory()[0]
    pyset = {snap[i:i + 16] for i in range(0, len(snap), 16)}
    set_bytes = tracemalloc.get_traced_memory()[0] - t0
    tracemalloc.stop()
    del pyset, ds
    print(f"{n} keys: view {view_bytes / n:.1f} B/key, Python set of digests {set_bytes / n:.1f} B/key")
    return {"keys": n, "view_bytes_per_key": view_bytes / n, "set_bytes_per_key": set_bytes / n}


def probes(n_keys: int, reps: int) -> dict:
    hashes, keys, others, snap = key_set(n_keys)
    ds = DigestSet(snap)
    view = ResidencyView(None, "tcp://127.0.0.1:1", "", 1.0)
    view.spaces[NS] = Space(NS, keys=ds, synced=True, need=False, heard=time.monotonic() + 3600)
    chain = hashes[5000:5000 + CHAIN]
    mha, mla = batch_page_keys(NS, chain, ("k", "v")), batch_page_keys(NS, chain, ("k",))
    calls = {"exists(keys), MLA chain (128 keys)": (lambda: view.exists(mla), CHAIN),
             "exists(keys), MHA chain (256 keys)": (lambda: view.exists(mha), 2 * CHAIN),
             "exists_pages(hashes), MLA chain": (lambda: view.exists_pages(NS, chain, ("k",)), CHAIN),
             "exists_pages(hashes), MHA chain": (lambda: view.exists_pages(NS, chain, ("k", "v")), CHAIN),
             "contains(keys), MLA chain": (lambda: view.contains(mla), [True] * CHAIN),
             "exists(keys), 128 other keys": (lambda: view.exists(others), CHAIN)}
    out = {}
    for label in ("empty delta", "10k-entry delta"):
        if label != "empty delta":
            extra = batch_page_keys(NS, [hashlib.sha256(b"x%d" % i).hexdigest() for i in range(5000)], ("k",))
            ds.apply(R.digests(extra), R.digests(keys[:5000]))
        for name, (call, want) in calls.items():
            assert call() == want, name
            r = out[f"{name}, {label}"] = timed(call, reps)
            print(f"{name:38} {label:16}: p50 {r['p50_us']:6.1f} us, p99 {r['p99_us']:6.1f} us, "
                  f"CPU {r['cpu_us']:5.1f} us a call", flush=True)
    return out


def against(args) -> None:
    """REV's code and this checkout's in turns, in fresh processes."""
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(f"git archive {args.baseline} hicache_mc | tar -x -C {tmp}", shell=True,
                       check=True, cwd=os.path.dirname(HERE))
        rev = subprocess.run(["git", "rev-parse", "--short", args.baseline], capture_output=True,
                             text=True, check=True, cwd=HERE).stdout.strip()
        runs: dict[str, list[dict]] = {"baseline": [], "current": []}
        for r in range(args.rounds):
            for side in runs:
                env = dict(os.environ)
                if side == "baseline":
                    env["PYTHONPATH"] = tmp + os.pathsep + env.get("PYTHONPATH", "")
                out = os.path.join(tmp, f"{side}{r}.json")
                print(f"round {r + 1}/{args.rounds}: {side}", flush=True)
                subprocess.run([sys.executable, __file__, "--keys", str(args.keys), "--reps",
                                str(args.reps), "--probes-to", out], check=True, env=env)
                with open(out) as f:
                    runs[side].append(json.load(f))
    rows = []
    for name in runs["current"][0]:
        row = {"probe": name}
        for side, short in (("baseline", "old"), ("current", "new")):
            for m in ("p50_us", "cpu_us"):
                row[f"{short}_{m}"] = median([run[name][m] for run in runs[side] if name in run])
        row["p50_ratio"] = row["new_p50_us"] / row["old_p50_us"]
        row["cpu_ratio"] = row["new_cpu_us"] / row["old_cpu_us"]
        rows.append(row)
    print(f"\nmedians of {args.rounds} rounds; new = this checkout, old = {args.baseline} ({rev})")
    print(table(rows, [("probe", ""), ("old_p50_us", ".1f"), ("new_p50_us", ".1f"), ("p50_ratio", ".2f"),
                       ("old_cpu_us", ".1f"), ("new_cpu_us", ".1f"), ("cpu_ratio", ".2f")]))
    print("wrote", write_json("bench_view_vs_baseline.json",
                              {"args": vars(args), "baseline_commit": rev, "rows": rows, "runs": runs}))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--keys", type=int, default=1_000_000)
    ap.add_argument("--reps", type=int, default=20_000)
    ap.add_argument("--baseline", default="", help="a git revision to measure against")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--probes-to", default="", help=argparse.SUPPRESS)    # one side's round
    args = ap.parse_args()
    if args.baseline:
        return against(args)
    if args.probes_to:
        with open(args.probes_to, "w") as f:
            json.dump(probes(args.keys, args.reps), f)
        return
    mem = memory(key_set(args.keys)[3], args.keys + CHAIN)
    print("wrote", write_json("bench_view.json", {"args": vars(args), **mem,
                                                  "probes": probes(args.keys, args.reps)}))


if __name__ == "__main__":
    main()
