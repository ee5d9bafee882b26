"""The request trace: loading, its cache ceiling, and the per-instance local cache.

A request is a chain of block ids (``hash_ids``: 512-token prefix blocks). Equal ids at the
start of two chains are a shared prefix, so a cache serves a request's leading run of known
blocks; a block after the first miss is recomputed even if it is cached.
"""
from __future__ import annotations

import itertools
import json
import lzma
import os
from collections import OrderedDict
from typing import Iterator, NamedTuple, Optional, Sequence

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data")
DEFAULT_TRACE = os.path.join(DATA, "mooncake-fast25", "conversation_trace.jsonl.xz")


class Request(NamedTuple):
    index: int
    timestamp_ms: int
    hash_ids: tuple


def rows(path: str, limit: Optional[int] = None) -> Iterator[dict]:
    """The first ``limit`` records (all when None) of a ``.jsonl`` or ``.jsonl.xz`` trace, as
    read (blank lines skipped)."""
    opener = lzma.open if path.endswith(".xz") else open
    with opener(path, "rt") as f:
        records = (json.loads(line) for line in f if line.strip())
        yield from itertools.islice(records, limit)


def load(path: str = DEFAULT_TRACE, limit: Optional[int] = None) -> list[Request]:
    """The first ``limit`` requests (all when None) of a ``.jsonl`` or ``.jsonl.xz`` trace."""
    out = [Request(i, int(d["timestamp"]), tuple(d["hash_ids"]))
           for i, d in enumerate(rows(path, limit))]
    if any(a.timestamp_ms > b.timestamp_ms for a, b in zip(out, out[1:])):
        out.sort(key=lambda r: r.timestamp_ms)      # replay in timestamp order, stable
        out = [r._replace(index=i) for i, r in enumerate(out)]
    return out


def blocks(reqs: Sequence[Request]) -> int:
    return sum(len(r.hash_ids) for r in reqs)


def distinct(reqs: Sequence[Request]) -> int:
    return len({b for r in reqs for b in r.hash_ids})


def leading_run(chain: Sequence[int], have) -> int:
    """How many blocks of ``chain``, from the first, are in ``have``."""
    n = 0
    while n < len(chain) and chain[n] in have:
        n += 1
    return n


def ceiling(reqs: Sequence[Request]) -> int:
    """Blocks an unbounded cache shared by every instance serves: each request's leading run
    of blocks seen in any earlier request."""
    seen: set = set()
    hits = 0
    for r in reqs:
        hits += leading_run(r.hash_ids, seen)
        seen.update(r.hash_ids)
    return hits


def simulate(reqs: Sequence[Request], instances: int, local_blocks: int, l3_blocks: int) -> int:
    """Blocks served by local LRUs plus an exact LRU L3 of ``l3_blocks`` blocks, in memory.

    The reference a store's eviction policy is judged against: the same flow as an instance
    (local leading run, then L3 leading run, reads refresh, computed blocks are added in chain
    order, a block already held is not refreshed by a put) with no watermarks or leases."""
    local = [LocalLRU(local_blocks) for _ in range(instances)]
    l3: "OrderedDict[int, None]" = OrderedDict()
    hits = 0
    for r in reqs:
        chain, lru = r.hash_ids, local[r.index % instances]
        m = k = lru.leading(chain)
        if l3_blocks > 0:
            m += leading_run(chain[k:], l3)
            for b in chain[k:m]:
                l3.move_to_end(b)
            for b in chain[m:]:
                l3.setdefault(b, None)
            while len(l3) > l3_blocks:
                l3.popitem(last=False)
        hits += m
        lru.touch(chain)
    return hits


class LocalLRU:
    """An instance's own cache (its L2) of ``capacity`` blocks, least recently used out first.

    A request touches its chain from the last block to the first, so a prefix is always more
    recent than its continuations and leaves go first, as in SGLang's radix tree (which evicts
    leaf nodes by last access): an evicted head would strand its descendants.
    """

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.blocks: "OrderedDict[int, None]" = OrderedDict()

    def __contains__(self, block: int) -> bool:
        return block in self.blocks

    def leading(self, chain: Sequence[int]) -> int:
        return leading_run(chain, self.blocks)

    def touch(self, chain: Sequence[int]) -> None:
        if self.capacity <= 0:
            return
        for b in reversed(chain):
            self.blocks[b] = None
            self.blocks.move_to_end(b)
        while len(self.blocks) > self.capacity:
            self.blocks.popitem(last=False)
