"""The v2 half of SGLang's ``HiCacheStorage``: hybrid models' side pools, next to the KV pages.

Mixed into ``HiCacheMC``. SGLang calls these from the same threads as the v1 API: nothing raises
into it and nothing returns ``None``; a failure is a miss (``False`` per page, zero hits).

- ``register_mem_host_pool_v2``: one :class:`~.pools_v2.SidePool` per name (``pools_v2.py``).
- ``batch_set_v2`` / ``batch_get_v2``: all pools of a call in one store call, zero-copy.
- ``batch_exists_v2``: one per-key presence query for the KV pages and every pool together,
  then each pool's hit policy (``hits_v2.py``).

A *logical anchor* (DeepSeek-V4: a KV pool without a ``kv_buffer``) holds no bytes: its v1 calls
succeed without I/O and the side pools alone decide what is stored.
"""
from __future__ import annotations

import logging
import time
from typing import List, NamedTuple, Optional

from sglang.srt.mem_cache.hicache_storage import (HiCacheStorageExtraInfo, PoolName,
                                                  PoolTransfer, PoolTransferResult)

from .hits_v2 import BLOCK_GROUPS, PoolPresence, leading, resolve
from .pools_v2 import MAMBA, PoolIO, SidePool, probe_side_pool, side_namespace
from .staging import fold_parts

logger = logging.getLogger("hicache_mc.sglang")


class _Span(NamedTuple):
    """Where one pool's objects sit in the single presence query of batch_exists_v2."""
    transfer: PoolTransfer
    pages: int        # pages this pool is checked for
    first: int        # index of its first object in the query
    asked: int        # pages actually asked (0: pool not registered, all missing)
    per_page: int     # objects per page


