"""An SGLang plugin for the live test servers only: HiCache's host pools on a CPU-only machine.

Found through its entry point (``cpu_hicache-0.dist-info`` beside it on PYTHONPATH), so SGLang's
``load_plugins()`` runs it in every process it starts, as it runs hicache-mc's own plugin.
Three things stop HiCache on CPU in SGLang 0.5.23; this plugin stands in for each:

- ``pool_host/common.py`` pins every host pool with ``cudaHostRegister``: CPU pools here are
  allocated the same way and left unpinned;
- ``pool_host/mha.py`` imports its host<->device ``transfer_kv_*`` copies from sgl_kernel on
  CUDA/HIP/XPU only: the three copies the ``direct`` I/O backend calls (``layer_first`` and
  ``page_first_direct`` layouts) are given here as torch indexing, which is what they do;
- ``torch.cpu.Stream`` has no ``synchronize``: CPU copies are synchronous, so it returns at once.

The other layouts and the ``kernel`` I/O backend still fail on CPU, loudly (``NameError``).
"""
from __future__ import annotations

import torch


def _allocate_unpinned(dims, dtype, device, pin_memory, allocator,
                       registration_granularity_bytes=None):
    return allocator.allocate(dims, dtype=dtype, device=device)


def transfer_kv_direct(src_layers, dst_layers, src_indices, dst_indices, page_size):
    """Token rows ``src_indices`` of each source layer into rows ``dst_indices`` of its peer."""
    for src, dst in zip(src_layers, dst_layers):
        dst[dst_indices] = src[src_indices]


def transfer_kv_per_layer_direct_pf_lf(src_ptrs, dst_ptrs, src_indices, dst_indices, layer_id,
                                       page_size):
    """Host ``[page, layer, token in page, head, dim]`` (K, then V) into one device layer."""
    pages, offsets = src_indices // page_size, src_indices % page_size
    for src, dst in zip(src_ptrs, dst_ptrs):
        dst[dst_indices] = src[pages, layer_id, offsets]


def transfer_kv_all_layer_direct_lf_pf(src_ptrs, dst_ptrs, src_indices, dst_indices, page_size):
    """Every device layer (all K layers, then all V layers) into host page-first K and V."""
    layers = len(src_ptrs) // len(dst_ptrs)
    pages, offsets = dst_indices // page_size, dst_indices % page_size
    for i, src in enumerate(src_ptrs):
        dst_ptrs[i // layers][pages, i % layers, offsets] = src[src_indices]


def load() -> None:
    """The entry point: SGLang runs it in the launcher, scheduler and detokenizer processes."""
    from sglang.srt.mem_cache.pool_host import common, mha

    common.ALLOC_MEMORY_FUNCS["cpu"] = _allocate_unpinned
    for copy in (transfer_kv_direct, transfer_kv_per_layer_direct_pf_lf,
                 transfer_kv_all_layer_direct_lf_pf):
        setattr(mha, copy.__name__, copy)
    if not hasattr(torch.cpu.Stream, "synchronize"):
        torch.cpu.Stream.synchronize = lambda self: None
