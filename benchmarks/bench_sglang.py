"""SGLang page stream: hicache-mc's v1 path against SGLang's own ``file`` backend, same pages.

    python benchmarks/bench_sglang.py [--layers 32] [--batch 128] [--iters 3] [--layout page_first]
                                      [--paths direct,controller,heads] [--transports shm,tcp]

A real ``MHATokenToKVPoolHost`` shaped like Llama-3-8B at TP1 (32 layers, 8 KV heads, head dim
128, bf16, page 64: 8 MiB per page, K and V 4 MiB each) holds one batch of random pages. Each
iteration stores the batch and loads it into other host slots, two ways:

``direct``: the backend calls, made the way SGLang's controller makes them:

- hicache-mc: ``batch_set_v1`` / ``batch_get_v1`` of the batch (128 pages = one controller
  chunk), with the ``shm`` and the ``tcp`` transport, against ``hicache-mc serve`` in another
  process; the backend is created by SGLang's ``StorageBackendFactory`` (``dynamic``).
- file: SGLang's ``HiCacheFile`` through the controller's generic path (``_generic_page_set``:
  ``batch_set`` of ``get_data_page`` pages; ``_generic_page_get``: ``batch_get`` into dummy flat
  pages, then ``set_from_flat_data_page``), reading once with its files in the page cache and
  once after ``fsync`` + ``posix_fadvise(DONTNEED)`` has pushed them out.

``controller``: SGLang's own ``HybridCacheController`` (what the prefill-side radix cache builds)
with each backend attached in turn: ``write_storage`` until the backup ack (backup thread), and a
prefetch of the same tokens from submission through the hit query (prefetch thread), the page
transfer (I/O thread) to the final ack (sync thread); the benchmark plays the scheduler.

``heads``: head groups for mixed TP sizes (``tp_lcm_size``): the ``direct`` calls over ``shm``
on a ``page_head`` pool, the rank storing each page as 1 (its own heads: equal TP sizes), 2 and
4 head groups, against the client calls the backend made before head groups, in the same run.

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


def build_pool(args, pages: int, layout: str = ""):
    import torch
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    ps = args.page_size
    dev = MHATokenToKVPool(size=2 * ps, page_size=ps, dtype=torch.bfloat16, head_num=args.heads,
                           head_dim=args.head_dim, layer_num=args.layers, device="cpu",
                           enable_memory_saver=False, start_layer=0, end_layer=args.layers - 1)
    return MHATokenToKVPoolHost(
        dev.get_device_pool_infos()[0].buffer_info, 1.0, 0, ps, layout or args.layout,
        pin_memory=False, device="cpu", device_capacity_tokens=dev.size, start_layer=0,
        end_layer=args.layers - 1, host_token_capacity=pages * ps)


def storage_config(extra: dict, model_name: str = "bench/llama-3-8b", page_first: bool = False,
                   tp_lcm_size: int = 1):
    """One TP-1 rank's config; ``tp_lcm_size`` > 1 splits its pages into that many head
    groups (SGLang sets ``should_split_heads`` for page_head)."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
    return HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=page_first,
        model_name=model_name, extra_config=extra, tp_lcm_size=tp_lcm_size,
        should_split_heads=tp_lcm_size > 1)


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
    put, warm, cold = [], [], []

    def generic_get():
        assert all(generic_page_get(backend, pool, keys, dst))

    for _ in range(iters):
        backend.clear()
        t0 = time.perf_counter()
        ok = generic_page_set(backend, pool, keys, src)
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


def generic_page_set(backend, pool, keys, src) -> bool:
    """HiCacheController._generic_page_set: what SGLang does for backends without the v1
    zero-copy calls (``file``): one copied page per key through ``batch_set``."""
    ps = pool.page_size
    return backend.batch_set(keys, [pool.get_data_page(src[i * ps]) for i in range(len(keys))])


def generic_page_get(backend, pool, keys, dst) -> list[bool]:
    """HiCacheController._generic_page_get: ``batch_get`` into dummy flat pages, then one
    ``set_from_flat_data_page`` per page."""
    ps = pool.page_size
    data = backend.batch_get(keys, [pool.get_dummy_flat_data_page() for _ in keys])
    for i, page in enumerate(data):
        if page is not None:
            pool.set_from_flat_data_page(dst[i * ps], page)
    return [page is not None for page in data]


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


# ------------------------------------------------------------------ through SGLang's controller

