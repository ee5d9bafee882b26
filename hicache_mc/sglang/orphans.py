"""Orphaned pages: KV pages stored behind a page that is not (docs/sglang.md, "Orphaned pages").

A lookup (``batch_exists``, ``batch_exists_v2``) counts the leading run of stored pages, and a
get asks for that run only, so a page stored after a missing one is reached by nothing: not
read, not refreshed. In PD disaggregation that is a decode instance's answer pages once the
prompt pages before them were evicted (they were written earlier, and read last by the prefill)
or never stored. They stay orphaned until a prefill stores the missing pages again (it
recomputes them; with ``write_through`` it backs them up), and meanwhile the store's LRU drops
them like any page nobody reads.

The backend counts the orphans its lookups see, from the residency view (no extra round trip;
uncounted while the view cannot answer), once per page hash among the last ``REMEMBER`` it
counted: a prefill asks again about the same request while it waits for a backup to land
(SGLang's prefetch retry), and every later turn of a conversation asks about the same pages.
"""
from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from typing import Sequence

from .metrics import prometheus_counters

logger = logging.getLogger("hicache_mc.sglang")

REMEMBER = 16384    # page hashes: ~2 MB of memory, the orphans of ~100 long conversations


class OrphanCount:
    """Distinct orphaned pages seen by this backend's lookups (``total``), also exported as
    ``hicache_mc_sglang_orphan_pages_total``."""

    def __init__(self, remember: int = REMEMBER):
        self.total = 0
        self._remember = remember
        self._seen: OrderedDict[str, None] = OrderedDict()
        self._lock = threading.Lock()
        self._counter = prometheus_counters().orphans

    def observe(self, page_hashes: Sequence[str]) -> int:
        """Count the orphans among ``page_hashes`` not counted recently; returns how many."""
        with self._lock:
            new = [h for h in page_hashes if h not in self._seen]
            for h in page_hashes:
                self._seen[h] = None
                self._seen.move_to_end(h)
            while len(self._seen) > self._remember:
                self._seen.popitem(last=False)
            first = self.total == 0 and bool(new)
            self.total += len(new)
        if new:
            self._counter.inc(len(new))
        if first:
            logger.info("hicache_mc: %d KV pages stored behind a missing page (orphaned: no "
                        "lookup reaches them until that page is stored again); counted in "
                        "hicache_mc_sglang_orphan_pages_total", len(new))
        return len(new)
