"""Which worker holds which block in which tier, from the workers' KV events.

One ordered map, block hash -> a bitmask over worker slots: slot ``s`` owns three bits, ``3s``
(the block is in its GPU, L1), ``3s + 1`` (in its host pool, L2) and ``3s + 2`` (in either).
A request's chain is one pass in C (``map`` of the map's ``get``, ``accumulate`` of ``&``,
stopping at the first block no worker holds): a worker's L1 prefix is how long its L1 bit
survives the running AND, its L1-or-L2 prefix how long its "either" bit does. The running AND
only loses bits, so it is a non-increasing sequence of ints and each distinct value is found by
bisection: one lookup gives every worker's prefix per tier, whatever the fleet's size.

- **Bounded.** At most ``max_blocks`` entries; a store or a lookup that touches a block makes
  it the most recent, and the least recent go first when the bound is hit (the router then
  thinks that block cached nowhere: it under-predicts hits, never invents them). A lookup's
  touches wait for the next ``apply`` so that they cost the decision nothing. ``memory()``
  reports the entries and their bytes (for /metrics).
- **Clearing is O(1).** ``Cleared`` or ``remove_worker`` gives the worker a fresh slot and
  marks the old one dead: lookups mask dead slots out, and once dead slots pile up one sweep
  strips them from every entry and frees them for reuse.
- **A stale stream** (``StreamHealth(live=False)``) hides that worker from lookups (its
  cache is unknown: routed on load alone) while its events are still applied; ``live=True``
  shows it again.

Events of an unknown worker, and L3-tier events (the L3 is looked up in the residency view),
are counted and ignored.
"""
from __future__ import annotations

import sys
from bisect import bisect_right
from collections import OrderedDict, deque
from dataclasses import dataclass
from itertools import accumulate, repeat, takewhile
from operator import and_, neg
from typing import Iterable, Iterator, NamedTuple, Sequence

from .api import BlocksRemoved, BlocksStored, Cleared, Event, StreamHealth, Tier

MAX_BLOCKS = 1 << 20          # ~150 MB of router memory at the bytes per block memory() reports
SWEEP_MIN_DEAD = 8            # sweep once this many slots (and at least as many as live) are dead
MAX_PENDING_TOUCHES = 1024    # lookups whose LRU touches wait for apply() (older ones are
                              # dropped): <= 16 MB of chain references at 2,000-page chains
_GPU, _HOST, _ANY = 1, 2, 4   # a slot's three bits, shifted by 3 * slot
_SLOT = 7
_PATTERN_SLOTS = 64


def _pattern(bits: int, slots: int) -> int:
    return sum(bits << (3 * s) for s in range(slots))


class Prefix(NamedTuple):
    """A worker's leading pages of a chain: ``gpu`` in L1, then ``host`` more in L2."""
    gpu: int
    host: int


class IndexMemory(NamedTuple):
    blocks: int
    bytes: int
    slots: int                    # worker slots in use or dead: the masks' width / 3

    @property
    def bytes_per_block(self) -> float:
        return self.bytes / self.blocks if self.blocks else 0.0


@dataclass
class IndexCounters:
    stored: int = 0
    removed: int = 0
    cleared: int = 0
    evicted: int = 0              # entries dropped by the LRU bound
    ignored: int = 0              # events of unknown workers or of the L3 tier
    sweeps: int = 0


