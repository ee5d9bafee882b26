"""Host page layouts and the geometry of a layer-first device KV pool.

A device pool part (MHA: K and V; MLA: the one latent KV buffer) is a list of per-layer tensors
of shape ``(slots, H, D)``; page ``p`` is slots ``[p*ps, (p+1)*ps)``. A page blob holds the
``L`` selected layers of one page of one part, in the byte order of SGLang's host pool page
(``sglang/srt/mem_cache/pool_host/mha.py``, ``init_kv_buffer``):

==================== ================== ==========================================
layout               blob order         element (l, t, h, d) at blob offset
==================== ================== ==========================================
``page_first``        ``[ps][L][H][D]``  ``((t*L + l)*H + h)*D + d``
``page_first_direct`` ``[L][ps][H][D]``  ``((l*ps + t)*H + h)*D + d``
``page_head``         ``[H][ps][L][D]``  ``((h*ps + t)*L + l)*D + d``
``layer_first``       ``[L][ps][H][D]``  as ``page_first_direct``
==================== ================== ==========================================

A ``layer_first`` host page is ``L`` scattered chunks; its store object (the chunks in layer
order, as ``hicache_mc.sglang`` stages them) and its flat ``get_data_page`` have the
``page_first_direct`` byte order, so ``layer_first`` is accepted as that order. MLA host pools
(``pool_host/mla.py``) have ``page_first``, ``page_first_direct`` and ``layer_first``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

LAYOUTS = ("page_first", "page_first_direct", "page_head", "layer_first")
MLA_LAYOUTS = ("page_first", "page_first_direct", "layer_first")
LAYOUT_IDS = {"page_first": 0, "page_first_direct": 1, "page_head": 2, "layer_first": 1}

# fp8 payloads are moved as bytes, so any 1-byte dtype works; SGLang stores fp8 KV as uint8.
SUPPORTED_DTYPES = (
    torch.float16, torch.bfloat16, torch.float32,
    torch.float8_e4m3fn, torch.float8_e5m2, torch.uint8, torch.int8,
)


@dataclass(frozen=True)
class PoolGeometry:
    """Validated shape of a device pool: ``parts`` x ``L`` layer tensors of ``(slots, H, D)``."""
    parts: int
    layer_ids: tuple[int, ...]     # which layers of each part's list go into a blob, in order
    slots: int
    heads: int
    head_dim: int
    row_stride: int                # elements between consecutive slots (>= H*D; a fused pool pads)
    dtype: torch.dtype
    device: torch.device
    page_size: int

    @property
    def layers(self) -> int:
        return len(self.layer_ids)

    @property
    def pages(self) -> int:
        """Whole pages the pool holds (SGLang pads the slot count, so a tail may be partial)."""
        return self.slots // self.page_size

    @property
    def blob_numel(self) -> int:
        """Elements in one page blob of one part: ``L * ps * H * D``."""
        return self.layers * self.page_size * self.heads * self.head_dim


def check_layout(layout: str, parts: int) -> None:
    """Raise ``ValueError`` unless ``layout`` is a host layout the pool kind (MHA/MLA) has."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if parts == 1 and layout not in MLA_LAYOUTS:
        raise ValueError(f"MLA host pools have no {layout!r} layout; use one of {MLA_LAYOUTS}")


