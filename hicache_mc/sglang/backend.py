"""HiCacheMC: hicache-mc as an SGLang HiCache L3 storage backend.

Lifecycle, as SGLang's controller drives it (see docs/sglang.md):

1. ``HiCacheMC(storage_config, {})`` from ``StorageBackendFactory`` (``hicache_mc`` or ``dynamic``):
   settings from ``storage_config.extra_config``; a bad or unknown key fails start-up.
2. ``register_mem_pool_host(pool)``: probe the page geometry, fix the key namespace, refuse
   unsupported pools or layouts with a clear error (a pool without ``kv_buffer`` is a logical
   anchor: no KV bytes). Hybrid models: ``register_mem_host_pool_v2(pool, name)`` per side pool,
   then ``on_host_pools_registered()`` (``hybrid.py``).
3. Concurrently: ``batch_exists`` / ``batch_exists_v2`` (prefetch thread), ``batch_get_v1`` /
   ``batch_get_v2`` (prefetch I/O thread), ``batch_set_v1`` / ``batch_set_v2`` (backup thread),
   ``get_stats`` / ``clear`` (scheduler thread).
4. ``close()`` on detach.

From step 3 on nothing raises into SGLang and nothing returns ``None`` where SGLang expects a
list or a count: any failure becomes a miss / ``False``, logged once per episode.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import time
from typing import Any, List, Optional

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageExtraInfo

from ..client import Chain
from ..direct import kv_namespace
from .heads import HeadGroups, head_groups
from .hits_v2 import leading
from .hybrid import HybridPools
from .layout import PageGeometry, describe_pool
from .metrics import BatchMetrics, EpisodeLog
from .orphans import OrphanCount
from .settings import load_settings
from .staging import ChunkStager, Staging, fold_parts

logger = logging.getLogger("hicache_mc.sglang")


class HiCacheMC(HybridPools, HiCacheStorage):
    """SGLang ``HiCacheStorage`` backed by a hicache-mc cluster (zero-copy v1 and v2 paths)."""

    def __init__(self, storage_config, kwargs: Optional[dict] = None):
        from ..client import StoreClient
        self.storage_config = storage_config
        self.client_config, self.settings = load_settings(
            getattr(storage_config, "extra_config", None))
        if self.client_config.view == "auto":   # every prefetch probes: answer it locally
            self.client_config = dataclasses.replace(self.client_config, view="on")
        self.client = StoreClient(config=self.client_config)
        self.metrics = BatchMetrics()
        self.orphans = OrphanCount()
        self.episodes = EpisodeLog()
        self.geometry: Optional[PageGeometry] = None
        self.heads = HeadGroups(storage_config.tp_size, storage_config.tp_rank, 1)
        self.spaces: tuple[str, ...] = ()   # one namespace per head group (heads.py)
        self._stager: Optional[ChunkStager] = None
        # layer_first pools' (KV and side) staging, per thread
        self.staging = Staging(self._register, self._unregister)
        self.side_pools: dict = {}          # v2 side pools by name (hybrid.py)
        self.logical_anchor = False
        self._said_no_prefix = False        # hot_pages without SGLang's prefix keys: said once
        self.is_writer = bool(getattr(storage_config, "is_storage_writer",
                                      not storage_config.is_mla_model or storage_config.tp_rank == 0))
        self._check_store()

    def _check_store(self) -> None:
        """Say loudly at start-up when the store cannot serve, and why (SGLang runs on
        regardless)."""
        try:
            reach = self.client.check()
        except Exception as exc:           # never into SGLang
            reach = None, f"{type(exc).__name__}: {exc}"
        nodes, why = reach
        if nodes is None or nodes <= 0:
            logger.warning(
                "hicache_mc: NO L3 CACHE: %s; every L3 lookup misses and every backup is dropped "
                "until that changes (master: `master` in --hicache-storage-backend-extra-config or "
                "HICACHE_MC_MASTER; token: `token` or HICACHE_MC_TOKEN)",
                why or f"the master at {self.client_config.master} has no live storage node")

    # ------------------------------------------------------------------ set-up

    def register_mem_pool_host(self, mem_pool_host) -> None:
        """Record the host pool, its page geometry and the key namespace; refuse what we can't store."""
        super().register_mem_pool_host(mem_pool_host)
        if getattr(mem_pool_host, "kv_buffer", None) is None:
            # A logical anchor (DeepSeek-V4) only numbers the slots its side pools share.
            self.logical_anchor = True
            logger.info("hicache_mc: logical KV anchor (no KV bytes); side pools hold the pages")
            return
        geo = describe_pool(mem_pool_host)
        self.heads = head_groups(self.storage_config, mem_pool_host, geo.layout,
                                 bool(self.storage_config.is_mla_model))
        if not geo.zero_copy:
            self._stager = ChunkStager([mem_pool_host.kv_buffer], geo, self.staging)
        self.geometry = geo
        self.spaces = tuple(self._namespace(mem_pool_host, geo, self.heads.size, rank)
                            for rank in self.heads.ranks)
        for ns in self.spaces:          # the residency view, ready for the first probe
            self.client.follow(ns)
        if geo.zero_copy:   # the store reads / writes these directly
            buffers = getattr(mem_pool_host, "get_hybrid_pool_buffer", None)
            for t in (buffers() if buffers else [mem_pool_host.kv_buffer]):
                self._register(t.data_ptr(), t.numel() * t.element_size())
        logger.info("hicache_mc: %s pool, layout %s, %d tokens/page, parts %s of %s B%s%s, "
                    "namespace %s, master %s", geo.kind.upper(), geo.layout, geo.page_size,
                    "/".join(geo.parts), "/".join(map(str, geo.part_bytes)),
                    "" if geo.zero_copy else f" (staged from {geo.chunks} chunks)",
                    f" in {self.heads.count} head groups of TP {self.heads.size}"
                    if self.heads.count > 1 else "", " ".join(self.spaces),
                    self.client_config.master)

    def _register(self, ptr: int, size: int) -> None:
        """Register memory the transport touches (Mooncake TE); a failure only costs speed."""
        register = getattr(self.client, "register_buffer", None)
        if register is None:
            return
        try:
            register(ptr, size)
        except Exception as exc:
            self.episodes.failed("register_buffer", exc)

    def _unregister(self, ptr: int) -> None:
        """Undo ``_register`` before that memory is freed."""
        unregister = getattr(self.client, "unregister_buffer", None)
        if unregister is None:
            return
        try:
            unregister(ptr)
        except Exception as exc:
            self.episodes.failed("unregister_buffer", exc)

    def _namespace(self, pool, geo: PageGeometry, tp_size: int, tp_rank: int) -> str:
        # One derivation for this adapter and the GPU-direct path (hicache_mc.direct), so a page
        # saved by either is a hit for the other. The layer count includes MTP draft layers.
        cfg, s = self.storage_config, self.settings
        if pool.dtype == torch.uint8 and not s.kv_cache_dtype:
            logger.warning("hicache_mc: the host pool holds packed uint8 KV; set kv_cache_dtype in "
                           "the extra config (as --kv-cache-dtype) so fp8 variants never mix")
        return kv_namespace(
            s.model_name or cfg.model_name or "", pool.dtype, geo.layout, geo.page_size,
            int(pool.layer_num), start_layer=_int_attr(pool, "start_layer", 0),
            is_mla=bool(cfg.is_mla_model), tp_size=tp_size, tp_rank=tp_rank,
            pp_rank=getattr(cfg, "pp_rank", 0), attn_cp_rank=getattr(cfg, "attn_cp_rank", 0),
            attn_cp_size=getattr(cfg, "attn_cp_size", 1), tenant=s.tenant,
            kv_cache_dtype=s.kv_cache_dtype).digest()

    @property
    def objects_per_page(self) -> int:
        """Store objects per page: each head group's parts."""
        return len(self.spaces) * len(self.geometry.parts)

    def _keys(self, page_hashes: List[str]) -> list[str]:
        """Page-major, then group, then part: ``get_page_buffer_meta``'s pointer order (and
        ``get_split_heads_page_buffer_meta``'s for several groups)."""
        parts = self.geometry.parts
        return [f"{ns}/{h}/{p}" for h in page_hashes for ns in self.spaces for p in parts]

    def _page_ptrs(self, n: int, host_indices: torch.Tensor):
        per = self.geometry.page_size
        if host_indices is None or host_indices.numel() != n * per:
            got = None if host_indices is None else host_indices.numel()
            raise ValueError(f"{n} keys need {n * per} host indices, got {got}")
        if self.heads.count > 1:
            return self.mem_pool_host.get_split_heads_page_buffer_meta(host_indices,
                                                                       self.heads.count)
        return self.mem_pool_host.get_page_buffer_meta(host_indices)

    def _stored_pages(self, page_hashes: List[str]) -> int:
        """Pages stored, counted from the first (one namespace: one view lookup from the page
        hashes themselves, or Exists; the head groups of several: per key); those stored behind
        the first missing page are counted as orphans (orphans.py)."""
        per, pages = self.objects_per_page, len(page_hashes)
        if len(self.spaces) == 1:
            n = self.client.batch_exists_pages(self.spaces[0], page_hashes, self.geometry.parts)
            n = max(0, min(pages, int(n)))
            behind = self.client.contains_cached(self._keys(page_hashes[n + 1:])) \
                if n + 1 < pages else None
        else:
            found = list(self.client.batch_contains(self._keys(page_hashes)))
            n = leading(fold_parts(found, per))
            behind = found[(n + 1) * per:]
        if behind:
            flags = fold_parts(behind, per)
            self.orphans.observe([h for h, f in zip(page_hashes[n + 1:], flags) if f])
        return n

    # ------------------------------------------------------------------ zero-copy path

    def batch_exists(self, keys: List[str],
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> int:
        """Pages stored, counted from the first key: the residency view answers from the page
        hashes when it is in sync, else the master (one round trip)."""
        if not keys or self.geometry is None:
            return 0
        try:
            n = self._stored_pages(list(keys))
            self.episodes.ok("batch_exists")
            return n
        except Exception as exc:
            self.episodes.failed("batch_exists", exc)
            return 0

    def batch_get_v1(self, keys: List[str], host_indices: torch.Tensor,
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> List[bool]:
        """Load pages straight into the host slots ``host_indices``; one bool per key."""
        n = len(keys)
        if n == 0:
            return []
        if self.logical_anchor:   # no KV bytes: the side pools' v2 calls carry the data
            return [True] * n
        try:
            start = time.perf_counter()
            ptrs, sizes = self._page_ptrs(n, host_indices)
            skeys = self._keys(keys)
            if self._stager is not None:
                ok = self._stager.get(skeys, ptrs, self.client.batch_get_into)
            else:
                ok = self.client.batch_get_into(skeys, ptrs, sizes)
            pages = self._pages(ok, n)
            done = leading(pages)
            self.metrics.record("prefetch", done, done * self.geometry.page_bytes,
                                time.perf_counter() - start)
            self.episodes.ok("batch_get_v1")
            return pages
        except Exception as exc:
            self.episodes.failed("batch_get_v1", exc)
            return [False] * n

    def batch_set_v1(self, keys: List[str], host_indices: torch.Tensor,
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> List[bool]:
        """Store pages from the host slots; pages already stored count as stored (no rewrite)."""
        n = len(keys)
        if n == 0:
            return []
        if not self.is_writer or self.logical_anchor:
            # MLA: one copy serves every rank, the writer rank stores it; a logical anchor has
            # no KV bytes (its side pools are stored through batch_set_v2)
            return [True] * n
        try:
            start = time.perf_counter()
            ptrs, sizes = self._page_ptrs(n, host_indices)
            skeys = self._keys(keys)
            chain = self._chain(n, extra_info)
            if self._stager is not None:
                pages = self._staged_put(keys, skeys, ptrs, chain)
            else:
                pages = self._pages(self.client.batch_put_from(skeys, ptrs, sizes, chain), n)
            self.metrics.record("backup", sum(pages), sum(pages) * self.geometry.page_bytes,
                                time.perf_counter() - start)
            if all(pages):
                self.episodes.ok("batch_set_v1")
            else:
                self.episodes.failed("batch_set_v1", f"{pages.count(False)} of {n} pages not "
                                     "stored (store down, full or timed out)")
            return pages
        except Exception as exc:
            self.episodes.failed("batch_set_v1", exc)
            return [False] * n

    def _chain(self, n: int, extra_info) -> Chain:
        """Where a backup's pages sit in their chain: after the last of ``prefix_keys`` (SGLang
        passes them with ``hicache_storage_pass_prefix_keys``), and how many of them, from the
        first, are hot (``hot_pages``: a chain's first pages; -1: all)."""
        prefix = getattr(extra_info, "prefix_keys", None)
        prefix = prefix if isinstance(prefix, list) else None   # (very old builds: a tuple)
        hot_pages = self.settings.hot_pages
        if hot_pages < 0:
            hot = n
        elif hot_pages and prefix is not None:
            hot = max(0, min(n, hot_pages - len(prefix)))
        else:
            hot = 0
            if hot_pages and not self._said_no_prefix:
                self._said_no_prefix = True
                logger.warning("hicache_mc: hot_pages needs SGLang's prefix keys to count a "
                               "chain's pages: set hicache_storage_pass_prefix_keys true in "
                               "the extra config; no page is written with copies until then")
        parent = self._keys(prefix[-1:])[-1] if prefix else ""
        return Chain(parent, hot * self.objects_per_page)

    def _staged_put(self, keys, skeys, ptrs, chain: Chain) -> list[bool]:
        # Gathering costs a copy, so skip the leading run that is already stored (the usual case
        # when a request extends a known prefix): one exists round trip saves the copies.
        n_parts = len(self.geometry.parts)
        stored = min(len(keys), self.client.batch_exists(skeys) // n_parts)
        if stored:          # the rest follows the last stored page in the chain
            chain = Chain(skeys[stored * n_parts - 1], max(0, chain.hot - stored * n_parts))
        rest = self._stager.put(skeys[stored * n_parts:], ptrs[stored * n_parts * self.geometry.chunks:],
                                functools.partial(self.client.batch_put_from, chain=chain))
        return [True] * stored + self._pages(rest, len(keys) - stored)

    def _pages(self, ok, n: int) -> list[bool]:
        ok = list(ok)
        if len(ok) != n * self.objects_per_page:
            raise RuntimeError(f"store answered {len(ok)} results for {n} pages")
        return fold_parts(ok, self.objects_per_page)

    # ------------------------------------------------------------------ flat-page (legacy) path
    # A flat page (get_data_page(flat=True)) is its part objects end to end, so these calls share
    # objects with the v1 path.

    def get(self, key: str, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> torch.Tensor | None:
        """Load one flat page into ``target_location`` (allocated when None); None on a miss."""
        return self.batch_get([key], None if target_location is None else [target_location])[0]

    def batch_get(self, keys: List[str], target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> List[torch.Tensor | None]:
        """Load flat pages; the list holds the filled tensor, or None for a miss."""
        n = len(keys)
        try:
            targets = list(target_locations) if target_locations is not None else \
                [self.mem_pool_host.get_dummy_flat_data_page() for _ in keys]
            ptrs, sizes = self._flat_ptrs(targets, n)
            pages = self._pages(self.client.batch_get_into(self._keys(keys), ptrs, sizes), n)
            self.episodes.ok("batch_get")
            return [t if ok else None for t, ok in zip(targets, pages)]
        except Exception as exc:
            self.episodes.failed("batch_get", exc)
            return [None] * n

    def set(self, key: str, value: Optional[Any] = None, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> bool:
        """Store one flat page."""
        return self.batch_set([key], [value])

    def batch_set(self, keys: List[str], values: Optional[Any] = None,
                  target_locations: Optional[Any] = None, target_sizes: Optional[Any] = None) -> bool:
        """Store flat pages; True only if every page is stored."""
        if not keys:
            return True
        if not self.is_writer:
            return True
        try:
            values = [v.contiguous() for v in values]   # keep the copies alive during the put
            ptrs, sizes = self._flat_ptrs(values, len(keys))
            ok = all(self._pages(self.client.batch_put_from(self._keys(keys), ptrs, sizes), len(keys)))
            if ok:
                self.episodes.ok("batch_set")
            else:
                self.episodes.failed("batch_set", "pages not stored (store down, full or timed out)")
            return ok
        except Exception as exc:
            self.episodes.failed("batch_set", exc)
            return False

    def exists(self, key: str) -> bool:
        """True if the whole page is stored."""
        return self.batch_exists([key]) == 1

    def _flat_ptrs(self, tensors: list, n: int):
        if len(tensors) != n:
            raise ValueError(f"{n} keys but {len(tensors)} buffers")
        geo = self.geometry
        ptrs, sizes = [], []
        for t in tensors:
            if not isinstance(t, torch.Tensor) or not t.is_contiguous() or t.device.type != "cpu":
                raise ValueError("flat pages must be contiguous CPU tensors")
            if t.numel() * t.element_size() != geo.page_bytes:
                raise ValueError(f"flat page of {t.numel() * t.element_size()} B; "
                                 f"this pool's pages are {geo.page_bytes} B")
            groups = self.heads.count       # a part is [heads ...]: a group is a slice of it
            for g in range(groups):
                offset = 0
                for size in geo.part_bytes:
                    ptrs.append(t.data_ptr() + offset + g * (size // groups))
                    sizes.append(size // groups)
                    offset += size
        return ptrs, sizes

    # ------------------------------------------------------------------ admin

    def clear(self) -> None:
        """Remove this deployment's pages (its KV and side-pool namespaces only) from the store."""
        spaces = [*self.spaces] + [p.namespace for p in self.side_pools.values()]
        for ns in filter(None, spaces):
            try:
                removed = self.client.clear(prefix=f"{ns}/")
                logger.info("hicache_mc: cleared %d objects of namespace %s", removed, ns)
            except Exception as exc:
                self.episodes.failed("clear", exc)

    def get_stats(self):
        """SGLang StorageMetrics since the last call (KV pages and GB/s per batch)."""
        return self.metrics.drain()

    def traffic(self) -> dict:
        """Pages and bytes per pool since start (``kv``, and each side pool apart)."""
        return self.metrics.traffic()

    def close(self) -> None:
        """Release the client's sockets and mappings; the stored pages stay."""
        try:
            self.client.close()
        except Exception as exc:
            logger.warning("hicache_mc: close failed: %s", exc)


def _int_attr(obj, name: str, default: int) -> int:
    value = getattr(obj, name, None)
    return default if value is None else int(value)
