"""A tier of simulated pages (an instance's GPU or host pool, or the shared L3), least
recently used out first.

A request refreshes its chain from the last page to the first, so a prefix is always more
recent than its continuations and leaves go first, as in SGLang's radix tree (which evicts
leaf nodes by last access): an evicted head would strand its descendants.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import NamedTuple, Sequence


class Change(NamedTuple):
    """What a touch or a resize did: pages newly held, pages dropped (both in chain order as
    far as one chain goes). A page added and dropped by the same call is in neither."""
    stored: list
    removed: list


NO_CHANGE = Change([], [])


class BlockLRU:
    __slots__ = ("capacity", "_d")

    def __init__(self, capacity: int):
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self._d: "OrderedDict[int, None]" = OrderedDict()

    def __contains__(self, block: int) -> bool:
        return block in self._d

    def __len__(self) -> int:
        return len(self._d)

    def leading(self, chain: Sequence[int], start: int = 0) -> int:
        """How many pages of ``chain`` from ``start`` on are held, up to the first missing."""
        d, n, end = self._d, start, len(chain)
        while n < end and chain[n] in d:
            n += 1
        return n - start

    def touch(self, blocks: Sequence[int]) -> Change:
        """Hold ``blocks`` (a run of one chain, in order) as the most recently used."""
        if self.capacity <= 0 or not blocks:
            return NO_CHANGE
        d, added = self._d, []
        for b in reversed(blocks):
            if b in d:
                d.move_to_end(b)
            else:
                d[b] = None
                added.append(b)
        added.reverse()
        return self._settle(added)

    def resize(self, capacity: int) -> Change:
        """Change the room (the GPU pool's shrinks as decoding requests grow); drops the least
        recently used pages that no longer fit."""
        self.capacity = max(0, capacity)
        return self._settle([])

    def discard(self, blocks: Sequence[int]) -> list:
        d = self._d
        gone = [b for b in blocks if b in d]
        for b in gone:
            del d[b]
        return gone

    def _settle(self, added: list) -> Change:
        d = self._d
        if len(d) <= self.capacity:
            return Change(added, []) if added else NO_CHANGE
        evicted = []
        while len(d) > self.capacity:
            evicted.append(d.popitem(last=False)[0])
        if not added:
            return Change([], evicted)
        fresh = set(added)
        return Change([b for b in added if b in d], [b for b in evicted if b not in fresh])