def build_controller(args, pool_pages: int, backend: str, extra: dict):
    """SGLang's HybridCacheController (what the prefill-side radix cache builds) over a
    Llama-shaped host pool, with ``backend`` attached; the caller plays the scheduler."""
    import threading
    import torch
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.hicache_storage import PoolName
    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController
    from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import build_pool_entry
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.pool_host.group import HostPoolGroup
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    from sglang.srt.runtime_context import get_parallel
    # The scheduler publishes the parallel layout before attaching storage; one rank here.
    get_parallel().override_permanently(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1,
                                        attn_dcp_size=1, attn_dcp_rank=0)
    ps, layers = args.page_size, args.layers
    dev = MHATokenToKVPool(size=2 * ps, page_size=ps, dtype=torch.bfloat16, head_num=args.heads,
                           head_dim=args.head_dim, layer_num=layers, device="cpu",
                           enable_memory_saver=False, start_layer=0, end_layer=layers - 1)
    host = MHATokenToKVPoolHost(
        dev.get_device_pool_infos()[0].buffer_info, 1.0, 0, ps, args.layout, pin_memory=False,
        device="cpu", device_capacity_tokens=dev.size, start_layer=0, end_layer=layers - 1,
        host_token_capacity=pool_pages * ps)
    group = HostPoolGroup([build_pool_entry(name=PoolName.KV, host_pool=host, device_pool=dev,
                                            layer_mapping={i: i for i in range(layers)},
                                            transfer_layer_id_max=layers, is_anchor=True)])
    allocator = PagedTokenToKVPoolAllocator(2 * ps, ps, torch.bfloat16, "cpu", dev, need_sort=False)
    return HybridCacheController(
        allocator, group, ps, None, threading.Event(), write_policy="write_through",
        io_backend="direct", storage_backend=backend, prefetch_threshold=ps,
        model_name="bench/llama-3-8b", storage_backend_extra_config=dict(extra),
        transfer_layer_id_max=layers)


def run_controller(ctl, src, dst, tokens, iters, file_dir=None) -> dict:
    """Backup (write_storage -> backup ack) and prefetch (hit query -> page transfer -> final
    ack) of one request of ``len(tokens)`` tokens, timed from submission to the last ack."""
    from array import array
    from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang.srt.mem_cache.utils import get_hash_str
    host, ps = ctl.storage_host_pool, ctl.page_size
    hashes = list(get_hash_str(tokens, None, page_size=ps))
    out = {"put_s": [], "get_s": []}
    if file_dir:
        out["cold_get_s"] = []

    def prefetch(rid: str) -> float:
        poison(host, dst)
        t0 = time.perf_counter()
        op = ctl.submit_prefetch(CacheRequestHandle(rid, 0), RadixKey(array("q", tokens)),
                                 None, None, None, None).operation
        assert ctl.prefetch_hit_queue.get(timeout=300) is op and op.storage_hit_count == len(tokens)
        op.host_indices = dst          # the scheduler's alloc_prefetch_host_buffers, pre-allocated
        ctl.prefetch_buffer.put(op)
        loaded = 0
        while True:   # cumulative acks per 128-page chunk, then completed_req
            ack = ctl.ack_prefetch_queue.get(timeout=300)
            loaded = ack.completed_tokens if ack.completed_tokens is not None else loaded
            if ack.completed_req:
                break
        took = time.perf_counter() - t0
        assert loaded == len(tokens) and same_pages(host, src, dst), rid
        return took

    for it in range(iters):
        ctl.storage_backend.clear()
        t0 = time.perf_counter()
        ctl.write_storage(src, tokens, hash_value=hashes)
        op = ctl.ack_backup_queue.get(timeout=300)
        out["put_s"].append(time.perf_counter() - t0)
        assert op.completed_tokens == len(tokens), "backup incomplete"
        out["get_s"].append(prefetch(f"warm-{it}"))
        if file_dir:
            evict_page_cache(file_dir)
            out["cold_get_s"].append(prefetch(f"cold-{it}"))
    ctl.storage_backend.clear()
    ctl.detach_storage_backend()
    return out


def controller_phase(args, master, file_dir, tokens) -> dict:
    import torch
    results = {}
    backends = [(f"hicache-mc ({t})", "dynamic", {
        "backend_name": "hicache_mc", "module_path": "hicache_mc.sglang", "class_name": "HiCacheMC",
        "interface_v1": 1, "master": master, "transport": t, "timeout_s": 120})
        for t in args.transports.split(",")]
    backends.append(("file", "file", {"file_storage_path": file_dir}))
    ctl = None
    for name, backend, extra in backends:
        if ctl is None:
            ctl = build_controller(args, 2 * args.batch, backend, extra)
            host = ctl.storage_host_pool
            src = host.alloc(args.batch * args.page_size)
            dst = host.alloc(args.batch * args.page_size)
            host.kv_buffer.view(-1).view(torch.uint8).random_(0, 256, generator=torch.Generator().manual_seed(2))
        else:   # same pool and pages, next backend (SGLang's runtime attach)
            ctl.attach_storage_backend(backend, args.page_size, "bench/llama-3-8b", dict(extra),
                                       host_pools=ctl.mem_pool_host.entries)
        results[name] = run_controller(ctl, src, dst, tokens, args.iters,
                                       file_dir if backend == "file" else None)
    return results


