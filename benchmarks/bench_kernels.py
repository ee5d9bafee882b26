"""Pack/unpack kernels: correctness matrix, then GB/s beside a device copy and a torch gather.

    python benchmarks/bench_kernels.py                # on a GPU: the full run
    python benchmarks/bench_kernels.py --sweep        # also try BLOCK sizes, report the best
    python benchmarks/bench_kernels.py --smoke        # no GPU: Triton interpreter, tiny sizes

1. Correctness: every layout x MHA/MLA x fp16/bf16/fp32/fp8 x page size 1/16/64, on a regular
   and an odd shape (5 layers, 3 heads of dim 80), pages out of order, outputs poisoned with
   0xFF, compared bit for bit with the torch reference (pack and unpack).
2. Speed: 128 pages (in random order, from a pool of 256) of a Llama-3-8B-shaped pool (32
   layers, 8 KV heads of 128, bf16, page 64: 8 MiB per page) and a DeepSeek-V3-shaped MLA pool
   (61 layers, C = 576, bf16, page 64: 4.3 MiB per page). For each host layout: pack, unpack,
   the torch reference gather/scatter, and a device-to-device copy of the same bytes
   (``dst.copy_(src)``, contiguous). GB/s counts the page bytes once (read and write of N
   bytes = N); the target is pack and unpack >= 0.8 x the copy.

Without CUDA (``--smoke``, or automatically) it runs under ``TRITON_INTERPRET=1`` with 4 small
pages: a check that the script and kernels work, not a performance figure.
"""
from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import time

import torch

SMOKE = "--smoke" in sys.argv or not torch.cuda.is_available()
if SMOKE:
    os.environ.setdefault("TRITON_INTERPRET", "1")      # before the kernels are imported

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import table, write_json  # noqa: E402

from hicache_mc.kernels import (LAYOUTS, MLA_LAYOUTS, pack_pages, pack_pages_ref,  # noqa: E402
                                unpack_pages, unpack_pages_ref)

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float8_e4m3fn]
# (name, parts, layers, heads, head_dim)
CHECK_SHAPES = [("mha", 2, 4, 2, 64), ("mha-odd", 2, 5, 3, 80), ("mla", 1, 5, 1, 72)]
PERF_SHAPES = [("llama3-8b", 2, 32, 8, 128), ("deepseek-v3-mla", 1, 61, 1, 576)]


def random_pool(parts, layers, heads, dim, dtype, page_size, pages, device, gen):
    slots = pages * page_size + 1
    isz = torch.empty((), dtype=dtype).element_size()
    return [[torch.randint(0, 256, (slots, heads, dim * isz), dtype=torch.uint8, generator=gen)
             .to(device).view(dtype) for _ in range(layers)] for _ in range(parts)]


def poisoned(shape, dtype, device):
    isz = torch.empty((), dtype=dtype).element_size()
    return torch.full((*shape[:-1], shape[-1] * isz), 0xFF, dtype=torch.uint8,
                      device=device).view(dtype)


def same(a, b) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def check_case(parts, layers, heads, dim, dtype, ps, layout, device) -> bool:
    gen = torch.Generator().manual_seed(ps + layers)
    pool = random_pool(parts, layers, heads, dim, dtype, ps, 6, device, gen)
    pages = [5, 0, 3, 2]
    out = poisoned((len(pages), parts, layers * ps * heads * dim), dtype, device)
    pack_pages(pool, torch.tensor(pages, device=device), ps, layout, out=out)
    ok = same(out, pack_pages_ref(pool, pages, ps, layout))
    got = [[torch.zeros_like(t) for t in part] for part in pool]
    ref = [[torch.zeros_like(t) for t in part] for part in pool]
    unpack_pages(out, got, pages, ps, layout)
    unpack_pages_ref(out, ref, pages, ps, layout)
    return ok and all(same(g, r) for g, r in zip(itertools.chain(*got), itertools.chain(*ref)))


def correctness(device) -> list[dict]:
    rows = []
    for (name, parts, L, H, D), dtype, ps in itertools.product(CHECK_SHAPES, DTYPES, (1, 16, 64)):
        for layout in (MLA_LAYOUTS if parts == 1 else LAYOUTS):
            rows.append({"shape": name, "layout": layout, "dtype": str(dtype)[6:], "ps": ps,
                         "ok": check_case(parts, L, H, D, dtype, ps, layout, device)})
    return rows


