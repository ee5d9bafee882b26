"""Real SGLang host pools on CPU, storage configs, and page-byte helpers for the tests."""
from __future__ import annotations

import itertools

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
from sglang.srt.mem_cache.utils import get_hash_str

MHA_LAYOUTS = ["layer_first", "page_first", "page_first_direct", "page_head"]
MLA_LAYOUTS = ["layer_first", "page_first", "page_first_direct"]
DYNAMIC = {"backend_name": "hicache_mc", "module_path": "hicache_mc.sglang",
           "class_name": "HiCacheMC", "interface_v1": 1}


def mha_host(layout: str, dtype=torch.bfloat16, page_size: int = 16, layers: int = 3,
             heads: int = 2, head_dim: int = 32, tokens: int = 128) -> MHATokenToKVPoolHost:
    """A real MHA host pool (host = 2 x ``tokens`` device slots, rounded up to whole pages)."""
    dev = MHATokenToKVPool(size=tokens, page_size=page_size, dtype=dtype, head_num=heads,
                           head_dim=head_dim, layer_num=layers, device="cpu",
                           enable_memory_saver=False, start_layer=0, end_layer=layers - 1)
    return MHATokenToKVPoolHost(
        dev.get_device_pool_infos()[0].buffer_info, 2.0, 0, page_size, layout,
        pin_memory=False, device="cpu", device_capacity_tokens=dev.size,
        start_layer=dev.start_layer, end_layer=dev.end_layer,
        write_back_staging=getattr(dev, "hicache_write_back_staging", None))


def mla_host(layout: str, dtype=torch.bfloat16, page_size: int = 16, layers: int = 3,
             kv_lora_rank: int = 32, rope_dim: int = 16, tokens: int = 128) -> MLATokenToKVPoolHost:
    """A real MLA host pool (one latent vector of kv_lora_rank + rope_dim per token and layer)."""
    dev = MLATokenToKVPool(size=tokens, page_size=page_size, dtype=dtype,
                           kv_lora_rank=kv_lora_rank, qk_rope_head_dim=rope_dim, layer_num=layers,
                           device="cpu", enable_memory_saver=False, start_layer=0,
                           end_layer=layers - 1)
    return MLATokenToKVPoolHost(
        dev.get_device_pool_infos()[0].buffer_info, 2.0, 0, page_size, layout,
        pin_memory=False, device="cpu", device_capacity_tokens=dev.size,
        start_layer=dev.start_layer, end_layer=dev.end_layer, target_layer_num=layers)


def storage_config(master: str, *, model: str = "test/llama", mla: bool = False, tp_rank: int = 0,
                   tp_size: int = 1, layout: str = "page_first", tp_lcm_size: int | None = None,
                   **extra) -> HiCacheStorageConfig:
    """What HiCacheController._generate_storage_config builds, for one rank (it pops
    ``tp_lcm_size`` from the extra config into the config, and splits heads as below)."""
    return HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=mla, enable_storage_metrics=True, is_page_first_layout=layout == "page_first",
        model_name=model, tp_lcm_size=tp_lcm_size,
        should_split_heads=bool(tp_lcm_size) and not mla and layout == "page_head"
        and tp_lcm_size > tp_size,
        extra_config={**DYNAMIC, "master": master, "timeout_s": 2.0, **extra})


def make_backend(pool, master: str, *, mla: bool = False, **kw):
    """Create HiCacheMC through SGLang's own factory and attach ``pool`` like the controller does."""
    cfg = storage_config(master, mla=mla, layout=pool.layout, **kw)
    backend = StorageBackendFactory.create_backend("dynamic", cfg, pool)
    backend.register_mem_pool_host(pool)
    backend.on_host_pools_registered()
    return backend


_salt = itertools.count(1)


def page_hashes(n: int, page_size: int, salt: int | None = None) -> list[str]:
    """SGLang's own chained page hashes of ``n`` pages of distinct tokens."""
    salt = next(_salt) if salt is None else salt
    tokens = [(salt * 1_000_003 + i) % 150_000 for i in range(n * page_size)]
    return list(get_hash_str(tokens, None, page_size=page_size))


def slots(pool, pages: int) -> torch.Tensor:
    """Allocate ``pages`` host pages; int64 slot indices, page-aligned."""
    idx = pool.alloc(pages * pool.page_size)
    assert idx is not None, "host pool too small for the test"
    return idx


