"""Prefixes this router has sent and no worker has reported yet: the requests in flight.

A request's pages reach its worker's cache (and the L3, which SGLang backs them up to) only
when its prefill ends, and a KV event says so later still. Under load that is seconds: a
conversation's next turn, or a second request on a hot prefix, arrives while the first is
still queued, and a router that reads only events sees nothing cached. But the router knows
where it sent the first: a request queued behind it on that worker (FCFS) finds the pages in
L1 when its turn comes. Another worker does not: SGLang looks a request's prefix up in the L3
once, when the request arrives, and the pages are not there yet. Without this, the lowest
predicted TTFT spreads a hot prefix over every worker whose queue is shorter, each
recomputing it: more total work exactly when the fleet has none to spare.

The map: block hash -> a bitmask over worker slots and, per (block, slot), how many requests
in flight carry it. A lookup is one pass as in index.py. Entries leave when their request
ends (``Finished``), by which time the worker's events have reported what it kept.
"""
from __future__ import annotations

from itertools import accumulate, repeat, takewhile
from operator import and_
from typing import Sequence

from .index import survivals


class PendingIndex:
    def __init__(self) -> None:
        self._mask: dict[int, int] = {}
        self._count: dict[tuple[int, int], int] = {}
        self._slot: dict[str, int] = {}
        self._name: dict[int, str] = {}
        self._free: list[int] = []

    def __len__(self) -> int:
        return len(self._mask)

    def add_worker(self, name: str) -> None:
        self.remove_worker(name)
        slot = self._free.pop() if self._free else len(self._name)
        self._slot[name], self._name[slot] = slot, name

    def remove_worker(self, name: str) -> None:
        """Forget the worker; its blocks leave as their requests end."""
        slot = self._slot.pop(name, None)
        if slot is not None:
            bit = 1 << slot
            for h in [h for h, m in self._mask.items() if m & bit]:
                self._drop(h, slot, self._count.pop((h, slot), 0))
            del self._name[slot]
            self._free.append(slot)

    def add(self, worker: str, blocks: Sequence[int]) -> None:
        slot = self._slot.get(worker)
        if slot is None:
            return
        bit, mask, count = 1 << slot, self._mask, self._count
        for h in blocks:
            mask[h] = mask.get(h, 0) | bit
            count[h, slot] = count.get((h, slot), 0) + 1

    def remove(self, worker: str, blocks: Sequence[int]) -> None:
        slot = self._slot.get(worker)
        if slot is not None:
            for h in blocks:
                self._drop(h, slot, 1)

    def _drop(self, h: int, slot: int, n: int) -> None:
        key = (h, slot)
        left = self._count.get(key, 0) - n
        if left > 0:
            self._count[key] = left
            return
        self._count.pop(key, None)
        m = self._mask.get(h, 0) & ~(1 << slot)
        if m:
            self._mask[h] = m
        else:
            self._mask.pop(h, None)

    def lookup(self, blocks: Sequence[int]) -> dict[str, int]:
        """Every worker's leading pages of the chain in flight to it (none: left out)."""
        if not self._mask:
            return {}
        every = sum(1 << s for s in self._name)
        runs = list(takewhile(bool, accumulate(map(self._mask.get, blocks, repeat(0)), and_,
                                               initial=every)))
        name = self._name
        return {name[bit]: pages for bit, pages in survivals(runs) if pages}
