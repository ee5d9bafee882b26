"""Replay Mooncake's FAST'25 conversation trace: block hit rate and L3 load time, hicache-mc
against local-only caching, the trace's ceiling and Mooncake Store.

    python benchmarks/replay_trace.py                 # first 4000 requests (~5-8 min here)
    python benchmarks/replay_trace.py --full          # all 12,031 requests
    python benchmarks/replay_trace.py --requests 500 --capacities 0.5 --systems hicache-mc

N instance processes (``--instances``) take the requests round-robin, as a cache-unaware load
balancer would. Each keeps a local LRU of ``--local-blocks`` blocks (its L2) and shares one L3
through the calls SGLang's storage backends make: leading-run exists on the chain after its
local hits, get into real buffers, then "compute" the missing blocks (bytes derived from the
block id) and put them. Every block read back is checked byte for byte; one wrong block fails
the run (exit status 1).

Runs, each against a fresh store: local only (no L3); per system an "unbounded" L3 (room for
every distinct block with margin: it must reach the ceiling), then one L3 per ``--capacities``
fraction of the distinct blocks' bytes. Systems: ``hicache-mc`` (``hicache-mc serve``, DRAM),
``hicache-mc+ssd`` (DRAM of ``--ssd-dram`` of the distinct bytes, SSD tier of the capacity),
``mooncake`` (``mooncake_master`` + a holder process with a segment of the capacity, default
flags). Block size: 512 tokens of ``--model``'s KV bytes per token divided by ``--scale``
(64 MiB / 4096 = 16 KiB for llama3-8b), or ``--block-bytes``.

Pacing: by default ordered (request i+1 starts once request i is done, so hit rates are exact
and repeatable); ``--speedup S`` hands request i out at timestamp/S (0: all at once) and lets
the instances overlap.

Prints a table; writes ``results/replay_trace.json`` and the plot ``results/replay_trace.png``
(hit rate against capacity, one curve per system, local-only and ceiling lines).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from common import RESULTS, table, write_json  # noqa: E402
from replay import report, services, trace  # noqa: E402
from replay.driver import replay  # noqa: E402

# KV bytes per token at TP1: 2 (K, V) x layers x KV heads x head dim x dtype bytes; MLA keeps one
# latent (kv_lora_rank + rope dim) per layer.
MODELS = {
    "llama3-8b": 2 * 32 * 8 * 128 * 2,        # 128 KiB / token, 64 MiB / 512-token block
    "llama3-70b": 2 * 80 * 8 * 128 * 2,       # 320 KiB / token
    "qwen3-8b": 2 * 36 * 8 * 128 * 2,         # 144 KiB / token
    "deepseek-v3": 61 * (512 + 64) * 2,       # MLA: 68.6 KiB / token
}
TOKENS_PER_BLOCK = 512          # the trace's block
DEFAULT_REQUESTS = 4000         # ~20 of the trace's 59 minutes; 71,424 distinct blocks
UNBOUNDED_MARGIN = 1.5          # x distinct bytes: above both stores' eviction watermarks
STORE_SLACK = 64 << 20


def block_bytes(args) -> int:
    if args.block_bytes:
        return args.block_bytes
    b = TOKENS_PER_BLOCK * MODELS[args.model] // args.scale
    return max(8, b // 8 * 8)


def open_store(system: str, capacity: int, args, distinct_bytes: int):
    if system in ("hicache-mc", "hicache-mc+view"):     # +view: exists from residency views
        return services.hicache_store(capacity, transport=args.transport,
                                      view="on" if system.endswith("+view") else "off")
    if system == "hicache-mc+ssd":
        dram = max(int(args.ssd_dram * distinct_bytes), 1 << 20)
        return services.hicache_store(dram, ssd=max(capacity, 1 << 20), transport=args.transport)
    if system == "mooncake":
        return services.mooncake_store(capacity)
    raise SystemExit(f"unknown system {system!r} (hicache-mc, hicache-mc+view, hicache-mc+ssd, "
                     f"mooncake)")


def run_one(label, capacity_label, store_cm, reqs, args, bb) -> dict:
    with store_cm as store:
        t0 = time.perf_counter()
        outcomes = replay(reqs, store.spec, args.instances, args.local_blocks, bb, args.speedup)
        row = report.summarize(outcomes, bb, time.perf_counter() - t0)
        row["store"] = store.stats()
    row.update(system=label, capacity=capacity_label, evictions=row["store"].get("evictions", ""))
    print(f"  {label:<15} {capacity_label:>9}: hit {100 * row['hit_rate']:.2f} %, "
          f"load p50 {row['load_p50_ms']:.2f} ms, {row['wall_s']:.0f} s", flush=True)
    return row


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", default=trace.DEFAULT_TRACE)
    ap.add_argument("--requests", type=int, default=DEFAULT_REQUESTS, help="first N requests")
    ap.add_argument("--full", action="store_true", help="the whole trace")
    ap.add_argument("--instances", type=int, default=4)
    ap.add_argument("--local-blocks", type=int, default=2000, help="local LRU per instance")
    ap.add_argument("--model", choices=sorted(MODELS), default="llama3-8b")
    ap.add_argument("--scale", type=int, default=4096, help="divide the real block size by this")
    ap.add_argument("--block-bytes", type=int, default=0, help="override the block size")
    ap.add_argument("--capacities", default="0.1,0.25,0.5,1.0",
                    help="L3 capacities as fractions of the distinct blocks' bytes")
    ap.add_argument("--systems", default="hicache-mc,mooncake",
                    help="comma list of hicache-mc, hicache-mc+view, hicache-mc+ssd, mooncake")
    ap.add_argument("--ssd-dram", type=float, default=0.05,
                    help="hicache-mc+ssd: DRAM tier as a fraction of the distinct bytes")
    ap.add_argument("--transport", choices=["auto", "shm", "tcp"], default="auto")
    ap.add_argument("--speedup", type=float, default=None,
                    help="concurrent replay at timestamp/S (0: no pacing); default ordered")
    ap.add_argument("--no-unbounded", action="store_true", help="skip the unbounded runs")
    ap.add_argument("--out", default="replay_trace", help="name of the JSON and PNG in results/")
    return ap.parse_args(argv)


def sweep(reqs, args, bb: int, distinct_bytes: int, fractions: list[float]) -> list[dict]:
    """Local only, then per system the unbounded L3 and each capacity: one row per run."""
    rows = [run_one("local only", "0", services.no_store(), reqs, args, bb)]
    unbounded = int(UNBOUNDED_MARGIN * distinct_bytes) + STORE_SLACK
    for system in [s for s in args.systems.split(",") if s]:
        points = [] if args.no_unbounded else [("unbounded", unbounded)]
        points += [(f"{100 * f:g} %", int(f * distinct_bytes)) for f in fractions]
        for label, cap in points:
            row = run_one(system, label, open_store(system, cap, args, distinct_bytes), reqs, args, bb)
            row.update(capacity_bytes=cap, capacity_fraction=cap / distinct_bytes)
            rows.append(row)
    local, ceiling = rows[0]["local_rate"], trace.ceiling(reqs) / trace.blocks(reqs)
    for r in rows:
        r["x_local"] = r["hit_rate"] / local if local else 0.0
        r["x_ceiling"] = r["hit_rate"] / ceiling if ceiling else 0.0
        r["gib_read"] = r["bytes_read"] / 2**30
        r["gib_written"] = r["bytes_written"] / 2**30
    return rows


COLUMNS = [("system", ""), ("capacity", ""), ("hit_rate", ".4f"), ("x_local", ".2f"),
           ("x_ceiling", ".3f"), ("l3_hits", "d"), ("lost_after_exists", "d"), ("put_failed", "d"),
           ("evictions", ""), ("load_p50_ms", ".2f"), ("load_p99_ms", ".2f"),
           ("exists_p50_ms", ".3f"), ("put_p50_ms", ".2f"), ("put_p99_ms", ".2f"),
           ("get_gbps", ".3f"), ("put_gbps", ".3f"), ("gib_read", ".2f"), ("gib_written", ".2f"),
           ("wall_s", ".1f")]


def draw(rows, lru_ref: dict, ceiling: float, title: str, out: str) -> str:
    local = rows[0]["local_rate"]
    curves: dict = {}     # every curve starts at capacity 0: the local-only rate
    for r in rows:
        if "capacity_fraction" in r and r["capacity"] != "unbounded":
            point = (r["capacity_fraction"], r["hit_rate"])
            curves.setdefault(r["system"], [(0.0, local)]).append(point)
    curves["exact LRU L3 (simulated)"] = [(0.0, local), *lru_ref.items()]
    return report.plot(os.path.join(RESULTS, out + ".png"), curves, local, ceiling, title)


def main(argv=None) -> int:
    args = parse_args(argv)
    reqs = trace.load(args.trace, None if args.full else args.requests)
    bb = block_bytes(args)
    n_blocks, n_distinct, ceil_hits = trace.blocks(reqs), trace.distinct(reqs), trace.ceiling(reqs)
    ceiling = ceil_hits / n_blocks
    print(f"{len(reqs)} requests, {n_blocks} blocks, {n_distinct} distinct; ceiling "
          f"{100 * ceiling:.2f} %; block {bb} B ({args.model} / {args.scale}); "
          f"{args.instances} instances x {args.local_blocks} local blocks; "
          f"{'ordered' if args.speedup is None else f'concurrent, speed-up {args.speedup:g}'}",
          flush=True)
    fractions = [float(x) for x in args.capacities.split(",") if x]
    rows = sweep(reqs, args, bb, n_distinct * bb, fractions)
    local = rows[0]["local_rate"]
    lru_ref = {f: trace.simulate(reqs, args.instances, args.local_blocks, int(f * n_distinct))
               / n_blocks for f in fractions}
    print()
    print(f"ceiling (unbounded, from hash_ids) {100 * ceiling:.2f} %; local only {100 * local:.2f} %; "
          "exact-LRU L3 (simulated): "
          + ", ".join(f"{100 * f:g} % -> {100 * h:.2f} %" for f, h in lru_ref.items()))
    print(table(rows, COLUMNS))
    which = f"all {len(reqs)}" if args.full else f"first {len(reqs)}"
    png = draw(rows, lru_ref, ceiling, f"Mooncake conversation trace, {which} requests; "
               f"{args.instances} instances x {args.local_blocks} local blocks, {bb // 1024} KiB blocks",
               args.out)
    wrong = sum(r["wrong"] for r in rows)
    doc = {"args": vars(args), "trace": {"requests": len(reqs), "blocks": n_blocks,
                                         "distinct": n_distinct, "ceiling_hits": ceil_hits,
                                         "ceiling": ceiling},
           "block_bytes": bb, "local_rate": local, "lru_reference": lru_ref, "rows": rows,
           "wrong_blocks": wrong, "plot": png}
    print("wrote", write_json(args.out + ".json", doc), "and", png)
    if wrong:
        print(f"FAILED: {wrong} blocks read back wrong", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