def fill_random(pool, idx: torch.Tensor, seed: int) -> None:
    """Random bytes into every page of ``idx`` (through SGLang's own flat-page setter)."""
    g = torch.Generator().manual_seed(seed)
    for start in idx[::pool.page_size].tolist():
        flat = pool.get_data_page(start, flat=True)
        noise = torch.randint(0, 256, (flat.numel() * flat.element_size(),), dtype=torch.uint8,
                              generator=g)
        pool.set_from_flat_data_page(start, noise.view(flat.dtype))


def page_bytes(pool, idx: torch.Tensor) -> list[torch.Tensor]:
    """A copy of each page's bytes, in SGLang's flat-page order."""
    return [pool.get_data_page(s, flat=True).contiguous().view(torch.uint8).clone()
            for s in idx[::pool.page_size].tolist()]


def zero_pages(pool, idx: torch.Tensor) -> None:
    for s in idx[::pool.page_size].tolist():
        flat = pool.get_data_page(s, flat=True)
        pool.set_from_flat_data_page(s, torch.zeros_like(flat))


def mamba_host(layers: int = 2, slots: int = 16, conv_shapes=((8, 3), (4, 3)),
               temporal_shape=(2, 8, 8), dtype=torch.bfloat16, temporal_dtype=torch.float32,
               layout: str = "page_first", extra_state: bool = False):
    """A real Mamba state host pool (Qwen3-Next shaped, scaled down): one slot per state, one
    temporal (SSM) state and one object per conv state, per layer."""
    from sglang.srt.mem_cache.device_pool_info import MambaStateBufferInfo
    from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost
    info = MambaStateBufferInfo(
        temporal=torch.zeros((layers, slots, *temporal_shape), dtype=temporal_dtype),
        conv=tuple(torch.zeros((layers, slots, *s), dtype=dtype) for s in conv_shapes),
        extra_checkpoint_buffers=(torch.zeros((slots, 4), dtype=torch.int32),) if extra_state
        else ())
    return MambaPoolHost(info, 2.0, 0, device_capacity=slots, pin_memory=False, device="cpu",
                         layout=layout)


def swa_host(layout: str = "page_first", page_size: int = 16, layers: int = 2,
             tokens: int = 128, **kw) -> MHATokenToKVPoolHost:
    """The SWA side pool of a sliding-window model: an MHA host pool over the SWA layers."""
    return mha_host(layout, page_size=page_size, layers=layers, tokens=tokens, **kw)


def logical_anchor(page_size: int = 16, tokens: int = 256):
    """DeepSeek-V4's KV anchor: page-aligned slots, no KV bytes."""
    from sglang.srt.mem_cache.memory_pool_host import LogicalHostPool
    return LogicalHostPool(tokens, page_size)


def make_hybrid_backend(master: str, anchor, side: dict, *, mla: bool = False, **kw):
    """HiCacheMC through SGLang's factory with ``anchor`` as the KV pool and ``side``
    ({PoolName: host pool}) registered the way HybridCacheController.attach_storage_backend does."""
    cfg = storage_config(master, mla=mla, layout=anchor.layout, **kw)
    return register_pools(StorageBackendFactory.create_backend("dynamic", cfg, anchor), anchor, side)


def register_pools(backend, anchor, side: dict):
    """Register ``anchor`` and ``side`` ({PoolName: host pool}) with any v2 backend, in
    HybridCacheController.attach_storage_backend's order; returns the backend."""
    from sglang.srt.mem_cache.hicache_storage import PoolName
    backend.register_mem_pool_host(anchor)
    backend.register_mem_host_pool_v2(anchor, PoolName.KV)
    for name, pool in side.items():
        backend.register_mem_host_pool_v2(pool, name)
    backend.on_host_pools_registered()
    return backend


def shuffled_slots(pool, pages: int, seed: int = 0) -> torch.Tensor:
    """``pages`` host pages whose slots are handed over in a shuffled page order."""
    idx = slots(pool, pages)
    order = torch.randperm(pages, generator=torch.Generator().manual_seed(seed))
    return idx.view(pages, pool.page_size)[order].reshape(-1)


