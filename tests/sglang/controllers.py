"""SGLang 0.5.23's own cache controllers on CPU, with HiCacheMC attached, driven like the scheduler.

What runs unmodified: the controller's storage threads (prefetch, prefetch I/O, prefetch sync,
backup), its hashing, batching, acks and failure handling, and the factory that loads HiCacheMC.
What the test plays: the scheduler (queues in, acks out) and the L1 -> L2 copy (host pages are
filled directly; the device <-> host kernels come from sgl_kernel, which needs CUDA).
"""
from __future__ import annotations

import threading
import time
from array import array
from collections import Counter
from typing import Optional

import torch
from sglang.srt.managers.cache_controller import HiCacheController
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle
from sglang.srt.mem_cache.hicache_storage import PoolName
from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController
from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import build_pool_entry
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
from sglang.srt.mem_cache.pool_host.group import HostPoolGroup
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.utils import get_hash_str
from sglang.srt.runtime_context import get_parallel

from pools import DYNAMIC, fill_random, page_bytes, write_token_kv

ACK_TIMEOUT_S = 30.0
BACKEND_METHODS = ("batch_exists", "batch_get_v1", "batch_set_v1", "batch_get", "batch_set",
                   "get", "set", "exists", "batch_exists_v2", "batch_get_v2", "batch_set_v2")


def single_rank_layout() -> None:
    """The scheduler publishes the parallel layout before the controller attaches storage;
    without it attach fails ("derived parallel width 'attn_dcp_size' is not available").
    This is SGLang's public override API; one rank, no DCP."""
    get_parallel().override_permanently(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1,
                                        attn_dcp_size=1, attn_dcp_rank=0)


def clear_layout() -> None:
    get_parallel().clear_stamp()


def attached_controller(backend: str, extra: dict) -> HiCacheController:
    """SGLang's cache controller over a small MHA host pool, attaching ``backend`` as the
    scheduler does (its factory, its choice of page path)."""
    dev = MHATokenToKVPool(size=64, page_size=16, dtype=torch.bfloat16, head_num=2, head_dim=32,
                           layer_num=2, device="cpu", enable_memory_saver=False,
                           start_layer=0, end_layer=1)
    host = MHATokenToKVPoolHost(dev.get_device_pool_infos()[0].buffer_info, 2.0, 0, 16,
                                "page_first", pin_memory=False, device="cpu",
                                device_capacity_tokens=dev.size, start_layer=0, end_layer=1)
    allocator = PagedTokenToKVPoolAllocator(64, 16, torch.bfloat16, "cpu", dev, need_sort=False)
    single_rank_layout()
    try:
        return HiCacheController(allocator, host, 16, None, threading.Event(),
                                 write_policy="write_through", io_backend="direct",
                                 storage_backend=backend, model_name="test/plugin",
                                 storage_backend_extra_config=extra)
    finally:
        clear_layout()


class CallLog:
    """Which controller thread called which backend method, and with how many keys."""

    def __init__(self, backend):
        self.calls: list[tuple[str, str, int]] = []   # (method, thread target, keys)
        self.lock = threading.Lock()
        for name in BACKEND_METHODS:
            setattr(backend, name, self._wrap(name, getattr(backend, name)))

    def _wrap(self, name, fn):
        def call(*args, **kwargs):
            keys = args[0] if args else kwargs.get("keys", [])
            n = len(keys) if isinstance(keys, list) else 1
            # Python names a thread "Thread-N (<target function>)"
            thread = threading.current_thread().name
            target = thread[thread.find("(") + 1:-1] if "(" in thread else thread
            with self.lock:
                self.calls.append((name, target, n))
            return fn(*args, **kwargs)
        return call

    def by_thread(self) -> dict[str, set[str]]:
        out: dict[str, set[str]] = {}
        with self.lock:
            for method, target, _ in self.calls:
                out.setdefault(method, set()).add(target)
        return out

    def sizes(self, method: str) -> list[int]:
        with self.lock:
            return [n for m, _, n in self.calls if m == method]

    def count(self) -> Counter:
        with self.lock:
            return Counter(m for m, _, _ in self.calls)

    def reset(self) -> None:
        with self.lock:
            self.calls.clear()