# ------------------------------------------------------------------ report

def rows_for(results: dict, batch_bytes: int, path: str) -> list[dict]:
    gbps = {name: {k[:-2]: batch_bytes / median(v) / 1e9 for k, v in r.items()}
            for name, r in results.items()}
    f = gbps["file"]
    rows = []
    if "memcpy" in gbps:
        rows.append({"path": path, "backend": "memcpy (host pool to host pool)",
                     "put_gbps": gbps["memcpy"]["put"]})
    for name, g in gbps.items():
        if name.startswith("hicache-mc"):
            rows.append({"path": path, "backend": name, "put_gbps": g["put"], "get_gbps": g["get"],
                         "put_x_file": g["put"] / f["put"], "get_x_file": g["get"] / f["get"],
                         "get_x_file_cold": g["get"] / f["cold_get"]})
    rows.append({"path": path, "backend": "file (SGLang HiCacheFile, generic)", "put_gbps": f["put"],
                 "get_gbps": f["get"], "cold_get_gbps": f["cold_get"]})
    return rows


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
    ap.add_argument("--paths", default="direct,controller",
                    help="direct: backend calls; controller: through SGLang's HybridCacheController")
    ap.add_argument("--file-dir", default=None, help="on a real disk, not tmpfs (default: a temp dir "
                    "under ~/.cache)")
    args = ap.parse_args()

    import_sglang_on_cpu()
    import torch
    from sglang.srt.mem_cache.utils import get_hash_str

    tokens = torch.randint(0, 128_000, (args.batch * args.page_size,),
                           generator=torch.Generator().manual_seed(1)).tolist()
    keys = list(get_hash_str(tokens, None, page_size=args.page_size))
    page_bytes = 2 * args.layers * args.heads * args.head_dim * 2 * args.page_size
    batch_bytes = page_bytes * args.batch
    print(f"{args.layers} layers x {args.heads} heads x {args.head_dim} dim, bf16, page {args.page_size}, "
          f"{args.layout} (heads: page_head): {page_bytes / 2**20:.1f} MiB/page, {args.batch} "
          f"pages = {batch_bytes / 2**30:.2f} GiB per call, {args.iters} iterations")

    base = args.file_dir or os.path.join(os.path.expanduser("~"), ".cache")
    os.makedirs(base, exist_ok=True)
    file_dir = tempfile.mkdtemp(prefix="hicache-file-bench-", dir=base)
    paths = args.paths.split(",")
    results, rows = {}, []
    # Two batches: after clear() the slots just read stay quarantined for one lease (2 s) before
    # reuse, so the next iteration writes into the other half; the heads path clears after each
    # of its four cases, which may follow each other within that time.
    dram = f"{int(batch_bytes * (4 if 'heads' in paths else 2) / 2**20) + 256}MiB"
    try:
        with store_process(dram) as master:
            if "direct" in paths:
                results["direct"] = direct_phase(args, master, file_dir, keys)
                rows += rows_for(results["direct"], batch_bytes, "direct")
            if "controller" in paths:
                results["controller"] = controller_phase(args, master, file_dir, tokens)
                rows += rows_for(results["controller"], batch_bytes, "controller")
            if "heads" in paths:
                results["heads"] = heads_phase(args, master, keys)
                rows += head_rows(results["heads"], batch_bytes)
    finally:
        shutil.rmtree(file_dir, ignore_errors=True)

    print(table(rows, [("path", ""), ("backend", ""), ("put_gbps", ".2f"), ("get_gbps", ".2f"),
                       ("cold_get_gbps", ".2f"), ("put_x_file", ".2f"), ("get_x_file", ".2f"),
                       ("get_x_file_cold", ".2f"), ("put_x_calls", ".3f"),
                       ("get_x_calls", ".3f"), ("put_cpu_x_calls", ".3f"),
                       ("get_cpu_x_calls", ".3f")]))
    print("direct: backend calls as the controller makes them; controller: SGLang's "
          "HybridCacheController threads, submission to last ack.\nput = backup, get = prefetch; "
          "get_x_file: file pages in the page cache; get_x_file_cold: after fadvise(DONTNEED)\n"
          "heads: page_head pool, one rank's pages in N head groups; x_calls: against the "
          "client calls the backend made before head groups (cpu: by this process's CPU time "
          "instead of wall time: higher is less CPU)")
    # the published figures (docs/sglang.md) come from the default paths: others go elsewhere
    name = "bench_sglang.json" if {"direct", "controller"} <= set(paths) else \
        f"bench_sglang_{'_'.join(paths)}.json"
    path = write_json(name, {"args": vars(args), "page_bytes": page_bytes,
                                            "batch_bytes": batch_bytes, "rows": rows,
                                            "seconds": results})
    print("wrote", path)