class HybridPools:
    """v2 API over ``self.client``; expects HiCacheMC's KV state (geometry, namespace, _keys)."""

    side_pools: dict
    logical_anchor: bool = False
    _pools_attached: bool = False

    # ------------------------------------------------------------------ set-up

    def register_mem_host_pool_v2(self, host_pool, host_pool_name) -> None:
        """Probe a side pool and give it its namespace; the KV anchor is the v1 pool."""
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        if str(host_pool_name) == PoolName.KV.value or host_pool is getattr(self, "mem_pool_host", None):
            return
        try:
            side = self._side_pool(host_pool, host_pool_name)
        except Exception as exc:
            if not self._pools_attached:   # start-up: refuse loudly, naming the pool
                raise
            # A sidecar added at run time: SGLang's scheduler must not see an exception; the
            # pool stays unregistered, so every lookup of it is a miss.
            self.episodes.failed(f"register {host_pool_name}", exc)
            return
        self.side_pools[str(host_pool_name)] = side
        self.client.follow(side.namespace)  # batch_exists_v2 answered by the residency view
        for t in side.tensors():
            self._register(t.data_ptr(), t.numel() * t.element_size())
        g = side.geo
        logger.info("hicache_mc: side pool %s (%s, layout %s), %d slot(s)/key, %d object(s) of "
                    "%s B per page%s, namespace %s", host_pool_name, g.pool_type, g.layout,
                    g.page_size, len(g.parts), "/".join(map(str, g.part_bytes)),
                    "" if g.zero_copy else " (flat pages, copied)", side.namespace)

    def _side_pool(self, pool, name) -> SidePool:
        cfg, s = self.storage_config, self.settings
        geo = probe_side_pool(pool)
        shared = bool(cfg.is_mla_model) and not _tp_sharded(pool, name)
        identity = {"model": s.model_name or cfg.model_name or "",
                    "kv_cache_dtype": s.kv_cache_dtype or "",
                    "tp": None if shared else [cfg.tp_rank, cfg.tp_size],
                    "pp_rank": getattr(cfg, "pp_rank", 0),
                    "cp": [getattr(cfg, "attn_cp_rank", 0), getattr(cfg, "attn_cp_size", 1)]}
        return SidePool(name, pool, geo, side_namespace(identity, str(name), geo, pool, s.tenant),
                        shared, self.staging)

    def on_host_pools_registered(self) -> None:
        """The start-up pool set is known: say which pools are stored."""
        self._pools_attached = True
        logger.info("hicache_mc: storing %s%s", "KV pages" if not self.logical_anchor else
                    "no KV bytes (logical anchor)",
                    "".join(f", {n}" for n in self.side_pools) or " only")

    # ------------------------------------------------------------------ data

    def batch_set_v2(self, transfers: List[PoolTransfer],
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> dict:
        """Store every pool's pages from its host slots in one store call; bools per key."""
        return self._guarded_io(transfers, load=False)

    def batch_get_v2(self, transfers: List[PoolTransfer],
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> dict:
        """Load every pool's pages straight into its host slots in one store call."""
        return self._guarded_io(transfers, load=True)

    def _guarded_io(self, transfers, load: bool) -> dict:
        # _io_v2 already turns store and per-pool failures into False; this catches the rest
        # (a malformed transfer) so that nothing raises into SGLang's I/O threads.
        try:
            return self._io_v2(list(transfers or []), load)
        except Exception as exc:
            self.episodes.failed("batch_get_v2" if load else "batch_set_v2", exc)
            return {getattr(t, "name", None): [False] * _count(getattr(t, "keys", None))
                    for t in transfers or []}

    def _io_v2(self, transfers, load: bool) -> dict:
        op = "batch_get_v2" if load else "batch_set_v2"
        results, batch = self._plan_v2(transfers, load, op)
        together = [(side, io) for side, io in batch if side.stager is None]
        if together:
            self._move_together(together, load, op, results)
        for side, io in batch:
            if side.stager is not None:
                self._move_staged(side, io, load, op, results)
        if batch:
            if all(all(r) for r in results.values()):
                self.episodes.ok(op)
            else:
                self.episodes.failed(op, "pages missing or not stored (miss, store down or full)")
        return results

    def _plan_v2(self, transfers, load: bool, op: str) -> tuple[dict, list]:
        """The answer so far (False per key; KV pages moved by the v1 calls) and each side
        pool's share of the store calls still to make."""
        results: dict = {}
        batch: list[tuple[SidePool, PoolIO]] = []
        for t in transfers:
            keys = list(t.keys or [])
            results[t.name] = [False] * len(keys)
            if not keys:
                continue
            if str(t.name) == PoolName.KV.value:   # the anchor's own pages: the v1 objects
                results[t.name] = (self.batch_get_v1 if load else self.batch_set_v1)(
                    keys, t.host_indices)
                continue
            side = self.side_pools.get(str(t.name))
            if side is None:
                self.episodes.failed(op, f"pool {t.name} is not registered")
                continue
            if not load and side.shared_by_tp and not self.is_writer:
                results[t.name] = [True] * len(keys)   # the writer rank stores the one copy
                continue
            try:
                batch.append((side, side.io(t.name, keys, t.host_indices, load=load)))
            except Exception as exc:
                self.episodes.failed(op, exc)
        return results, batch

    def _move_together(self, batch: list, load: bool, op: str, results: dict) -> None:
        """Every zero-copy and flat-page pool of the call in one store call."""
        start = time.perf_counter()
        try:
            keys = [k for _, io in batch for k in io.keys]
            ptrs = [p for _, io in batch for p in io.ptrs]
            sizes = [s for _, io in batch for s in io.sizes]
            call = self.client.batch_get_into if load else self.client.batch_put_from
            ok = list(call(keys, ptrs, sizes))
            if len(ok) != len(keys):
                raise RuntimeError(f"store answered {len(ok)} results for {len(keys)} objects")
        except Exception as exc:
            self.episodes.failed(op, exc)
            return
        at = 0
        for side, io in batch:
            pages = fold_parts(ok[at:at + len(io.keys)], io.n_parts)
            at += len(io.keys)
            if load and io.buffers:
                side.scatter(io, pages)
            results[io.name] = pages
        self._record_sides(batch, results, load, time.perf_counter() - start)

    def _move_staged(self, side: SidePool, io: PoolIO, load: bool, op: str,
                     results: dict) -> None:
        """A layer_first pool: its part objects through the staging buffer, in rounds."""
        start = time.perf_counter()
        try:
            move = side.stager.get if load else side.stager.put
            call = self.client.batch_get_into if load else self.client.batch_put_from
            results[io.name] = fold_parts(move(io.keys, io.ptrs, call), io.n_parts)
        except Exception as exc:
            self.episodes.failed(op, exc)
            return
        self._record_sides([(side, io)], results, load, time.perf_counter() - start)

    def _record_sides(self, batch: list, results: dict, load: bool, seconds: float) -> None:
        # per pool, apart from the KV pages (SGLang's StorageMetrics count those only)
        for side, io in batch:
            moved = sum(results[io.name])
            self.metrics.record("prefetch" if load else "backup", moved,
                                moved * side.geo.page_bytes, seconds, pool=str(side.name))

    # ------------------------------------------------------------------ lookup

    def batch_exists_v2(self, keys: List[str], pool_transfers: Optional[List[PoolTransfer]] = None,
                        extra_info: Optional[HiCacheStorageExtraInfo] = None) -> PoolTransferResult:
        """Restorable prefixes for the KV pages and every pool, from one store round trip."""
        try:
            return self._exists_v2(list(keys or []), list(pool_transfers or []))
        except Exception as exc:
            self.episodes.failed("batch_exists_v2", exc)
            return PoolTransferResult(0, {}, [])

    def _exists_v2(self, keys: list, transfers: list) -> PoolTransferResult:
        n = len(keys)
        if n == 0 or (self.geometry is None and not self.logical_anchor):
            return PoolTransferResult(0, {}, [])
        if self.logical_anchor and not transfers:   # no bytes asked about: no evidence of a hit
            return PoolTransferResult(0, {}, [])
        # Every object this answer depends on, in one list: KV parts, then each pool's.
        query: list[str] = []
        kv_parts = 0
        if not self.logical_anchor:
            query += self._keys(keys)
            kv_parts = self.objects_per_page
        spans: list[_Span] = []
        for t in transfers:
            side = self.side_pools.get(str(t.name))
            pages = list(t.keys or []) if _policy(t) == BLOCK_GROUPS else keys
            if str(t.name) == PoolName.KV.value and kv_parts:   # the KV objects asked above
                spans.append(_Span(t, n, 0, n, kv_parts))
                continue
            if side is None:
                self.episodes.failed("batch_exists_v2", f"pool {t.name} is not registered")
                spans.append(_Span(t, len(pages), 0, 0, 1))
                continue
            spans.append(_Span(t, len(pages), len(query), len(pages), len(side.geo.parts)))
            query += side.keys(pages)
        present = list(self.client.batch_contains(query)) if query else []
        if len(present) != len(query):
            raise RuntimeError(f"store answered {len(present)} flags for {len(query)} keys")
        kv_pages = self._kv_run(keys, present, kv_parts)
        pools = []
        for sp in spans:
            t = sp.transfer
            flags = fold_parts(present[sp.first:sp.first + sp.asked * sp.per_page], sp.per_page) \
                if sp.asked else [False] * sp.pages
            pools.append(PoolPresence(t.name, _policy(t), flags,
                                      window=max(1, len(t.keys or []) or 1),
                                      block_pages=int(getattr(t, "block_pages", 0) or 0),
                                      group_pages=int(getattr(t, "group_pages", 0) or 0)))
        verdict = resolve(kv_pages, pools, n, kv_name=PoolName.KV)
        self.episodes.ok("batch_exists_v2")
        return PoolTransferResult(verdict.kv_hit_pages, verdict.pool_hit_pages,
                                  verdict.restorable)

    def _kv_run(self, keys: list, present: list, per: int) -> int:
        """The leading run of stored KV pages (a logical anchor: all); the pages stored behind
        it are orphans (orphans.py)."""
        if self.logical_anchor:
            return len(keys)
        flags = fold_parts(present[:len(keys) * per], per)
        run = leading(flags)
        self.orphans.observe([h for h, f in zip(keys[run + 1:], flags[run + 1:]) if f])
        return run


def _tp_sharded(pool, name) -> bool:
    """Whether each TP rank holds its own slice even in an MLA model: Mamba state (heads split
    across ranks) and MHA pools (an EAGLE-MHA draft over an MLA target). Sharing those would load
    rank 0's heads on every rank."""
    from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    return str(name) == MAMBA or isinstance(pool, (MambaPoolHost, MHATokenToKVPoolHost))


def _count(keys) -> int:
    try:
        return len(list(keys or []))
    except Exception:
        return 0


def _policy(t: PoolTransfer) -> str:
    p = getattr(t, "hit_policy", None)
    return str(getattr(p, "value", p) or "all_pages")