class BlockIndex:
    """Per-worker, per-tier residency of blocks; see the module docstring."""

    def __init__(self, max_blocks: int = MAX_BLOCKS):
        if max_blocks <= 0:
            raise ValueError(f"max_blocks {max_blocks}: must be positive")
        self.max_blocks = max_blocks
        self.counters = IndexCounters()
        self._table: OrderedDict[int, int] = OrderedDict()
        self._touches: deque = deque(maxlen=MAX_PENDING_TOUCHES)
        self._slot: dict[str, int] = {}            # worker -> its current slot
        self._name: dict[int, str] = {}            # slot -> worker
        self._free: list[int] = []
        self._dead = 0                             # bits of dead slots
        self._dead_slots = 0
        self._next = 0
        self._visible = 0                          # bits of live workers with live streams
        self._lookup_bits = _pattern(_GPU | _ANY, _PATTERN_SLOTS)

    # -------------------------------------------------------------- workers

    def add_worker(self, name: str) -> None:
        """Track ``name`` with an empty cache (a known one starts over)."""
        if name in self._slot:
            self._kill(self._slot[name])
        self._assign(name)

    def remove_worker(self, name: str) -> None:
        slot = self._slot.pop(name, None)
        if slot is not None:
            self._kill(slot)

    def clear_worker(self, name: str) -> bool:
        """Forget what ``name`` holds, keeping its stream's health; False if unknown."""
        slot = self._slot.get(name)
        if slot is None:
            return False
        hidden = not self.visible(name)
        self._kill(slot)
        self._assign(name)
        if hidden:
            self._health(name, False)
        return True

    def _assign(self, name: str) -> None:
        if self._free:
            slot = self._free.pop()
        else:
            slot, self._next = self._next, self._next + 1
            if self._next > self._lookup_bits.bit_length() // 3:
                self._lookup_bits = _pattern(_GPU | _ANY, 2 * self._next)
        self._slot[name], self._name[slot] = slot, name
        self._visible |= _SLOT << (3 * slot)

    def _kill(self, slot: int) -> None:
        bits = _SLOT << (3 * slot)
        self._visible &= ~bits
        self._dead |= bits
        self._dead_slots += 1
        del self._name[slot]
        if self._dead_slots >= max(SWEEP_MIN_DEAD, len(self._slot)):
            self._sweep()

    def _sweep(self) -> None:
        keep, table = ~self._dead, self._table
        for h in [h for h, v in table.items() if not v & keep]:
            del table[h]
        for h, v in table.items():
            if v & self._dead:
                table[h] = v & keep
        self._free.extend(s for s in range(self._next) if (self._dead >> (3 * s)) & _SLOT)
        self._dead = self._dead_slots = 0
        self.counters.sweeps += 1

    # --------------------------------------------------------------- events

    def apply(self, events: Iterable[Event]) -> None:
        """Apply one worker stream's events in the order they were published."""
        self._flush_touches()
        for e in events:
            if isinstance(e, BlocksStored):
                self._store(e.worker, e.tier, e.block_hashes)
            elif isinstance(e, BlocksRemoved):
                self._remove(e.worker, e.tier, e.block_hashes)
            elif isinstance(e, Cleared):
                if self.clear_worker(e.worker):
                    self.counters.cleared += 1
                else:
                    self.counters.ignored += 1
            elif isinstance(e, StreamHealth):
                self._health(e.worker, e.live)

    def _bits(self, worker: str, tier: Tier) -> tuple[int, int]:
        """(this tier's bit, the slot's shift) or (0, 0) for an event to ignore."""
        slot = self._slot.get(worker)
        if slot is None or tier not in (Tier.GPU, Tier.HOST):
            self.counters.ignored += 1
            return 0, 0
        return (_GPU if tier == Tier.GPU else _HOST) << (3 * slot), 3 * slot

    def _store(self, worker: str, tier: Tier, hashes: Sequence[int]) -> None:
        bit, shift = self._bits(worker, tier)
        if not bit:
            return
        bit |= _ANY << shift
        table, touch = self._table, self._table.move_to_end
        for h in hashes:
            v = table.get(h)
            if v is None:
                table[h] = bit
            else:
                table[h] = v | bit
                touch(h)
        self.counters.stored += len(hashes)
        over = len(table) - self.max_blocks
        if over > 0:
            for _ in range(over):
                table.popitem(last=False)
            self.counters.evicted += over

    def _remove(self, worker: str, tier: Tier, hashes: Sequence[int]) -> None:
        bit, shift = self._bits(worker, tier)
        if not bit:
            return
        table, keep, other = self._table, ~(bit | self._dead), (_GPU | _HOST) << shift
        for h in hashes:
            v = table.get(h)
            if v is not None:
                v &= keep
                if not v & other:             # in neither tier now
                    v &= ~(_ANY << shift)
                if v:
                    table[h] = v
                else:
                    del table[h]
        self.counters.removed += len(hashes)

    def _health(self, worker: str, live: bool) -> None:
        slot = self._slot.get(worker)
        if slot is None:
            self.counters.ignored += 1
        elif live:
            self._visible |= _SLOT << (3 * slot)
        else:
            self._visible &= ~(_SLOT << (3 * slot))

    def visible(self, worker: str) -> bool:
        """Whether ``worker``'s cache is known (its stream is live)."""
        slot = self._slot.get(worker)
        return slot is not None and bool((self._visible >> (3 * slot)) & 1)

    # --------------------------------------------------------------- lookups

    def prefixes(self, block_hashes: Sequence[int]) -> dict[str, Prefix]:
        """Every visible worker's leading pages of the chain in L1 and then L2 (workers with
        none are left out)."""
        start = self._visible & self._lookup_bits
        runs = list(takewhile(bool, accumulate(map(self._table.get, block_hashes, repeat(0)),
                                               and_, initial=start)))
        # runs[i]: the bits still set after i blocks; runs[0] = start, never 0 unless empty
        n = len(runs)
        if n > 1:
            self._touches.append((block_hashes, n - 1))
        gpu: dict[int, int] = {}
        any_: dict[int, int] = {}
        for bit, pages in survivals(runs):
            (gpu if bit % 3 == 0 else any_)[bit // 3] = pages
        name = self._name
        return {name[s]: Prefix(gpu.get(s, 0), pages - gpu.get(s, 0))
                for s, pages in any_.items() if pages}

    def _flush_touches(self) -> None:
        touch, table = self._table.move_to_end, self._table
        while self._touches:
            hashes, n = self._touches.popleft()
            for h in hashes[:n]:
                if h in table:
                    touch(h)

    def memory(self) -> IndexMemory:
        """Entries held and the bytes they take (the map, its keys and its masks)."""
        n = len(self._table)
        if not n:
            return IndexMemory(0, sys.getsizeof(self._table), self._next)
        sample = [(k, v) for _, (k, v) in zip(range(64), self._table.items())]
        per = sum(sys.getsizeof(k) + _int_bytes(v) for k, v in sample) / len(sample)
        return IndexMemory(n, int(sys.getsizeof(self._table) + n * per), self._next)


def survivals(runs: Sequence[int]) -> Iterator[tuple[int, int]]:
    """(bit, blocks it survived) for every bit of ``runs[0]``, where ``runs[i]`` is the AND of
    ``runs[0]`` and the first ``i`` blocks' masks: a non-increasing sequence of ints, so each
    distinct value's run ends where bisection finds a smaller one."""
    i, n = 0, len(runs)
    while i < n:
        value = runs[i]
        j = bisect_right(runs, -value, lo=i, key=neg)
        lost = value & ~runs[j] if j < n else value
        while lost:
            low = lost & -lost
            yield low.bit_length() - 1, j - 1
            lost ^= low
        i = j


def _int_bytes(v: int) -> int:
    return 0 if -5 <= v <= 256 else sys.getsizeof(v)    # CPython shares small ints
