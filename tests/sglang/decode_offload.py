"""SGLang 0.5.23's decode-side KV offload (PD disaggregation) on CPU, with HiCacheMC behind it.

What runs unmodified: ``DecodeKVCacheOffloadManager`` (the decode scheduler's offload of each
request's output pages, its page hashing chained from the prefill's prompt hashes, its
device -> host -> L3 bookkeeping), the base ``HiCacheController`` it builds, the host pool it
builds (``build_kv_host_pool``), and the factory that loads HiCacheMC.

What the test plays, because it needs CUDA: registering the host pool with ``cudaHostRegister``
(a no-op here) and the device -> host copy (``backup_from_device_all_layer``, an ``sgl_kernel``
kernel on GPUs: here a torch copy of the same slots), and the scheduler, which decodes (fills
device slots with the KV of each output token) and polls ``check_offload_progress``.
"""
from __future__ import annotations

import contextlib
import json
import time
from array import array
import torch
import torch.distributed as dist
from sglang.srt.disaggregation.decode_kvcache_offload_manager import DecodeKVCacheOffloadManager
from sglang.srt.managers.schedule_batch import Req
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from sglang.srt.runtime_context import get_context, get_parallel
from sglang.srt.sampling.sampling_params import SamplingParams

from pools import DYNAMIC, write_token_kv

ACK_TIMEOUT_S = 30.0


def one_rank_group() -> bool:
    """The decode manager sizes its TP group with ``torch.distributed``: a one-process gloo
    group stands for it (ranks are stated through ``get_parallel``). True if made here."""
    if dist.is_initialized():
        return False
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return True


@contextlib.contextmanager
def cpu_host_pools():
    """SGLang registers host pools with ``cudaHostRegister``, which CPU torch lacks."""
    from sglang.srt.mem_cache.pool_host import common
    saved = common._cuda_host_register
    common._cuda_host_register = lambda *args, **kwargs: None
    try:
        yield
    finally:
        common._cuda_host_register = saved


def server_args(master: str, *, page_size: int, layout: str, model: str, **extra):
    """The decode server's flags, published as SGLang's scheduler publishes them; the caller
    restores them (``.restore()``)."""
    config = {**DYNAMIC, "master": master, "timeout_s": 2.0, **extra}
    override = get_context().override_server_args(
        page_size=page_size, hicache_storage_backend="dynamic",
        hicache_storage_backend_extra_config=json.dumps(config), hicache_mem_layout=layout,
        hicache_io_backend="kernel", hicache_ratio=2.0, served_model_name=model)
    override.install()
    return override


class DecodeRank:
    """One TP rank of a decode instance: its device KV pool, request rows and offload manager."""

    def __init__(self, *, page_size: int, layers: int, heads: int, head_dim: int,
                 tp_rank: int = 0, tp_size: int = 1, device_tokens: int = 1024,
                 dtype=torch.bfloat16):
        self.page_size, self.layers = page_size, layers
        self.device = MHATokenToKVPool(
            size=device_tokens, page_size=page_size, dtype=dtype, head_num=heads,
            head_dim=head_dim, layer_num=layers, device="cpu", enable_memory_saver=False,
            start_layer=0, end_layer=layers - 1)
        self.allocator = PagedTokenToKVPoolAllocator(device_tokens, page_size, dtype, "cpu",
                                                     self.device, need_sort=False)
        self.rows = ReqToTokenPool(8, device_tokens, "cpu", False)
        ranks = dict(tp_rank=tp_rank, tp_size=tp_size, attn_tp_rank=tp_rank,
                     attn_tp_size=tp_size, moe_tp_size=tp_size)   # a consistent TP-only layout
        with get_parallel().override(**ranks), cpu_host_pools():
            self.manager = DecodeKVCacheOffloadManager(self.rows, self.allocator, None, None)
        self.host = self.manager.decode_host_mem_pool
        self.host.backup_from_device_all_layer_physical = self._device_to_host
        self.backend = self.manager.cache_controller.storage_backend

    def _device_to_host(self, device_pool, host_indices, device_indices, io_backend) -> None:
        """The D2H copy of every layer's K and V into the host slots."""
        kv = torch.stack([torch.stack([b[layer][device_indices] for layer in range(self.layers)],
                                      dim=1) for b in (self.device.k_buffer, self.device.v_buffer)])
        write_token_kv(self.host, host_indices, kv)

    def admit(self, rid: str, prompt: list[int], kv: torch.Tensor, room: int = 256) -> Req:
        """A request arriving from prefill: its prompt's KV (``kv``: 2, tokens, L, H, D, this
        rank's heads) lands in device slots, as the PD transfer leaves it; ``room`` slots
        more are kept for its output tokens."""
        req = Req(rid, "", array("q", prompt), SamplingParams(max_new_tokens=1 << 16))
        self.rows.alloc([req])
        ps = self.page_size
        slots = self.allocator.alloc(-(-(len(prompt) + room) // ps) * ps)
        assert slots is not None, "device pool too small for the test"
        self.rows.write((req.kv.req_pool_idx, slice(0, slots.numel())), slots.to(torch.int32))
        self._fill(req, 0, kv)
        return req

    def decode(self, req: Req, tokens: list[int], kv: torch.Tensor) -> None:
        """Output tokens and their KV (the manager offloads a token's KV once the token after
        it is decoded: ``output_ids[:-1]``)."""
        start = len(req.origin_input_ids) + len(req.output_ids)
        req.output_ids.extend(tokens)
        self._fill(req, start, kv)

    def _fill(self, req: Req, start: int, kv: torch.Tensor) -> None:
        slots = self.rows.req_to_token[req.kv.req_pool_idx, start:start + kv.shape[1]].long()
        for layer in range(self.layers):
            self.device.k_buffer[layer][slots] = kv[0, :, layer]
            self.device.v_buffer[layer][slots] = kv[1, :, layer]

    def offload(self, req: Req) -> bool:
        """The scheduler's offload of ``req`` after a decode step, then its progress polls
        until every device -> host copy and every host -> L3 backup is acknowledged."""
        started = self.manager.offload_kv_cache(req)
        deadline = time.monotonic() + ACK_TIMEOUT_S
        while self.manager.ongoing_offload or self.manager.ongoing_backup:
            assert time.monotonic() < deadline, "decode offload never finished"
            self.manager.check_offload_progress()
            time.sleep(0.01)
        return started

    def close(self) -> None:
        self.manager.cache_controller.detach_storage_backend()