def direct_phase(args, master, file_dir, keys) -> dict:
    import torch
    pool = build_pool(args, 2 * args.batch)
    src, dst = pool.alloc(args.batch * args.page_size), pool.alloc(args.batch * args.page_size)
    pool.kv_buffer.view(-1).view(torch.uint8).random_(0, 256, generator=torch.Generator().manual_seed(0))
    results = {"memcpy": {"put_s": memcpy_s(pool, src, dst, args.iters)}}
    for transport in args.transports.split(","):
        results[f"hicache-mc ({transport})"] = run_hicache_mc(pool, src, dst, keys, master,
                                                              transport, args.iters)
    results["file"] = run_file(pool, src, dst, keys, args.iters, file_dir)
    return results


def heads_phase(args, master, keys) -> dict:
    """The store calls of one rank's pages as the backend made them before head groups (one
    namespace, ``k`` and ``v`` per page, straight from the client), then the backend storing
    them as 1, 2 and 4 head groups (``tp_lcm_size`` 1, 2, 4 at TP 1), over shm. Each case has
    its client set up beforehand; the cases take turns per iteration, each first in turn, so
    that drift on a shared machine hits them alike."""
    import torch
    from hicache_mc.client import StoreClient
    from hicache_mc.keys import batch_page_keys
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
    pool = build_pool(args, 2 * args.batch, layout="page_head")
    src, dst = pool.alloc(args.batch * args.page_size), pool.alloc(args.batch * args.page_size)
    pool.kv_buffer.view(-1).view(torch.uint8).random_(0, 256, generator=torch.Generator().manual_seed(3))
    # configured as the backend configures its own (view on, following the namespace)
    client = StoreClient(master, transport="shm", timeout_s=120, view="on")
    client.follow("bench-client-calls")
    raw_keys = batch_page_keys("bench-client-calls", keys, ("k", "v"))
    cases = {"client calls (keys before head groups)": (
        lambda: client.clear(prefix="bench-client-calls/"),
        lambda: all(client.batch_put_from(raw_keys, *pool.get_page_buffer_meta(src))),
        lambda: all(client.batch_get_into(raw_keys, *pool.get_page_buffer_meta(dst))))}
    backends = []
    for groups in (1, 2, 4):
        b = StorageBackendFactory.create_backend("dynamic", storage_config({
            "backend_name": "hicache_mc", "module_path": "hicache_mc.sglang",
            "class_name": "HiCacheMC", "interface_v1": 1, "master": master, "transport": "shm",
            "timeout_s": 120}, tp_lcm_size=groups), pool)
        b.register_mem_pool_host(pool)
        backends.append(b)
        cases[f"hicache-mc (shm), {groups} head group(s)"] = (
            b.clear, lambda b=b: all(b.batch_set_v1(keys, src)),
            lambda b=b: all(b.batch_get_v1(keys, dst)))
    results = {name: {"put_s": [], "get_s": [], "put_cpu_s": [], "get_cpu_s": []}
               for name in cases}
    names = list(cases)
    for it in range(args.iters):
        for name in names[it % len(names):] + names[:it % len(names)]:
            clear, put, get = cases[name]
            r = results[name]
            clear()
            t0, c0 = time.perf_counter(), time.process_time()
            assert put(), f"{name}: pages not stored"
            r["put_s"].append(time.perf_counter() - t0)
            r["put_cpu_s"].append(time.process_time() - c0)
            poison(pool, dst)
            t0, c0 = time.perf_counter(), time.process_time()
            ok = get()
            r["get_s"].append(time.perf_counter() - t0)
            r["get_cpu_s"].append(time.process_time() - c0)
            assert ok and same_pages(pool, src, dst), f"{name}: wrong pages read back"
            clear()
    for b in backends:
        b.close()
    client.close()
    return results


def head_rows(results: dict, batch_bytes: int) -> list[dict]:
    """GB/s by wall time, and by the CPU time of this process (the client's copies, hashing,
    keys and messages; not the node's) against the client calls': extra copies or objects show
    there even on a machine whose other load makes wall times swing."""
    gbps = {name: {k[:-2]: batch_bytes / median(v) / 1e9 for k, v in r.items()}
            for name, r in results.items()}
    one = next(iter(gbps.values()))
    return [{"path": "heads", "backend": name, "put_gbps": g["put"], "get_gbps": g["get"],
             "put_x_calls": g["put"] / one["put"], "get_x_calls": g["get"] / one["get"],
             "put_cpu_x_calls": g["put_cpu"] / one["put_cpu"],
             "get_cpu_x_calls": g["get_cpu"] / one["get_cpu"]}
            for name, g in gbps.items()]


if __name__ == "__main__":
    main()