def dsa_pools(page_size: int = 64, layers: int = 2, tokens: int = 256):
    """DeepSeek-V3.2's pools: the MLA KV anchor and its DSA indexer host pool (index keys with
    their scales, one object per page). SGLang's parallel layout must be set (DSATokenToKVPool
    reads the DCP size from it)."""
    from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool
    from sglang.srt.mem_cache.pool_host.dsa import DSAIndexerPoolHost, make_dsa_indexer_pool_decl
    dev = DSATokenToKVPool(size=tokens, page_size=page_size, kv_lora_rank=32, dtype=torch.bfloat16,
                           qk_rope_head_dim=16, layer_num=layers, device="cpu", index_head_dim=128,
                           enable_memory_saver=False, kv_cache_dim=48, start_layer=0,
                           end_layer=layers - 1)
    anchor = MLATokenToKVPoolHost(
        dev.get_device_pool_infos()[0].buffer_info, 2.0, 0, page_size, "page_first",
        pin_memory=False, device="cpu", device_capacity_tokens=dev.size, start_layer=0,
        end_layer=layers - 1, target_layer_num=layers)
    indexer = DSAIndexerPoolHost(make_dsa_indexer_pool_decl(dev), anchor, pin_memory=False,
                                 device="cpu")
    return anchor, indexer


def v4_paged_host(name: str, layout: str = "page_first", page_size: int = 64, layers: int = 2,
                  item_bytes: int = 256, pages: int = 8):
    """A DeepSeek-V4 paged side pool (compressed KV / indexer): ``item_bytes`` per page and layer,
    mirroring device buffers (here CPU tensors) page by page."""
    from sglang.srt.mem_cache.memory_pool_host import DeepSeekV4PagedHostPool
    return DeepSeekV4PagedHostPool(
        name, [torch.zeros((pages, item_bytes), dtype=torch.uint8) for _ in range(layers)],
        item_bytes=item_bytes, num_host_pages=pages, slot_page_size=page_size, layout=layout,
        pin_memory=False)


def wait_exists(backend, keys: list[str], n: int, timeout_s: float = 5.0) -> None:
    """Wait until ``batch_exists(keys) == n``: another client's put reaches the backend's
    residency view a moment after that put returned (the writer's own lookups see it at once)."""
    import time
    end = time.monotonic() + timeout_s
    while backend.batch_exists(keys) != n:
        assert time.monotonic() < end, f"batch_exists(keys) never reached {n}"
        time.sleep(0.005)


def wait_view_out_of_sync(backend, timeout_s: float = 5.0) -> None:
    """Wait until the backend's residency view stops answering, after the store went away (it
    notices the dropped connection at once, a silent master after 3 beats): until then its
    probes may say "stored", and the gets that follow miss."""
    import time
    view = backend.client.view
    end = time.monotonic() + timeout_s
    while view is not None and any(sp.synced for sp in view.spaces.values()):
        assert time.monotonic() < end, "the residency view did not notice the store went away"
        time.sleep(0.01)


def write_token_kv(pool, idx: torch.Tensor, kv: torch.Tensor) -> None:
    """Per-token KV ``kv`` (2, tokens, layers, heads, dim) into host slots ``idx`` of an MHA
    pool in ``page_first`` or ``page_head`` layout."""
    buf, ps = pool.kv_buffer, pool.page_size
    if pool.layout == "page_first":             # (2, slots, L, H, D)
        buf[:, idx] = kv
    elif pool.layout == "page_head":            # (2, pages, H, ps, L, D)
        # indices split by a slice put their dimension first: (tokens, 2, H, L, D)
        buf[:, idx // ps, :, idx % ps] = kv.permute(1, 0, 3, 2, 4)
    else:
        raise NotImplementedError(f"layout {pool.layout}")


def read_token_kv(pool, idx: torch.Tensor) -> torch.Tensor:
    """The per-token KV (2, tokens, layers, heads, dim) held in host slots ``idx``."""
    buf, ps = pool.kv_buffer, pool.page_size
    if pool.layout == "page_first":
        return buf[:, idx].clone()
    if pool.layout == "page_head":
        return buf[:, idx // ps, :, idx % ps].permute(1, 0, 3, 2, 4).clone()
    raise NotImplementedError(f"layout {pool.layout}")
