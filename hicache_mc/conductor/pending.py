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

A page hash names its whole prefix (the chain), so a request in flight is kept as a few of
its pages, not all: every ``STRIDE``-th and its last, each with a refcounted bitmask of the
workers it went to. A chain that continues a request in flight (a conversation's next turn)
holds that request's last page: its prefix counts in full. A chain that shares only part of
one (a common system prompt) counts the part up to the last kept page it holds, at most
``STRIDE - 1`` pages short. Entries leave when their request ends (``Finished``), by which
time the worker's events have reported what it kept.
"""
from __future__ import annotations

from itertools import accumulate, repeat, takewhile
from operator import and_
from typing import Sequence

from .index import survivals

STRIDE = 32                   # kept pages per request: 1 in 32 and the last (a 2,048-page
#                               prompt costs 65 entries, not 2,048)


class PendingIndex:
    def __init__(self) -> None:
        self._mask: dict[int, int] = {}                  # kept page -> workers, as bits
        self._count: dict[tuple[int, int], int] = {}     # (kept page, slot) -> requests
        self._end: dict[int, int] = {}                   # a request's last page -> its pages
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
        """Forget the worker's requests in flight."""
        slot = self._slot.pop(name, None)
        if slot is not None:
            bit = 1 << slot
            for h in [h for h, m in self._mask.items() if m & bit]:
                self._drop(h, slot, self._count.pop((h, slot), 0))
            del self._name[slot]
            self._free.append(slot)

    @staticmethod
    def _kept(blocks: Sequence[int]) -> list[int]:
        kept = list(blocks[STRIDE - 1::STRIDE])
        if len(blocks) % STRIDE:
            kept.append(blocks[-1])
        return kept

    def add(self, worker: str, blocks: Sequence[int]) -> None:
        slot = self._slot.get(worker)
        if slot is None or not blocks:
            return
        bit, mask, count = 1 << slot, self._mask, self._count
        for h in self._kept(blocks):
            mask[h] = mask.get(h, 0) | bit
            count[h, slot] = count.get((h, slot), 0) + 1
        self._end[blocks[-1]] = len(blocks)

    def remove(self, worker: str, blocks: Sequence[int]) -> None:
        slot = self._slot.get(worker)
        if slot is not None and blocks:
            for h in self._kept(blocks):
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
            self._end.pop(h, None)

    def lookup(self, blocks: Sequence[int]) -> dict[str, int]:
        """Every worker's leading pages of the chain in flight to it (none: left out)."""
        if not self._mask:
            return {}
        get, name = self._mask.get, self._name
        every = sum(1 << s for s in name)
        runs = list(takewhile(bool, accumulate(map(get, blocks[STRIDE - 1::STRIDE], repeat(0)),
                                               and_, initial=every)))
        out = {name[bit]: kept * STRIDE for bit, kept in survivals(runs) if kept}
        for h in filter(self._end.__contains__, blocks):   # whole requests in flight
            pages, m = self._end[h], get(h, 0)
            while m:
                low = m & -m
                w = name[low.bit_length() - 1]
                if out.get(w, 0) < pages:
                    out[w] = pages
                m ^= low
        return out
