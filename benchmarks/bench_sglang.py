"""SGLang page stream: hicache-mc's v1 path against SGLang's own ``file`` backend, same pages.

    python benchmarks/bench_sglang.py [--layers 32] [--batch 128] [--iters 3] [--layout page_first]

A real ``MHATokenToKVPoolHost`` shaped like Llama-3-8B at TP1 (32 layers, 8 KV heads, head dim
128, bf16, page 64: 8 MiB per page, K and V 4 MiB each) holds one batch of random pages. Each
iteration stores the batch and loads it into other host slots, the way SGLang's controller does:

- hicache-mc: ``batch_set_v1`` / ``batch_get_v1`` of the batch (128 pages = one controller
  chunk), with the ``shm`` and the ``tcp`` transport, against ``hicache-mc serve`` in another
  process; the backend is created by SGLang's ``StorageBackendFactory`` (``dynamic``).
- file: SGLang's ``HiCacheFile`` through the controller's generic path (``_generic_page_set``:
  ``batch_set`` of ``get_data_page`` pages; ``_generic_page_get``: ``batch_get`` into dummy flat
  pages, then ``set_from_flat_data_page``), reading once with its files in the page cache and
  once after ``fsync`` + ``posix_fadvise(DONTNEED)`` has pushed them out.

Every load is checked byte for byte. Reports GB/s (median over iterations), and the ratio of
hicache-mc to the file backend. Memory: about 6 x the batch (1 GiB at the default shape): 2 of
host pool, 2 of store DRAM, 1 of the file backend's dummy pages, 1 of page cache; use
``--layers 8`` (or a smaller ``--batch``) on a small machine.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from common import median, store_process, table, write_json  # noqa: E402


def import_sglang_on_cpu() -> None:
    """On a CPU-only machine torchvision is absent; SGLang's model configs need its names only."""
    if importlib.util.find_spec("torchvision") is None:
        sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests", "sglang"))
        from sglang_env import apply_torchvision_stub
        apply_torchvision_stub()


def build_pool(args, pages: int):
    import torch
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    ps = args.page_size
    dev = MHATokenToKVPool(size=2 * ps, page_size=ps, dtype=torch.bfloat16, head_num=args.heads,
                           head_dim=args.head_dim, layer_num=args.layers, device="cpu",
                           enable_memory_saver=False, start_layer=0, end_layer=args.layers - 1)
    return MHATokenToKVPoolHost(
        dev.get_device_pool_infos()[0].buffer_info, 1.0, 0, ps, args.layout, pin_memory=False,
        device="cpu", device_capacity_tokens=dev.size, start_layer=0, end_layer=args.layers - 1,
        host_token_capacity=pages * ps)


def storage_config(extra: dict):
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
    return HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=False,
        model_name="bench/llama-3-8b", extra_config=extra)


def same_pages(pool, a, b) -> bool:
    import torch
    ps = pool.page_size
    page = lambda i: pool.get_data_page(i, flat=True).view(torch.uint8)  # noqa: E731 (bytes: NaN != NaN)
    return all(torch.equal(page(x), page(y)) for x, y in zip(a[::ps].tolist(), b[::ps].tolist()))


def run_hicache_mc(pool, src, dst, keys, master, transport, iters) -> dict:
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
    backend = StorageBackendFactory.create_backend("dynamic", storage_config({
        "backend_name": "hicache_mc", "module_path": "hicache_mc.sglang", "class_name": "HiCacheMC",
        "interface_v1": 1, "master": master, "transport": transport, "timeout_s": 120}), pool)
    backend.register_mem_pool_host(pool)
    put, get = [], []
    for _ in range(iters):
        backend.clear()
        t0 = time.perf_counter()
        ok = backend.batch_set_v1(keys, src)
        put.append(time.perf_counter() - t0)
        assert all(ok), f"{ok.count(False)} pages not stored"
        poison(pool, dst)
        t0 = time.perf_counter()
        ok = backend.batch_get_v1(keys, dst)
        get.append(time.perf_counter() - t0)
        assert all(ok) and same_pages(pool, src, dst), "hicache-mc read back wrong pages"
    backend.clear()
    backend.close()
    return {"put_s": put, "get_s": get}


def run_file(pool, src, dst, keys, iters, file_dir) -> dict:
    from sglang.srt.mem_cache.hicache_storage import HiCacheFile
    backend = HiCacheFile(storage_config({}), file_path=file_dir)
    ps = pool.page_size
    put, warm, cold = [], [], []

    def generic_get():  # HiCacheController._generic_page_get
        dummy = [pool.get_dummy_flat_data_page() for _ in keys]
        data = backend.batch_get(keys, dummy)
        for i, page in enumerate(data):
            assert page is not None
            pool.set_from_flat_data_page(dst[i * ps], page)

    for _ in range(iters):
        backend.clear()
        t0 = time.perf_counter()
        # HiCacheController._generic_page_set
        ok = backend.batch_set(keys, [pool.get_data_page(src[i * ps]) for i in range(len(keys))])
        put.append(time.perf_counter() - t0)
        assert ok
        poison(pool, dst)
        t0 = time.perf_counter()
        generic_get()
        warm.append(time.perf_counter() - t0)
        assert same_pages(pool, src, dst), "file backend read back wrong pages"
        evict_page_cache(file_dir)
        poison(pool, dst)
        t0 = time.perf_counter()
        generic_get()
        cold.append(time.perf_counter() - t0)
    backend.clear()
    return {"put_s": put, "get_s": warm, "cold_get_s": cold}


