"""The shared L3 of the simulated fleet: one pool of pages with an LRU, one aggregate
bandwidth every transfer shares, and the residency view a router reads.

- Instances probe it exactly (SGLang's storage backend asks the store's master) and pull the
  leading run of their chain past their own tiers: a read moves ``pages x page_bytes`` over
  the instance's path (``path_bw``) and the pool's shared bandwidth (``bandwidth``, FIFO).
- After a prefill, the pages the pool lacks are written back the same way; they are stored
  once the write is done (until then nobody finds them).
- A router sees the pool through ``L3View``: what was stored ``lag_s`` ago (the residency
  view a ``StoreClient`` keeps is that much behind the master).

A pool of capacity 0 is no L3 at all: nothing is stored, probes and lookups find nothing.
All time is passed in; state advances lazily and in time order, so the caller must never
go back in time.
"""
from __future__ import annotations

import heapq
from collections import deque
from typing import Sequence

from .cache import BlockLRU


class SharedL3:
    def __init__(self, capacity_pages: int, bandwidth: float, page_bytes: int,
                 lag_s: float = 0.005):
        if capacity_pages > 0 and bandwidth <= 0:
            raise ValueError("an L3 with room needs a bandwidth > 0")
        self.pages = BlockLRU(capacity_pages)
        self.bandwidth = bandwidth
        self.page_bytes = page_bytes
        self.lag_s = lag_s
        self._busy_until = 0.0
        self._writes: list = []                 # (done_s, seq, pages) not yet stored
        self._seq = 0
        self._view: set = set()
        self._view_log: deque = deque()         # (visible_s, stored, removed) in time order
        self.read_bytes = 0
        self.written_bytes = 0

    @property
    def enabled(self) -> bool:
        return self.pages.capacity > 0

    def leading(self, chain: Sequence[int], start: int, now: float) -> int:
        """The pool's leading run of ``chain`` from ``start``, as the master knows it now."""
        if not self.enabled:
            return 0
        self._advance(now)
        return self.pages.leading(chain, start)

    def read(self, pages: Sequence[int], now: float, path_bw: float) -> float:
        """Pull ``pages`` over a path of ``path_bw``; returns when the last byte is in."""
        self.pages.touch(pages)
        nbytes = len(pages) * self.page_bytes
        self.read_bytes += nbytes
        return self._transfer(nbytes, now, path_bw)

    def write(self, chain: Sequence[int], now: float, path_bw: float) -> None:
        """Back up the pages of ``chain`` the pool lacks; they are stored when written."""
        if not self.enabled:
            return
        self._advance(now)
        missing = [b for b in chain if b not in self.pages]
        if not missing:
            self.pages.touch(chain)
            return
        nbytes = len(missing) * self.page_bytes
        self.written_bytes += nbytes
        done = self._transfer(nbytes, now, path_bw)
        self._seq += 1
        heapq.heappush(self._writes, (done, self._seq, tuple(chain)))

    def view_leading(self, chain: Sequence[int], now: float) -> int:
        """The leading run of ``chain`` in the residency view at ``now`` (``lag_s`` behind)."""
        if not self.enabled:
            return 0
        self._advance(now)
        log, view = self._view_log, self._view
        while log and log[0][0] <= now:
            _, stored, removed = log.popleft()
            view.difference_update(removed)
            view.update(stored)
        n = 0
        for b in chain:
            if b not in view:
                break
            n += 1
        return n

    def _transfer(self, nbytes: int, now: float, path_bw: float) -> float:
        start = max(now, self._busy_until)
        self._busy_until = start + nbytes / self.bandwidth
        return max(self._busy_until, now + nbytes / path_bw)

    def _advance(self, now: float) -> None:
        writes = self._writes
        while writes and writes[0][0] <= now:
            done, _, chain = heapq.heappop(writes)
            change = self.pages.touch(chain)
            if change.stored or change.removed:
                self._view_log.append((done + self.lag_s, change.stored, change.removed))


class L3View:
    """The ``api.L3Lookup`` a router is built with: page hashes in, the leading run of pages
    the residency view holds out. ``now_s`` is set by the simulator before each route."""

    def __init__(self, l3: SharedL3, block_of: dict):
        self.l3 = l3
        self.block_of = block_of            # page hash -> block id (workload.PageNames)
        self.now_s = 0.0

    def __call__(self, page_hashes: Sequence[str]) -> int:
        if not self.l3.enabled:
            return 0
        get = self.block_of.get
        return self.l3.view_leading([get(h, -1) for h in page_hashes], self.now_s)
