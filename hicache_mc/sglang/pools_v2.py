"""Sidecar host pools of hybrid models (Mamba, SWA, indexer, DeepSeek-V4, draft) as store objects.

SGLang 0.5.23 registers every host pool beyond the KV anchor through
``register_mem_host_pool_v2(pool, name)``. Each becomes a :class:`SidePool`: its page geometry,
probed like the KV pool's (``layout.py``), and a namespace of its own, so two pools never share
a key and a pool of another shape (layers, dtype, state size, layout, page size) is a miss.

A page of a side pool is one store object per buffer that ``get_page_buffer_meta`` returns for
it, in that order, named ``<pool namespace>/<page hash>/<i>``: the store reads and writes the host
slots directly (zero-copy). A ``layer_first`` pool returns a chunk per layer (and per K / V), so
its objects are grouped as the KV pool's are: one per part, its layers' chunks gathered through
the backend's staging buffer (``staging.py``), not one per chunk. A pool without that API (Mamba
with slot side states raises ``NotImplementedError``) stores one object per page, its flat page
(``get_data_page(flat=True)``), copied through a buffer: slower, but nothing is refused.
"""
from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from ..keys import NAMESPACE_CHARS, batch_page_keys, with_tenant
from .layout import tokens_per_page
from .staging import ChunkStager, Staging

logger = logging.getLogger("hicache_mc.sglang")

MAMBA = "mamba"   # PoolName.MAMBA: TP-sharded state even in an MLA model


@dataclass(frozen=True)
class SideGeometry:
    """The store-side shape of one page of a side pool."""
    pool_type: str                # the host pool's class name
    layout: str
    page_size: int                # host slots per key (1 for Mamba state)
    part_bytes: tuple[int, ...]   # bytes of each object of a page
    zero_copy: bool               # False: one flat object per page, copied
    chunks: int = 1               # host chunks per part: 1, or layers (layer_first, staged)
    chunk_bytes: int = 0          # bytes of one chunk when chunks > 1

    @property
    def parts(self) -> tuple[str, ...]:
        return tuple(str(i) for i in range(len(self.part_bytes)))

    @property
    def page_bytes(self) -> int:
        return sum(self.part_bytes)


@dataclass(frozen=True)
class PoolIO:
    """One pool's share of a batched store call: its keys, pointers and sizes, page-major."""
    name: object                  # the PoolTransfer's name, returned as SGLang gave it
    pages: int
    keys: list[str]
    ptrs: list[int]
    sizes: list[int]
    n_parts: int                  # objects per page
    # Flat pages copied in or out (kept alive for the call); empty when zero-copy.
    buffers: list[torch.Tensor] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)   # first host slot of each flat page


def probe_side_pool(pool) -> SideGeometry:
    """Probe ``pool`` with its first page; ValueError when its pages cannot be stored at all."""
    page_size = tokens_per_page(pool)
    layout = str(getattr(pool, "layout", ""))
    try:
        ptrs, sizes = pool.get_page_buffer_meta(torch.arange(page_size, dtype=torch.int64))
        ptrs, sizes = list(ptrs), [int(s) for s in sizes]
        # A nested pointer list (one object over several buffers) is not a contiguous range.
        if ptrs and len(ptrs) == len(sizes) and all(isinstance(p, int) for p in ptrs) \
                and all(s > 0 for s in sizes):
            return _grouped(SideGeometry(type(pool).__name__, layout, page_size, tuple(sizes),
                                         True), _opt_int(pool, "layer_num"))
    except Exception as exc:   # no zero-copy API for this pool (or this layout): flat pages
        logger.debug("hicache_mc: %s has no zero-copy page API (%s): flat pages",
                     type(pool).__name__, exc)
    try:
        flat = pool.get_dummy_flat_data_page()
        nbytes = flat.numel() * flat.element_size()
    except Exception as exc:
        raise ValueError(f"hicache_mc: {type(pool).__name__} has neither a zero-copy page API "
                         f"nor flat pages: {exc}") from exc
    if nbytes <= 0:
        raise ValueError(f"hicache_mc: {type(pool).__name__} pages hold no bytes")
    return SideGeometry(type(pool).__name__, layout, page_size, (nbytes,), False)


def _grouped(geo: SideGeometry, layers: Optional[int]) -> SideGeometry:
    """A layer_first page's chunks (``k_l0, v_l0, k_l1, ...`` or ``l0, l1, ...``) as one object
    per part, like the KV pool's; any other page as it is."""
    n = len(geo.part_bytes)
    if geo.layout != "layer_first" or not layers or layers < 2 or n % layers \
            or len(set(geo.part_bytes)) != 1:
        return geo
    parts, chunk = n // layers, geo.part_bytes[0]
    return SideGeometry(geo.pool_type, geo.layout, geo.page_size, (chunk * layers,) * parts,
                        True, layers, chunk)