def poison(pool, idx) -> None:
    """Zero the destination pages, so a load that does nothing fails the check."""
    for start in idx[::pool.page_size].tolist():
        pool.get_data_page(start, flat=False).zero_()


def evict_page_cache(folder: str) -> None:
    """Write back and drop the cached pages of every file (no root needed for clean pages)."""
    for name in os.listdir(folder):
        fd = os.open(os.path.join(folder, name), os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def memcpy_s(pool, src, dst, iters) -> list[float]:
    """A plain copy of the same page bytes inside the host pool, for scale."""
    ps, times = pool.page_size, []
    for _ in range(iters):
        t0 = time.perf_counter()
        for a, b in zip(src[::ps].tolist(), dst[::ps].tolist()):
            pool.get_data_page(b, flat=False).copy_(pool.get_data_page(a, flat=False))
        times.append(time.perf_counter() - t0)
    return times


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--batch", type=int, default=128, help="pages per call (SGLang's chunk is 128)")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--layout", default="page_first",
                    choices=["page_first", "page_first_direct", "page_head", "layer_first"])
    ap.add_argument("--transports", default="shm,tcp")
    ap.add_argument("--file-dir", default=None, help="on a real disk, not tmpfs (default: a temp dir "
                    "under ~/.cache)")
    args = ap.parse_args()

    import_sglang_on_cpu()
    import torch
    from sglang.srt.mem_cache.utils import get_hash_str

    pool = build_pool(args, 2 * args.batch)
    src, dst = pool.alloc(args.batch * args.page_size), pool.alloc(args.batch * args.page_size)
    pool.kv_buffer.view(-1).view(torch.uint8).random_(0, 256, generator=torch.Generator().manual_seed(0))
    tokens = torch.randint(0, 128_000, (args.batch * args.page_size,), generator=torch.Generator().manual_seed(1))
    keys = list(get_hash_str(tokens.tolist(), None, page_size=args.page_size))
    page_bytes = pool.get_size_per_token() * args.page_size
    batch_bytes = page_bytes * args.batch
    print(f"{args.layers} layers x {args.heads} heads x {args.head_dim} dim, bf16, page {args.page_size}, "
          f"{args.layout}: {page_bytes / 2**20:.1f} MiB/page, {args.batch} pages = "
          f"{batch_bytes / 2**30:.2f} GiB per call, {args.iters} iterations")

    results = {"memcpy": {"put_s": memcpy_s(pool, src, dst, args.iters)}}
    # Two batches: after clear() the slots just read stay quarantined for one lease (2 s) before
    # reuse, so the next iteration writes into the other half.
    dram = f"{int(batch_bytes * 2 / 2**20) + 256}MiB"
    with store_process(dram) as master:
        for transport in args.transports.split(","):
            results[f"hicache-mc ({transport})"] = run_hicache_mc(pool, src, dst, keys, master,
                                                                  transport, args.iters)
    base = args.file_dir or os.path.join(os.path.expanduser("~"), ".cache")
    os.makedirs(base, exist_ok=True)
    file_dir = tempfile.mkdtemp(prefix="hicache-file-bench-", dir=base)
    try:
        results["file"] = run_file(pool, src, dst, keys, args.iters, file_dir)
    finally:
        shutil.rmtree(file_dir, ignore_errors=True)

    gbps = {name: {k[:-2]: batch_bytes / median(v) / 1e9 for k, v in r.items()}
            for name, r in results.items()}
    f = gbps["file"]
    rows = [{"backend": "memcpy (host pool to host pool)", "put_gbps": gbps["memcpy"]["put"]}]
    for name, g in gbps.items():
        if name.startswith("hicache-mc"):
            rows.append({"backend": name, "put_gbps": g["put"], "get_gbps": g["get"],
                         "put_x_file": g["put"] / f["put"], "get_x_file": g["get"] / f["get"],
                         "get_x_file_cold": g["get"] / f["cold_get"]})
    rows.append({"backend": "file (SGLang HiCacheFile, generic)", "put_gbps": f["put"],
                 "get_gbps": f["get"], "cold_get_gbps": f["cold_get"]})
    print(table(rows, [("backend", ""), ("put_gbps", ".2f"), ("get_gbps", ".2f"),
                       ("cold_get_gbps", ".2f"), ("put_x_file", ".2f"), ("get_x_file", ".2f"),
                       ("get_x_file_cold", ".2f")]))
    print("get_x_file: file pages in the page cache; get_x_file_cold: after fadvise(DONTNEED)")
    path = write_json("bench_sglang.json", {"args": vars(args), "page_bytes": page_bytes,
                                            "batch_bytes": batch_bytes, "rows": rows,
                                            "seconds": results})
    print("wrote", path)


if __name__ == "__main__":
    main()
