"""Per-batch metrics for SGLang's scheduler, traffic per pool, and once-per-episode failure
logging.

SGLang's ``StorageMetrics`` (``get_stats``, exported as ``sglang:prefetch_pgs`` and friends)
count KV pages: a hybrid model's side-pool pages (a Mamba state, an SWA window) are other units,
so they are counted apart, per pool, with the KV pages beside them under ``kv``: in
``BatchMetrics.traffic()`` and in the Prometheus counters ``hicache_mc_sglang_pages_total`` and
``hicache_mc_sglang_bytes_total`` (labels ``pool``, ``op`` = prefetch / backup), which SGLang's
``/metrics`` serves with ``--enable-metrics`` (its processes share prometheus_client's
multiprocess directory).
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Any, NamedTuple

logger = logging.getLogger("hicache_mc.sglang")


def _storage_metrics_cls():
    try:  # sglang 0.5.6+ (the N/P line)
        from sglang.srt.observability.metrics_collector import StorageMetrics
        return StorageMetrics
    except Exception as exc:
        logger.debug("hicache_mc: no observability.metrics_collector (%s); trying the older path",
                     exc)
    try:  # older builds
        from sglang.srt.metrics.collector import StorageMetrics
        return StorageMetrics
    except Exception:
        return _LocalStorageMetrics


@dataclass
class _LocalStorageMetrics:
    """Same fields as SGLang's StorageMetrics, for builds where it cannot be imported."""
    prefetch_pgs: list = field(default_factory=list)
    backup_pgs: list = field(default_factory=list)
    prefetch_bandwidth: list = field(default_factory=list)
    backup_bandwidth: list = field(default_factory=list)


KV = "kv"
_prometheus = None
_prometheus_lock = threading.Lock()


class Counters(NamedTuple):
    pages: Any        # labels pool, op
    bytes: Any        # labels pool, op
    orphans: Any      # no labels: orphans.py


def prometheus_counters() -> Counters:
    """The process's counters (created once: prometheus_client refuses a name twice in its
    registry, and several backends live in one process)."""
    global _prometheus
    with _prometheus_lock:
        if _prometheus is None:
            from prometheus_client import Counter
            _prometheus = Counters(
                Counter("hicache_mc_sglang_pages", "Pages moved between SGLang's host pools and "
                        "the L3, per pool (kv or a side pool) and op", ["pool", "op"]),
                Counter("hicache_mc_sglang_bytes", "Bytes of those pages", ["pool", "op"]),
                Counter("hicache_mc_sglang_orphan_pages", "KV pages a lookup found stored behind "
                        "a page that is not (unreachable until that page is stored again)"))
        return _prometheus


@dataclass
class PoolTraffic:
    """Pages and bytes of one pool moved since the backend started."""
    prefetch_pages: int = 0
    prefetch_bytes: int = 0
    backup_pages: int = 0
    backup_bytes: int = 0


class BatchMetrics:
    """Pages and GB/s per prefetch / backup batch of KV pages (``drain()`` hands them over and
    starts afresh), and every pool's traffic since start."""

    def __init__(self):
        self._lock = threading.Lock()
        self._cls = None
        self._lists = self._empty()
        self._traffic: dict[str, PoolTraffic] = {}
        counters = prometheus_counters()
        self._pages, self._bytes = counters.pages, counters.bytes

    @staticmethod
    def _empty() -> dict[str, list]:
        return {"prefetch_pgs": [], "backup_pgs": [], "prefetch_bandwidth": [],
                "backup_bandwidth": []}

    def record(self, kind: str, pages: int, nbytes: int, seconds: float, pool: str = KV) -> None:
        """``kind`` is "prefetch" or "backup"; pages and bytes of ``pool`` moved in ``seconds``
        (a batch for SGLang's StorageMetrics when it is KV pages)."""
        if pages <= 0:
            return
        gbps = nbytes / max(seconds, 1e-9) / 1e9
        with self._lock:
            if pool == KV:
                self._lists[f"{kind}_pgs"].append(pages)
                self._lists[f"{kind}_bandwidth"].append(gbps)
            t = self._traffic.setdefault(pool, PoolTraffic())
            setattr(t, f"{kind}_pages", getattr(t, f"{kind}_pages") + pages)
            setattr(t, f"{kind}_bytes", getattr(t, f"{kind}_bytes") + nbytes)
        self._pages.labels(pool, kind).inc(pages)
        self._bytes.labels(pool, kind).inc(nbytes)

    def traffic(self) -> dict[str, PoolTraffic]:
        """Every pool's pages and bytes since start (KV under ``kv``)."""
        with self._lock:
            return {name: PoolTraffic(**vars(t)) for name, t in self._traffic.items()}

    def drain(self):
        """A StorageMetrics holding everything since the last drain."""
        with self._lock:
            lists, self._lists = self._lists, self._empty()
        if self._cls is None:
            self._cls = _storage_metrics_cls()
        return self._cls(**lists)


class EpisodeLog:
    """Logs the first failure of each kind, stays quiet while it lasts, and logs the recovery."""

    def __init__(self):
        self._lock = threading.Lock()
        self._failing: set[str] = set()

    def failed(self, what: str, detail: object) -> None:
        """Record a failure of ``what`` (e.g. "batch_set_v1"); logs only the first of an episode."""
        with self._lock:
            first = what not in self._failing
            self._failing.add(what)
        if first:
            logger.warning("hicache_mc %s failed: %s (answering misses until it recovers)",
                           what, detail)

    def ok(self, what: str) -> None:
        """Record a success of ``what``; ends its episode."""
        if what not in self._failing:  # racy read is fine: worst case one extra lock round
            return
        with self._lock:
            recovered = what in self._failing
            self._failing.discard(what)
        if recovered:
            logger.info("hicache_mc %s recovered", what)

    def failing(self, what: str) -> bool:
        """True while an episode of ``what`` is open."""
        return what in self._failing
