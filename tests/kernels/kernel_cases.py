"""Pools, poisoned buffers and byte comparison shared by the kernel tests."""
from __future__ import annotations

import torch


def random_bytes(shape, dtype, device, gen: torch.Generator) -> torch.Tensor:
    """A tensor of ``dtype`` filled with random bytes (NaN and inf patterns included)."""
    isz = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (*shape[:-1], shape[-1] * isz), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).to(device)


def poisoned(shape, dtype, device) -> torch.Tensor:
    """A tensor of ``dtype`` whose bytes are all 0xFF (NaN for every float dtype here)."""
    isz = torch.empty((), dtype=dtype).element_size()
    raw = torch.full((*shape[:-1], shape[-1] * isz), 0xFF, dtype=torch.uint8, device=device)
    return raw.view(dtype)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN payloads included); works for fp8, which ``torch.equal`` may not."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def make_pool(parts: int, layers: int, heads: int, dim: int, dtype, page_size: int, pages: int,
              device, gen: torch.Generator, pad_heads: int = 0) -> list[list[torch.Tensor]]:
    """A layer-first device pool of random bytes: ``parts`` x ``layers`` tensors (slots, H, D).

    Slots are ``pages`` whole pages plus a ragged tail (SGLang pads its pools too). With
    ``pad_heads`` each slot row carries that many extra heads of padding, so the layer tensors
    are strided views, as in a fused K/V allocation.
    """
    slots = pages * page_size + page_size // 2 + 1
    pool = []
    for _ in range(parts):
        part = []
        for _ in range(layers):
            full = random_bytes((slots, heads + pad_heads, dim), dtype, device, gen)
            part.append(full[:, :heads])
        pool.append(part)
    return pool


def clone_pool(pool):
    """A deep copy keeping each layer's strides; ``full(t)`` reaches a copy's padding too."""
    return [[full(t).clone().as_strided(t.shape, t.stride(), t.storage_offset())
             for t in part] for part in pool]


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole allocation behind a layer view, padding included."""
    return t if t._base is None else t._base
