"""SGLang hybrid model (KV + Mamba state) through HiCacheMC's v1 + v2 calls.

    python benchmarks/bench_sglang_hybrid.py [--pages 32] [--states 2] [--iters 3]

Pools shaped like Qwen3-Next-80B-A3B at TP1 (defaults; every dimension is a flag): 12 full
attention layers with 2 KV heads of dim 256 (bf16, page 64: 1.5 MiB per KV page), and 36 linear
attention layers whose per-request state is one SSM state of 32 x 128 x 128 fp32 and one conv
state of 8192 x 3 bf16 per layer (about 73 MiB per state). SGLang keeps one state per radix node
end (a stop point), so a request of ``--pages`` KV pages backs up ``--states`` states.

Each iteration, as the controller calls the backend: backup = ``batch_set_v1`` of the KV pages
+ ``batch_set_v2`` of the states; lookup = one ``batch_exists_v2`` (KV + Mamba, trailing
pages); prefetch = ``batch_get_v1`` into other KV slots + ``batch_get_v2`` of the last state
into another state slot. Every load is checked byte for byte. Reports GB/s per call (median) and
the lookup's latency, against ``hicache-mc serve`` in another process.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from bench_sglang import import_sglang_on_cpu  # noqa: E402
from common import median, store_process, table, write_json  # noqa: E402


def build_pools(args):
    import torch
    from sglang.srt.mem_cache.device_pool_info import MambaStateBufferInfo
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    ps, layers = args.page_size, args.attn_layers
    dev = MHATokenToKVPool(size=2 * ps, page_size=ps, dtype=torch.bfloat16, head_num=args.kv_heads,
                           head_dim=args.head_dim, layer_num=layers, device="cpu",
                           enable_memory_saver=False, start_layer=0, end_layer=layers - 1)
    kv = MHATokenToKVPoolHost(dev.get_device_pool_infos()[0].buffer_info, 1.0, 0, ps, "page_first",
                              pin_memory=False, device="cpu", device_capacity_tokens=dev.size,
                              start_layer=0, end_layer=layers - 1,
                              host_token_capacity=2 * args.pages * ps)
    slots, ml = 2 * args.states, args.mamba_layers
    info = MambaStateBufferInfo(
        temporal=torch.zeros((ml, slots, args.v_heads, args.k_dim, args.v_dim), dtype=torch.float32),
        conv=(torch.zeros((ml, slots, args.conv_dim, args.conv_kernel - 1), dtype=torch.bfloat16),))
    mamba = MambaPoolHost(info, 1.0, 0, device_capacity=slots, pin_memory=False, device="cpu",
                          layout="page_first")
    return kv, mamba


def fill(pool, seed: int) -> None:
    import torch
    g = torch.Generator().manual_seed(seed)
    for buf in pool.get_hybrid_pool_buffer() if hasattr(pool, "temporal_buffer") else [pool.kv_buffer]:
        buf.view(-1).view(torch.uint8).random_(0, 256, generator=g)


def same(pool, a, b) -> bool:
    import torch
    page = lambda i: pool.get_data_page(i, flat=True).view(torch.uint8)  # noqa: E731
    ps = pool.page_size
    return all(torch.equal(page(x), page(y)) for x, y in zip(a[::ps].tolist(), b[::ps].tolist()))


def run(args, master) -> dict:
    import torch
    from sglang.srt.mem_cache.hicache_storage import (HiCacheStorageConfig, PoolHitPolicy, PoolName,
                                                      PoolTransfer)
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
    from sglang.srt.mem_cache.utils import get_hash_str
    kv, mamba = build_pools(args)
    fill(kv, 1)
    fill(mamba, 2)
    cfg = HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
        model_name="bench/qwen3-next", extra_config={
            "backend_name": "hicache_mc", "module_path": "hicache_mc.sglang",
            "class_name": "HiCacheMC", "interface_v1": 1, "master": master,
            "transport": args.transport, "timeout_s": 120})
    backend = StorageBackendFactory.create_backend("dynamic", cfg, kv)
    backend.register_mem_pool_host(kv)
    backend.register_mem_host_pool_v2(kv, PoolName.KV)
    backend.register_mem_host_pool_v2(mamba, PoolName.MAMBA)
    backend.on_host_pools_registered()
    ps, n = args.page_size, args.pages
    tokens = torch.randint(0, 150_000, (n * ps,), generator=torch.Generator().manual_seed(3)).tolist()
    keys = list(get_hash_str(tokens, None, page_size=ps))
    stops = [n * (i + 1) // args.states for i in range(args.states)]    # node ends, 1-based
    kv_src, kv_dst = kv.alloc(n * ps), kv.alloc(n * ps)
    st_src, st_dst = mamba.alloc(args.states), mamba.alloc(1)
    out = {"kv_put_s": [], "state_put_s": [], "exists_s": [], "kv_get_s": [], "state_get_s": []}

    def timed(name, fn):
        t0 = time.perf_counter()
        r = fn()
        out[name].append(time.perf_counter() - t0)
        return r

    for _ in range(args.iters):
        backend.clear()
        assert all(timed("kv_put_s", lambda: backend.batch_set_v1(keys, kv_src)))
        put = timed("state_put_s", lambda: backend.batch_set_v2([PoolTransfer(
            PoolName.MAMBA, host_indices=st_src, keys=[keys[s - 1] for s in stops])]))
        assert all(put[PoolName.MAMBA])
        hit = timed("exists_s", lambda: backend.batch_exists_v2(keys, [PoolTransfer(
            PoolName.MAMBA, keys=keys[-1:], hit_policy=PoolHitPolicy.TRAILING_PAGES)]))
        assert hit.restorable_prefix_pages == stops, hit
        assert all(timed("kv_get_s", lambda: backend.batch_get_v1(keys, kv_dst)))
        assert same(kv, kv_src, kv_dst), "KV pages differ"
        got = timed("state_get_s", lambda: backend.batch_get_v2([PoolTransfer(
            PoolName.MAMBA, host_indices=st_dst, keys=keys[-1:])]))
        assert got[PoolName.MAMBA] == [True] and same(mamba, st_src[-1:], st_dst), "state differs"
    backend.clear()
    backend.close()
    return {"seconds": out, "kv_page_bytes": backend.geometry.page_bytes,
            "state_bytes": backend.side_pools["mamba"].geo.page_bytes}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pages", type=int, default=32, help="KV pages per request")
    ap.add_argument("--states", type=int, default=2, help="Mamba states (stop points) per request")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--attn-layers", type=int, default=12)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=256)
    ap.add_argument("--mamba-layers", type=int, default=36)
    ap.add_argument("--v-heads", type=int, default=32)
    ap.add_argument("--k-dim", type=int, default=128)
    ap.add_argument("--v-dim", type=int, default=128)
    ap.add_argument("--conv-dim", type=int, default=8192)
    ap.add_argument("--conv-kernel", type=int, default=4)
    ap.add_argument("--transport", default="shm")
    args = ap.parse_args()
    import_sglang_on_cpu()
    state_mib = args.mamba_layers * (args.v_heads * args.k_dim * args.v_dim * 4 +
                                     args.conv_dim * (args.conv_kernel - 1) * 2) / 2**20
    kv_mib = args.attn_layers * 2 * args.kv_heads * args.head_dim * 2 * args.page_size / 2**20
    dram = f"{int(2 * (args.pages * kv_mib + args.states * state_mib)) + 256}MiB"
    with store_process(dram) as master:
        r = run(args, master)
    s = r["seconds"]
    kv_bytes, st_bytes = args.pages * r["kv_page_bytes"], r["state_bytes"]
    rows = [{"call": "batch_set_v1 (KV)", "bytes": kv_bytes, "gbps": kv_bytes / median(s["kv_put_s"]) / 1e9},
            {"call": f"batch_set_v2 (Mamba, {args.states} states)", "bytes": args.states * st_bytes,
             "gbps": args.states * st_bytes / median(s["state_put_s"]) / 1e9},
            {"call": "batch_exists_v2 (KV + Mamba)", "ms": median(s["exists_s"]) * 1e3},
            {"call": "batch_get_v1 (KV)", "bytes": kv_bytes, "gbps": kv_bytes / median(s["kv_get_s"]) / 1e9},
            {"call": "batch_get_v2 (Mamba, 1 state)", "bytes": st_bytes,
             "gbps": st_bytes / median(s["state_get_s"]) / 1e9}]
    print(f"KV page {kv_mib:.2f} MiB x {args.pages}, Mamba state {state_mib:.1f} MiB, "
          f"transport {args.transport}, {args.iters} iterations (median)")
    print(table(rows, [("call", ""), ("bytes", "d"), ("gbps", ".2f"), ("ms", ".2f")]))
    print("wrote", write_json("bench_sglang_hybrid.json", {"args": vars(args), "rows": rows,
                                                           "seconds": s}))


if __name__ == "__main__":
    main()
