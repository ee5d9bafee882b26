"""Triton pack/unpack between a layer-first device KV pool and host-layout page blobs.

``pack_pages`` gathers pages of SGLang's device pool into blobs whose bytes equal SGLang's host
pool page in a chosen layout (see ``layouts.py`` for the byte orders); ``unpack_pages`` is the
inverse scatter. Both move raw words (int64 when sizes and addresses allow, else narrower), so
every dtype, fp8 included, is copied bit for bit.

One kernel serves all layouts and both directions. Program ``(j, q, l)`` owns layer ``l`` of
part ``q`` of the j-th listed page: ``ps`` slots of ``H*D`` elements, contiguous in the pool
when its rows are packed. It walks them in pool order (``t``, ``h``, ``d``) and maps each to its
blob offset ``l*s_l + t*s_t + h*s_h + d``; the layout only changes the three strides, so blob
writes are contiguous runs of ``H*D`` (page_first), ``ps*H*D`` (page_first_direct) or ``D``
(page_head) elements. The second grid axis splits a long slab into ``BLOCK``-word tiles.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Optional, Sequence

import torch
import triton
import triton.language as tl

from .launch import INTERPRET, launch
from .layouts import (LAYOUT_IDS, PoolGeometry, check_layout, check_page_indices,
                      pool_geometry)

_WORDS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}
_TL_WORDS = {8: tl.int64, 4: tl.int32, 2: tl.int16, 1: tl.uint8}
# Interpreter cost is ~0.5 ms per program iteration plus ~30 ns per element (cpu-toolchain 7.4):
# big tiles there. On a GPU 1024 words (8 KiB) per tile is the untuned default; the benchmark
# sweeps it (benchmarks/bench_kernels.py --sweep).
_BLOCK_WORDS = 16384 if INTERPRET else 1024
_MAX_GRID_1 = 65535          # CUDA limit of grid.y; the kernel loops over tiles beyond it
_PTR_TABLES: "OrderedDict[tuple, torch.Tensor]" = OrderedDict()
_PTR_TABLES_MAX = 32         # a handful of pools (K/V, MLA, draft) per process


@triton.jit
def _page_copy_kernel(
    ptr_table,            # int64 [parts * L]: address of each selected layer tensor
    blob_ptr,             # page blobs: page j, part q at blob_ptr + j*blob_page + q*blob_part
    page_idx_ptr,         # int64 [n]: device page numbers
    row_stride,           # words between pool slots
    blob_page_stride,     # words
    blob_part_stride,     # words
    PARTS: tl.constexpr, LAYERS: tl.constexpr, PAGE_SIZE: tl.constexpr,
    HEADS: tl.constexpr, DIM_W: tl.constexpr,        # DIM_W: words per head
    LAYOUT: tl.constexpr, UNPACK: tl.constexpr, WORD: tl.constexpr, BLOCK: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    layer = pid % LAYERS
    part = (pid // LAYERS) % PARTS
    j = pid // (LAYERS * PARTS)
    ROW: tl.constexpr = HEADS * DIM_W
    SLAB: tl.constexpr = PAGE_SIZE * ROW
    if LAYOUT == 0:    # page_first [ps][L][H][D]
        s_l = ROW
        s_t = LAYERS * ROW
    elif LAYOUT == 1:  # page_first_direct [L][ps][H][D]
        s_l = PAGE_SIZE * ROW
        s_t = ROW
    else:              # page_head [H][ps][L][D]
        s_l = DIM_W
        s_t = LAYERS * DIM_W
    page = tl.load(page_idx_ptr + j).to(tl.int64)
    pool = tl.load(ptr_table + part * LAYERS + layer).to(tl.pointer_type(WORD))
    pool += page * PAGE_SIZE * row_stride
    blob = blob_ptr.to(tl.pointer_type(WORD)) + j * blob_page_stride + part * blob_part_stride
    blob += layer * s_l
    # In-slab offsets stay int32 (the launcher checks they fit): cheaper index math on a GPU.
    # Everything scaled by a page, part or layer number went int64 above.
    for start in range(tl.program_id(1) * BLOCK, SLAB, tl.num_programs(1) * BLOCK):
        e = start + tl.arange(0, BLOCK)
        mask = e < SLAB
        t = e // ROW
        r = e % ROW
        if LAYOUT == 2:
            b_off = t * s_t + (r // DIM_W) * (PAGE_SIZE * LAYERS * DIM_W) + r % DIM_W
        else:
            b_off = t * s_t + r
        p_off = t * row_stride + r
        if UNPACK:
            tl.store(pool + p_off, tl.load(blob + b_off, mask=mask), mask=mask)
        else:
            tl.store(blob + b_off, tl.load(pool + p_off, mask=mask), mask=mask)


def _ptr_table(buffers: Sequence[Sequence[torch.Tensor]], geo: PoolGeometry) -> torch.Tensor:
    """Device int64 table of layer addresses, cached: one host-to-device copy per pool."""
    ptrs = tuple(part[l].data_ptr() for part in buffers for l in geo.layer_ids)
    key = (str(geo.device), ptrs)
    table = _PTR_TABLES.get(key)
    if table is None:
        table = torch.tensor(ptrs, dtype=torch.int64).to(geo.device)
        _PTR_TABLES[key] = table
        if len(_PTR_TABLES) > _PTR_TABLES_MAX:
            _PTR_TABLES.popitem(last=False)
    else:
        _PTR_TABLES.move_to_end(key)
    return table


def _word_bytes(geo: PoolGeometry, layout: str, table_ptrs: Sequence[int],
                blobs: torch.Tensor) -> int:
    """Widest word (8, 4, 2 or 1 bytes) dividing every address, stride and contiguous run."""
    isz = torch.empty((), dtype=geo.dtype).element_size()
    run = geo.head_dim if layout == "page_head" else geo.heads * geo.head_dim
    values = [run * isz, geo.row_stride * isz, blobs.stride(0) * isz, blobs.stride(1) * isz,
              blobs.data_ptr(), *table_ptrs]
    word = 8
    while any(v % word for v in values):
        word //= 2
    return word


def _check_blobs(blobs: torch.Tensor, geo: PoolGeometry, n: int, name: str) -> None:
    want = (n, geo.parts, geo.blob_numel)
    if not isinstance(blobs, torch.Tensor) or tuple(blobs.shape) != want:
        raise ValueError(f"{name} must have shape {want} (pages, parts, L*ps*H*D), got "
                         f"{tuple(getattr(blobs, 'shape', ()))}")
    if blobs.dtype != geo.dtype or blobs.device != geo.device:
        raise TypeError(f"{name} is {blobs.dtype} on {blobs.device}, the pool is "
                        f"{geo.dtype} on {geo.device}")
    if blobs.stride(2) != 1:
        raise ValueError(f"{name} must be contiguous within a blob; strides {blobs.stride()}")


def _run(geo: PoolGeometry, buffers, blobs, page_indices, layout, unpack, check_indices,
         block) -> None:
    check_layout(layout, geo.parts)
    if block is not None and (block < 16 or block & (block - 1)):
        raise ValueError(f"block must be a power of two >= 16, got {block}")
    idx = check_page_indices(page_indices, geo, unique=unpack, check_values=check_indices)
    _check_blobs(blobs, geo, idx.numel(), "blobs" if unpack else "out")
    if idx.numel() == 0:
        return
    table = _ptr_table(buffers, geo)
    word = _word_bytes(geo, layout, [part[l].data_ptr() for part in buffers
                                     for l in geo.layer_ids], blobs)
    isz = blobs.element_size()
    row_w = geo.heads * geo.head_dim * isz // word
    slab = geo.page_size * row_w
    limit = 2**31 * word // isz
    if geo.page_size * geo.row_stride >= limit or geo.blob_numel >= limit:
        raise ValueError("one page of one layer, or one blob, spans 2^31 words or more; "
                         "the kernel's in-page offsets are 32-bit")
    block = block or min(_BLOCK_WORDS, triton.next_power_of_2(slab))
    grid = (idx.numel() * geo.parts * geo.layers, min(triton.cdiv(slab, block), _MAX_GRID_1))
    launch(_page_copy_kernel, grid, table, blobs, idx,
           geo.row_stride * isz // word, blobs.stride(0) * isz // word,
           blobs.stride(1) * isz // word,
           PARTS=geo.parts, LAYERS=geo.layers, PAGE_SIZE=geo.page_size, HEADS=geo.heads,
           DIM_W=geo.head_dim * isz // word, LAYOUT=LAYOUT_IDS[layout], UNPACK=unpack,
           WORD=_TL_WORDS[word], BLOCK=block)


def pack_pages(buffers: Sequence[Sequence[torch.Tensor]], page_indices, page_size: int,
               layout: str, *, layers: Optional[Sequence[int]] = None,
               out: Optional[torch.Tensor] = None, check_indices: bool = True,
               block: Optional[int] = None) -> torch.Tensor:
    """Gather device pages into host-layout blobs; returns ``out`` of shape ``(n, parts, E)``.

    ``buffers``: ``(k_layers, v_layers)`` (MHA) or ``(kv_layers,)`` (MLA), per-layer tensors of
    ``(slots, H, D)``. ``page_indices``: device page numbers (slot // page_size), any order.
    ``layers``: layer ids to include (default all; a pipeline stage passes its range).
    ``out[j, q]`` receives part ``q`` of page ``page_indices[j]``: ``E = L*ps*H*D`` elements in
    ``layout`` order, i.e. the bytes SGLang's host pool holds at that page's ``k``/``v`` (or
    ``kv``) pointer; ``out[j]`` as a whole equals its flat ``get_data_page``. ``out`` may be a
    strided view (pages and parts at any distance) but each blob must be contiguous.
    ``check_indices`` reads the indices to range-check them (a device sync on a GPU).
    """
    geo = pool_geometry(buffers, page_size, layers)
    if out is None:
        n = len(page_indices)
        out = torch.empty((n, geo.parts, geo.blob_numel), dtype=geo.dtype, device=geo.device)
    _run(geo, buffers, out, page_indices, layout, False, check_indices, block)
    return out


def unpack_pages(blobs: torch.Tensor, buffers: Sequence[Sequence[torch.Tensor]],
                 page_indices, page_size: int, layout: str, *,
                 layers: Optional[Sequence[int]] = None, check_indices: bool = True,
                 block: Optional[int] = None) -> None:
    """Scatter host-layout blobs ``(n, parts, E)`` into the device pages ``page_indices``.

    The inverse of ``pack_pages`` with the same arguments; slots of other pages and layers not
    in ``layers`` are left untouched. Pages must be distinct (checked with ``check_indices``).
    """
    geo = pool_geometry(buffers, page_size, layers)
    _run(geo, buffers, blobs, page_indices, layout, True, check_indices, block)