def pool_geometry(buffers: Sequence[Sequence[torch.Tensor]], page_size: int,
                  layers: Optional[Sequence[int]] = None) -> PoolGeometry:
    """Validate a device pool given as ``(k_layers, v_layers)`` (MHA) or ``(kv_layers,)`` (MLA).

    Every layer tensor must be 3-D ``(slots, H, D)`` with the same shape, dtype, device and slot
    stride, and each slot's ``H*D`` elements contiguous. ``layers`` picks the layer ids that go
    into a blob (a pipeline stage's range, say); default: all. Raises ``ValueError`` /
    ``TypeError`` naming what is wrong.
    """
    if isinstance(buffers, torch.Tensor) or len(buffers) not in (1, 2):
        raise ValueError("buffers must be (k_layers, v_layers) for MHA or (kv_layers,) for MLA")
    n_layers = len(buffers[0])
    if n_layers == 0 or any(len(part) != n_layers for part in buffers):
        raise ValueError(f"every part needs the same non-zero number of layers, got "
                         f"{[len(part) for part in buffers]}")
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
        raise ValueError(f"page_size must be a positive int, got {page_size!r}")
    first = buffers[0][0]
    if not isinstance(first, torch.Tensor) or first.dim() != 3:
        raise ValueError(f"each layer must be a 3-D (slots, H, D) tensor, got "
                         f"{getattr(first, 'shape', type(first))}")
    if first.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"unsupported KV dtype {first.dtype}; supported: {SUPPORTED_DTYPES}")
    slots, heads, head_dim = first.shape
    if len(buffers) == 1 and heads != 1:
        raise ValueError(f"MLA layers must be (slots, 1, C), got {tuple(first.shape)}")
    row_stride = first.stride(0)
    for q, part in enumerate(buffers):
        for i, t in enumerate(part):
            where = f"buffers[{q}][{i}]"
            if not isinstance(t, torch.Tensor) or t.shape != first.shape:
                raise ValueError(f"{where} has shape {getattr(t, 'shape', None)}, "
                                 f"expected {tuple(first.shape)}")
            if t.dtype != first.dtype or t.device != first.device:
                raise TypeError(f"{where} is {t.dtype} on {t.device}, expected "
                                f"{first.dtype} on {first.device}")
            if t.stride(2) != 1 or t.stride(1) != head_dim:
                raise ValueError(f"{where} must have contiguous (H, D) rows; strides {t.stride()}")
            if t.stride(0) != row_stride or row_stride < heads * head_dim:
                raise ValueError(f"{where} slot stride {t.stride(0)} differs from "
                                 f"{row_stride} or overlaps rows of {heads * head_dim}")
    layer_ids = tuple(range(n_layers)) if layers is None else tuple(int(x) for x in layers)
    if not layer_ids or any(not 0 <= x < n_layers for x in layer_ids):
        raise ValueError(f"layers must be a non-empty selection of 0..{n_layers - 1}, "
                         f"got {layers!r}")
    if slots < page_size:
        raise ValueError(f"pool has {slots} slots, fewer than one page of {page_size}")
    return PoolGeometry(len(buffers), layer_ids, slots, heads, head_dim, row_stride,
                        first.dtype, first.device, page_size)


def check_page_indices(page_indices: torch.Tensor, geo: PoolGeometry, *, unique: bool,
                       check_values: bool = True) -> torch.Tensor:
    """Return ``page_indices`` as a 1-D int64 tensor on the pool's device, checked in range.

    ``check_values`` reads the indices (one device sync on a GPU); ``unique`` also rejects
    repeats, which ``unpack`` needs (two writers to one slot would race).
    """
    if not isinstance(page_indices, torch.Tensor):
        page_indices = torch.as_tensor(page_indices, dtype=torch.int64)
    if page_indices.dim() != 1 or page_indices.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"page_indices must be a 1-D int32/int64 tensor, got "
                         f"{page_indices.dim()}-D {page_indices.dtype}")
    idx = page_indices.to(device=geo.device, dtype=torch.int64).contiguous()
    if check_values and idx.numel():
        lo, hi = int(idx.min()), int(idx.max())
        if lo < 0 or hi >= geo.pages:
            raise ValueError(f"page index out of range: [{lo}, {hi}] not within "
                             f"[0, {geo.pages}) ({geo.slots} slots / page {geo.page_size})")
        if unique and torch.unique(idx).numel() != idx.numel():
            raise ValueError("page_indices repeat a page; unpack needs distinct pages")
    return idx
