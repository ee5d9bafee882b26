"""How one SGLang host-pool page maps onto store objects.

Each page becomes one object per part: ``k`` and ``v`` for MHA, ``kv`` for MLA, in the order
``get_page_buffer_meta`` gives the pointers. The page-contiguous layouts (``page_first``,
``page_first_direct``, ``page_head``) give one pointer per part, so objects move straight
between the store and host memory (zero-copy). ``layer_first`` gives one chunk per layer and
part (MHA: ``k_l0, v_l0, k_l1, v_l1, ...``; MLA: ``kv_l0, kv_l1, ...``); those chunks are
gathered into one object per part through a staging buffer, in layer order, so a part object
holds exactly the bytes of that part of SGLang's flat page (``get_data_page(flat=True)``).
That is also why the legacy flat-page API and the v1 API share objects: a flat page is its part
objects laid end to end, in every supported layout.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

MHA_LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")
MLA_LAYOUTS = ("layer_first", "page_first", "page_first_direct")


@dataclass(frozen=True)
class PageGeometry:
    """The store-side shape of one host page."""
    kind: str                     # "mha" or "mla"
    layout: str
    page_size: int                # tokens per page (host slots per key)
    parts: tuple[str, ...]        # ("k", "v") or ("kv",)
    part_bytes: tuple[int, ...]   # bytes of each part object
    chunks: int                   # host chunks per part: 1 (page-contiguous) or layers (layer_first)
    chunk_bytes: int              # bytes of one chunk when chunks > 1

    @property
    def zero_copy(self) -> bool:
        """True when each part is one contiguous range of host memory."""
        return self.chunks == 1

    @property
    def page_bytes(self) -> int:
        """Bytes of a whole page, all parts (the length of SGLang's flat page)."""
        return sum(self.part_bytes)


def pool_kind(pool) -> str:
    """``"mha"`` or ``"mla"``; ValueError for any other host pool."""
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
    if isinstance(pool, MLATokenToKVPoolHost):
        return "mla"
    if isinstance(pool, MHATokenToKVPoolHost):
        return "mha"
    raise ValueError(f"hicache_mc supports MHATokenToKVPoolHost and MLATokenToKVPoolHost, "
                     f"not {type(pool).__name__}")


def describe_pool(pool) -> PageGeometry:
    """Probe ``pool`` with its first page; ValueError (naming the reason) if it cannot be stored."""
    kind = pool_kind(pool)
    layout = pool.layout
    supported = MLA_LAYOUTS if kind == "mla" else MHA_LAYOUTS
    if layout not in supported:
        raise ValueError(f"hicache_mc: host layout {layout!r} is not supported for {kind.upper()} "
                         f"pools (use --hicache-mem-layout {' | '.join(supported)})")
    page_size = tokens_per_page(pool)
    parts = ("kv",) if kind == "mla" else ("k", "v")
    try:
        ptrs, sizes = pool.get_page_buffer_meta(torch.arange(page_size, dtype=torch.int64))
    except Exception as exc:
        raise ValueError(f"hicache_mc: {type(pool).__name__} in layout {layout!r} has no "
                         f"zero-copy page API: {exc}") from exc
    if not ptrs or len(ptrs) != len(sizes) or len(ptrs) % len(parts):
        raise ValueError(f"hicache_mc: {type(pool).__name__} gives {len(ptrs)} buffers per page; "
                         f"expected a multiple of {len(parts)}")
    chunks = len(ptrs) // len(parts)
    part_bytes = tuple(sum(sizes[p::len(parts)]) for p in range(len(parts)))
    if chunks > 1 and len(set(sizes)) != 1:
        raise ValueError(f"hicache_mc: uneven chunk sizes {sorted(set(sizes))} in layout {layout!r}")
    return PageGeometry(kind, layout, page_size, parts, part_bytes, chunks,
                        sizes[0] if chunks > 1 else 0)


def tokens_per_page(pool) -> int:
    """Host slots per key: the logical page (wider than ``page_size`` only under MLA DCP)."""
    return int(getattr(pool, "logical_page_size", None) or pool.page_size)