class ControllerRig:
    """A device pool, a host pool and one SGLang controller with HiCacheMC behind it."""

    def __init__(self, master: str, *, kind: str = "mha", layout: str = "page_first",
                 hybrid: bool = True, dtype=torch.bfloat16, page_size: int = 16, layers: int = 3,
                 heads: int = 2, head_dim: int = 32, device_tokens: int = 256,
                 host_ratio: float = 2.0, threshold: Optional[int] = None,
                 side: Optional[dict] = None, model: str = "test/controller",
                 attach: bool = True, **extra):
        self.page_size = page_size
        if kind == "mla":
            self.device = MLATokenToKVPool(
                size=device_tokens, page_size=page_size, dtype=dtype, kv_lora_rank=head_dim,
                qk_rope_head_dim=16, layer_num=layers, device="cpu", enable_memory_saver=False,
                start_layer=0, end_layer=layers - 1)
            self.host = MLATokenToKVPoolHost(
                self.device.get_device_pool_infos()[0].buffer_info, host_ratio, 0, page_size,
                layout, pin_memory=False, device="cpu", device_capacity_tokens=self.device.size,
                start_layer=0, end_layer=layers - 1, target_layer_num=layers)
        else:
            self.device = MHATokenToKVPool(
                size=device_tokens, page_size=page_size, dtype=dtype, head_num=heads,
                head_dim=head_dim, layer_num=layers, device="cpu", enable_memory_saver=False,
                start_layer=0, end_layer=layers - 1)
            self.host = MHATokenToKVPoolHost(
                self.device.get_device_pool_infos()[0].buffer_info, host_ratio, 0, page_size,
                layout, pin_memory=False, device="cpu", device_capacity_tokens=self.device.size,
                start_layer=0, end_layer=layers - 1,
                write_back_staging=getattr(self.device, "hicache_write_back_staging", None))
        allocator = PagedTokenToKVPoolAllocator(device_tokens, page_size, dtype, "cpu",
                                                self.device, need_sort=False)
        self.config = {**DYNAMIC, "master": master, "timeout_s": 2.0, **extra}
        # attach=False: no storage at start (SGLang's runtime attach adds it later)
        common = dict(write_policy="write_through", io_backend="direct",
                      storage_backend="dynamic" if attach else None,
                      prefetch_threshold=threshold or page_size,
                      model_name=model, storage_backend_extra_config=dict(self.config))
        self.hybrid = hybrid
        if hybrid:   # what the prefill-side UnifiedRadixCache builds (build_kv_only_stack)
            # ``side`` ({PoolName: host pool}) adds hybrid side pools (Mamba state, SWA) to the
            # group; their device side is never touched here, so they get no device pool.
            group = HostPoolGroup([build_pool_entry(
                name=PoolName.KV, host_pool=self.host, device_pool=self.device,
                layer_mapping={i: i for i in range(layers)}, transfer_layer_id_max=layers,
                is_anchor=True)] + [build_pool_entry(
                    name=name, host_pool=pool, device_pool=None,
                    layer_mapping={i: i for i in range(layers)}, transfer_layer_id_max=layers)
                    for name, pool in (side or {}).items()])
            self.ctl = HybridCacheController(allocator, group, page_size, None, threading.Event(),
                                             transfer_layer_id_max=layers, **common)
        else:        # the base controller (decode-side offload builds it directly)
            self.ctl = HiCacheController(allocator, self.host, page_size, None, threading.Event(),
                                         **common)
        self.backend = self.ctl.storage_backend
        self.log = CallLog(self.backend) if attach else None
        self.expected: dict[str, torch.Tensor] = {}      # page hash -> bytes written
        self._rid = 0

    # ------------------------------------------------------------- the scheduler's part

    def backup(self, tokens: list[int], seed: int, prefix_hash: Optional[str] = None,
               kv: Optional[torch.Tensor] = None) -> int:
        """Fill host pages for ``tokens`` (random bytes, or the per-token KV ``kv``: 2, tokens,
        layers, heads, dim), write_storage them with SGLang's page hashes, wait for the backup
        ack, free the host slots; returns the acked tokens."""
        ps = self.page_size
        hashes = list(get_hash_str(tokens, prefix_hash, page_size=ps))
        idx = self.host.alloc(len(hashes) * ps)
        assert idx is not None
        if kv is None:
            fill_random(self.host, idx, seed)
        else:
            write_token_kv(self.host, idx, kv[:, :idx.numel()])
        for h, b in zip(hashes, page_bytes(self.host, idx)):
            self.expected.setdefault(h, b)
        op_id = self.ctl.write_storage(idx, tokens, hash_value=hashes)
        op = self.ctl.ack_backup_queue.get(timeout=ACK_TIMEOUT_S)
        assert op.id == op_id
        self.host.free(idx)
        return op.completed_tokens

    def prefetch(self, tokens: list[int], last_hash: Optional[str] = None) -> dict:
        """One prefetch as the scheduler runs it; returns hit, loaded tokens and the host slots.

        Allocates host slots only once the hit is known (0.5.23), revokes hits below the
        threshold (no I/O), otherwise submits and reads acks until ``completed_req``.
        """
        self._rid += 1
        rid = f"req-{self._rid}"
        if self.hybrid:
            sub = self.ctl.submit_prefetch(CacheRequestHandle(rid, 0), RadixKey(array("q", tokens)),
                                           last_hash, None, None, None)
            op = sub.operation
        else:
            op = self.ctl.prefetch(rid, tokens, last_hash)
        hit = self.ctl.prefetch_hit_queue.get(timeout=ACK_TIMEOUT_S)
        assert hit is op
        hit_tokens = op.storage_hit_count
        if hit_tokens < self.ctl.prefetch_threshold:
            self.ctl.terminate_prefetch(op)           # revoked: no host slots, no I/O
            return {"hit": hit_tokens, "loaded": 0, "indices": None, "hashes": []}
        idx = self.ctl.alloc_prefetch_host_buffers(op, hit_tokens)
        assert idx is not None
        fill_random(self.host, idx, seed=self._rid + 7919)   # poison: unloaded pages stay wrong
        op.host_indices = idx
        self.ctl.prefetch_buffer.put(op)
        deadline = time.monotonic() + ACK_TIMEOUT_S
        loaded = 0
        while True:
            ack = self.ctl.ack_prefetch_queue.get(timeout=max(0.1, deadline - time.monotonic()))
            assert ack.operation is op
            if ack.completed_tokens is not None:
                assert ack.completed_tokens >= loaded          # acks are cumulative
                loaded = ack.completed_tokens
            if ack.completed_req:
                break
        return {"hit": hit_tokens, "loaded": loaded, "indices": idx,
                "hashes": op.hash_value[:loaded // self.page_size]}

    def check_bytes(self, result: dict) -> int:
        """Compare every loaded page with what was backed up under its hash; returns pages."""
        n = result["loaded"] // self.page_size
        got = page_bytes(self.host, result["indices"][:n * self.page_size]) if n else []
        for h, g in zip(result["hashes"], got):
            assert torch.equal(self.expected[h], g), f"page {h[:12]} differs"
        return n

    def release(self, result: dict) -> None:
        if result["indices"] is not None:
            self.host.free(result["indices"])

    def threads_alive(self) -> bool:
        c = self.ctl
        return all(t.is_alive() for t in (c.prefetch_thread, c.prefetch_io_aux_thread,
                                          c.prefetch_sync_thread, c.backup_thread))

    def close(self) -> None:
        self.ctl.detach_storage_backend()     # stops the threads, calls HiCacheMC.close()