def side_namespace(identity: dict, name: str, geo: SideGeometry, pool, tenant: str) -> str:
    """Digest of the deployment, the pool's name and everything that shapes its page bytes."""
    shape = {"type": geo.pool_type, "layout": geo.layout, "page_size": geo.page_size,
             "part_bytes": list(geo.part_bytes), "zero_copy": geo.zero_copy,
             "chunks": geo.chunks,
             "dtype": str(getattr(pool, "dtype", "")),
             # every buffer's dtype: a Mamba pool's ``dtype`` is its conv state's, and an SSM
             # state of another 2-byte dtype would otherwise share the namespace
             "dtypes": sorted({str(t.dtype) for t in _buffers(pool)}),
             "layers": _opt_int(pool, "layer_num"), "start_layer": _opt_int(pool, "start_layer")}
    blob = json.dumps(["pool", name, identity, shape], sort_keys=True).encode()
    return with_tenant(hashlib.sha256(blob).hexdigest()[:NAMESPACE_CHARS], tenant)


class SidePool:
    """A registered side pool: where its pages live on the host and what they are called."""

    def __init__(self, name, pool, geometry: SideGeometry, namespace: str, shared_by_tp: bool,
                 staging: Staging):
        self.name, self.pool, self.geo, self.namespace = name, pool, geometry, namespace
        # Replicated across TP ranks (MLA models, pools other than Mamba state and MHA pools):
        # one copy serves all ranks, so only the writer rank stores it and all read the same keys.
        self.shared_by_tp = shared_by_tp
        # layer_first: its own store calls, through the backend's staging buffer
        self.stager = ChunkStager(_buffers(pool), geometry, staging) if geometry.chunks > 1 \
            else None

    def keys(self, page_hashes: Sequence[str]) -> list[str]:
        return batch_page_keys(self.namespace, list(page_hashes), self.geo.parts)

    def io(self, name, page_hashes: Sequence[str], host_indices: Optional[torch.Tensor],
           *, load: bool) -> PoolIO:
        """Pointers of the host slots ``host_indices`` for ``page_hashes``; ValueError if
        they do not match (SGLang zips keys with slot pages in order)."""
        n, per = len(page_hashes), self.geo.page_size
        if host_indices is None or host_indices.numel() != n * per:
            got = None if host_indices is None else host_indices.numel()
            raise ValueError(f"pool {self.name}: {n} keys need {n * per} host slots, got {got}")
        keys = self.keys(page_hashes)
        host_indices = host_indices.cpu()
        if self.geo.zero_copy:
            ptrs, sizes = self.pool.get_page_buffer_meta(host_indices)
            ptrs, sizes = list(ptrs), [int(s) for s in sizes]
            g = self.geo
            want = [g.chunk_bytes] * (g.chunks * len(g.parts) * n) if g.chunks > 1 else \
                list(g.part_bytes) * n
            if sizes != want or len(ptrs) != len(sizes):
                raise ValueError(f"pool {self.name}: page buffers changed shape since start-up")
            return PoolIO(name, n, keys, ptrs, sizes, len(g.parts))
        starts = host_indices[::per].tolist()
        if load:
            buffers = [self.pool.get_dummy_flat_data_page().contiguous() for _ in starts]
        else:
            buffers = [self.pool.get_data_page(s, flat=True).contiguous() for s in starts]
        for b in buffers:
            if b.numel() * b.element_size() != self.geo.page_bytes or b.device.type != "cpu":
                raise ValueError(f"pool {self.name}: flat page is not {self.geo.page_bytes} "
                                 f"B in host memory")
        return PoolIO(name, n, keys, [b.data_ptr() for b in buffers],
                      [self.geo.page_bytes] * n, 1, buffers, starts)

    def scatter(self, io: PoolIO, pages_ok: Sequence[bool]) -> None:
        """After a flat-page load: copy every page that arrived whole into its host slots."""
        for start, buf, ok in zip(io.slots, io.buffers, pages_ok):
            if ok:
                self.pool.set_from_flat_data_page(start, buf)

    def tensors(self) -> list[torch.Tensor]:
        """Host tensors a transport registers (Mooncake TE): the pool's own list, else kv_buffer."""
        return _buffers(self.pool)


def _buffers(pool) -> list[torch.Tensor]:
    """A pool's host tensors: its own list (``get_hybrid_pool_buffer``), else ``kv_buffer``."""
    get = getattr(pool, "get_hybrid_pool_buffer", None)
    try:
        found = list(get()) if get is not None else []
    except Exception:
        found = []
    if not found:
        kv = getattr(pool, "kv_buffer", None)
        found = list(kv) if isinstance(kv, (list, tuple)) else [kv]
    return [t for t in found if isinstance(t, torch.Tensor) and t.numel() > 0]


def _opt_int(obj, attr: str) -> Optional[int]:
    value = getattr(obj, attr, None)
    try:
        return None if value is None else int(value)
    except (TypeError, ValueError):
        return None
