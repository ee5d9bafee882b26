"""Per-batch metrics for SGLang's scheduler and once-per-episode failure logging."""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field

logger = logging.getLogger("hicache_mc.sglang")


def _storage_metrics_cls():
    try:  # sglang 0.5.6+ (the N/P line)
        from sglang.srt.observability.metrics_collector import StorageMetrics
        return StorageMetrics
    except Exception:
        pass
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


class BatchMetrics:
    """Pages and GB/s per prefetch / backup batch; ``drain()`` hands them over and starts afresh."""

    def __init__(self):
        self._lock = threading.Lock()
        self._cls = None
        self._lists = self._empty()

    @staticmethod
    def _empty() -> dict[str, list]:
        return {"prefetch_pgs": [], "backup_pgs": [], "prefetch_bandwidth": [],
                "backup_bandwidth": []}

    def record(self, kind: str, pages: int, nbytes: int, seconds: float) -> None:
        """``kind`` is "prefetch" or "backup"; pages and bytes moved in ``seconds``."""
        if pages <= 0:
            return
        gbps = nbytes / max(seconds, 1e-9) / 1e9
        with self._lock:
            self._lists[f"{kind}_pgs"].append(pages)
            self._lists[f"{kind}_bandwidth"].append(gbps)

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
