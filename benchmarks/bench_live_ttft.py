"""Time to first token with and without an L3 hit, through two live SGLang servers on CPU.

    python benchmarks/bench_live_ttft.py [--lengths 1024,2048,4096] [--reps 5] [--threads 1]

Two real SGLang 0.5.23 servers (tests/live: CPU engine, torch_native attention, HiCache with
``--hicache-storage-backend hicache_mc``) share one ``hicache-mc serve``. The model is a Qwen2
with random weights shaped so that a 64-token page is 1 MiB of KV (8 layers, 8 KV heads of 64,
bf16), with a small MLP so a prefill stays within seconds on a CPU. For each prompt length,
``--reps`` prompts that share no page, each:

- ``miss``: server a prefills it from scratch (its L3 lookup misses);
- ``l3``: server b, once the store holds a's pages, loads them from the L3 and prefills only
  the tail past the last whole page;
- ``l1``: a again, the whole prefix in its own device-side (L1) cache.

The time is the client's, from the request to the first streamed token; the table gives each
case's median and fastest run (other work on a shared machine only ever adds time). The
servers wait for every L3 hit (``wait_complete``) and probe through their residency views,
which ask the master for the pages they lack (the harness's defaults). These are CPU figures, not GPU figures: SGLang's ``torch_native``
attention pads an extend's queries to the whole sequence, so here a cached prefix saves its
projections and MLP but not its attention; a GPU skips the prefix whole, and there a miss
against an L3 hit is its compute against the copy of the pages. JSON in
``benchmarks/results/bench_live_ttft.json``.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
sys.path.insert(0, str(HERE))

import live  # noqa: E402
from common import machine, median, store_process, table, write_json  # noqa: E402
from procs import request  # noqa: E402
from hicache_mc import protocol as P  # noqa: E402

SHAPE = live.TinyModel(hidden=512, layers=8, heads=8, kv_heads=8, intermediate=1024,
                       context=8192)
PAGE = 64


def page_bytes(shape: live.TinyModel) -> int:
    """K and V of one page: page x layers x 2 x KV heads x head dim x 2 bytes (bf16)."""
    return PAGE * shape.layers * 2 * shape.kv_heads * (shape.hidden // shape.heads) * 2


def store_keys(master: str) -> int:
    reply = request(master, P.StatsRequest(), 5.0)
    return reply.stats["keys"] if isinstance(reply, P.StatsReply) else -1


def wait_stored(master: str, keys: int, timeout_s: float = 300.0) -> None:
    end = time.monotonic() + timeout_s
    while store_keys(master) < keys:
        if time.monotonic() > end:
            raise TimeoutError(f"the store did not reach {keys} keys in {timeout_s:.0f} s")
        time.sleep(0.05)


def one_prompt(a: live.SGLangServer, b: live.SGLangServer, master: str, ids: list[int]) -> dict:
    before = store_keys(master)
    miss = a.first_token(ids)
    wait_stored(master, before + 2 * ((len(ids) - 1) // PAGE))
    l3 = b.first_token(ids)
    l1 = a.first_token(ids)
    assert miss.cached_tokens == 0 and l3.storage_tokens > 0 and l1.cached_tokens > 0, \
        (miss, l3, l1)
    return {"miss": miss.seconds, "l3": l3.seconds, "l1": l1.seconds,
            "l3_tokens": l3.storage_tokens}


def run(lengths: list[int], reps: int, threads: int, workdir: Path) -> list[dict]:
    model = live.make_tiny_model(workdir / "model", SHAPE)
    options = live.ServerOptions(page_size=PAGE, max_total_tokens=4 * max(lengths),
                                 env={"OMP_NUM_THREADS": str(threads)})
    rows = []
    with store_process("1GiB") as master, \
            live.start_servers(model, master, workdir, names=("a", "b"), options=options) as (a, b):
        for seed, server in enumerate((a, b)):      # an L3 lookup each: builds SGLang's hash
            server.first_token(live.prompt_ids(8 * PAGE, seed=seed, vocab=SHAPE.vocab))
        for n in lengths:
            runs = [one_prompt(a, b, master, live.prompt_ids(n, seed=1000 * n + r, vocab=SHAPE.vocab))
                    for r in range(reps)]
            row = {"prompt_tokens": n, "pages": n // PAGE,
                   "l3_tokens": median([x["l3_tokens"] for x in runs])}
            for case in ("miss", "l3", "l1"):
                row[f"{case}_s"] = median([x[case] for x in runs])
                row[f"{case}_min_s"] = min(x[case] for x in runs)
            # medians, and the fastest of each case: other work on a shared machine only adds
            row["miss_over_l3"] = row["miss_s"] / row["l3_s"]
            row["l3_over_l1"] = row["l3_s"] / row["l1_s"]
            row["miss_over_l3_min"] = row["miss_min_s"] / row["l3_min_s"]
            row["runs"] = runs
            rows.append(row)
            print(table([row], COLS), flush=True)
    return rows


COLS = [("prompt_tokens", "d"), ("pages", "d"), ("l3_tokens", ".0f"), ("miss_s", ".3f"),
        ("l3_s", ".3f"), ("l1_s", ".3f"), ("miss_over_l3", ".2f"), ("l3_over_l1", ".2f"),
        ("miss_min_s", ".3f"), ("l3_min_s", ".3f"), ("miss_over_l3_min", ".2f")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", default="1024,2048,4096")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="OMP threads per server")
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    with tempfile.TemporaryDirectory(prefix="bench-live-ttft-") as tmp:
        rows = run(lengths, args.reps, args.threads, Path(tmp))
    print()
    print(table(rows, COLS))
    path = write_json("bench_live_ttft.json", {
        "command": "python benchmarks/bench_live_ttft.py " + " ".join(sys.argv[1:]),
        "note": "CPU figures (SGLang's CPU engine, torch_native attention, "
                f"{args.threads} OMP thread(s) per server): no GPU figures",
        "model": asdict(SHAPE), "page_tokens": PAGE, "page_bytes": page_bytes(SHAPE),
        "rows": rows})
    print(f"\n{os.path.relpath(path)}")


if __name__ == "__main__":
    main()