def timed(fn, device, iters: int) -> float:
    """Median seconds of ``fn()`` after two warm-up calls."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(iters):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def speed(device, n_pages, iters, blocks) -> list[dict]:
    rows = []
    ps = 64 if not SMOKE else 16
    for name, parts, L, H, D in PERF_SHAPES:
        if SMOKE:
            L = min(L, 4)
        gen = torch.Generator().manual_seed(0)
        pool = random_pool(parts, L, H, D, torch.bfloat16, ps, 2 * n_pages, device, gen)
        pages = torch.randperm(2 * n_pages, generator=gen)[:n_pages].to(device)
        out = torch.empty((n_pages, parts, L * ps * H * D), dtype=torch.bfloat16, device=device)
        nbytes = out.numel() * out.element_size()
        copy_src = torch.empty_like(out)
        copy_s = timed(lambda: out.copy_(copy_src), device, iters)
        for layout in (MLA_LAYOUTS if parts == 1 else LAYOUTS):
            if layout == "layer_first":
                continue        # the same byte order (and code path) as page_first_direct
            best = {}
            for block in blocks:
                kw = {"check_indices": False, "block": block}
                b = {"block": block,
                     "pack": timed(lambda: pack_pages(pool, pages, ps, layout, out=out, **kw),
                                   device, iters),
                     "unpack": timed(lambda: unpack_pages(out, pool, pages, ps, layout, **kw),
                                     device, iters)}
                if not best or b["pack"] + b["unpack"] < best["pack"] + best["unpack"]:
                    best = b
            gather_s = timed(lambda: pack_pages_ref(pool, pages, ps, layout), device, iters)
            scatter_s = timed(lambda: unpack_pages_ref(out, pool, pages, ps, layout), device, iters)
            gbps = lambda s: nbytes / s / 1e9  # noqa: E731
            rows.append({"shape": name, "layout": layout, "MiB": nbytes / 2**20,
                         "block": best["block"] or "auto",
                         "copy GB/s": gbps(copy_s), "pack GB/s": gbps(best["pack"]),
                         "unpack GB/s": gbps(best["unpack"]), "gather GB/s": gbps(gather_s),
                         "scatter GB/s": gbps(scatter_s), "pack/copy": copy_s / best["pack"],
                         "unpack/copy": copy_s / best["unpack"]})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="CPU interpreter, tiny sizes")
    ap.add_argument("--pages", type=int, default=None, help="pages per batch (default 128)")
    ap.add_argument("--iters", type=int, default=None, help="timed repetitions (default 20)")
    ap.add_argument("--sweep", action="store_true", help="try BLOCK = 512..8192 words")
    ap.add_argument("--skip-check", action="store_true", help="speed only")
    args = ap.parse_args()
    device = "cpu" if SMOKE else "cuda"
    label = ("CPU Triton-interpreter SMOKE RUN: correctness only, GB/s are NOT performance figures"
             if SMOKE else torch.cuda.get_device_name())
    print(f"# {label}")
    doc = {"device": label, "smoke": SMOKE}
    if not args.skip_check:
        rows = correctness(device)
        bad = [r for r in rows if not r["ok"]]
        print(f"correctness: {len(rows) - len(bad)}/{len(rows)} cases bit-exact")
        for r in bad:
            print("  FAILED", r)
        doc["correctness"] = rows
    n_pages = args.pages or (4 if SMOKE else 128)
    iters = args.iters or (2 if SMOKE else 20)
    blocks = [512, 1024, 2048, 4096, 8192] if args.sweep and not SMOKE else [None]
    rows = speed(device, n_pages, iters, blocks)
    print(table(rows, [("shape", ""), ("layout", ""), ("MiB", ".0f"), ("block", ""),
                       ("copy GB/s", ".1f"), ("pack GB/s", ".1f"), ("unpack GB/s", ".1f"),
                       ("gather GB/s", ".1f"), ("scatter GB/s", ".1f"), ("pack/copy", ".2f"),
                       ("unpack/copy", ".2f")]))
    doc["speed"] = {"pages": n_pages, "iters": iters, "rows": rows}
    print("wrote", write_json("bench_kernels_smoke.json" if SMOKE else "bench_kernels.json", doc))
    if not args.skip_check and bad:
        sys.exit(1)


if __name__ == "__main__":
    main()
