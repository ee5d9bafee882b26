"""Pure-torch references for ``pack_pages`` / ``unpack_pages``: index, stack, permute.

Written from the layout names alone (no stride formulas), so the kernel's address arithmetic
is checked against an independent statement of the same byte order. Data moves through an
integer view of the same width, so fp8 (and NaN payloads) are copied bit for bit on any
device. Also the "plain torch gather" baseline of ``benchmarks/bench_kernels.py``.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

_INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

# Blob dim order for each layout, as a permutation of the gathered (L, n, ps, H, D) tensor:
# the result is (n, <layout order>) e.g. page_first -> (n, ps, L, H, D).
_PERMUTE = {
    "page_first": (1, 2, 0, 3, 4),          # [ps][L][H][D]
    "page_first_direct": (1, 0, 2, 3, 4),   # [L][ps][H][D]
    "page_head": (1, 3, 2, 0, 4),           # [H][ps][L][D]
    "layer_first": (1, 0, 2, 3, 4),         # its L chunks in layer order: [L][ps][H][D]
}


def _as_int(t: torch.Tensor) -> torch.Tensor:
    return t.view(_INT_OF_WIDTH[t.element_size()])


def _slots(page_indices, page_size: int, device) -> torch.Tensor:
    pages = torch.as_tensor(page_indices, dtype=torch.int64, device=device)
    return (pages[:, None] * page_size + torch.arange(page_size, device=device)).reshape(-1)


def pack_pages_ref(buffers: Sequence[Sequence[torch.Tensor]], page_indices, page_size: int,
                   layout: str, *, layers: Optional[Sequence[int]] = None) -> torch.Tensor:
    """Blobs ``(n, parts, L*ps*H*D)``: part ``q`` of page ``page_indices[j]``, ``layout`` order."""
    first = buffers[0][0]
    layer_ids = range(len(buffers[0])) if layers is None else list(layers)
    slots = _slots(page_indices, page_size, first.device)
    n, (_, heads, dim) = slots.numel() // page_size, first.shape
    parts = []
    for part in buffers:
        gathered = torch.stack([_as_int(part[l])[slots] for l in layer_ids])  # (L, n*ps, H, D)
        gathered = gathered.view(len(layer_ids), n, page_size, heads, dim)
        parts.append(gathered.permute(_PERMUTE[layout]).reshape(n, -1))
    return torch.stack(parts, dim=1).view(first.dtype)


def unpack_pages_ref(blobs: torch.Tensor, buffers: Sequence[Sequence[torch.Tensor]],
                     page_indices, page_size: int, layout: str, *,
                     layers: Optional[Sequence[int]] = None) -> None:
    """Write blobs ``(n, parts, L*ps*H*D)`` into the device pages ``page_indices`` in place."""
    first = buffers[0][0]
    layer_ids = range(len(buffers[0])) if layers is None else list(layers)
    slots = _slots(page_indices, page_size, first.device)
    n, (_, heads, dim) = slots.numel() // page_size, first.shape
    order = _PERMUTE[layout]
    shape = [(len(layer_ids), n, page_size, heads, dim)[i] for i in order]
    inverse = [order.index(i) for i in range(5)]
    for q, part in enumerate(buffers):
        lf = _as_int(blobs[:, q]).reshape(shape).permute(inverse)  # (L, n, ps, H, D)
        for i, l in enumerate(layer_ids):
            _as_int(part[l])[slots] = lf[i].reshape(n * page_size, heads, dim)
