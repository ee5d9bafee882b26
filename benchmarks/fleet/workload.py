"""Requests of a trace in Mooncake's FAST'25 JSONL format, and the page hashes a router sees.

One JSON object per line: ``timestamp`` (ms), ``input_length``, ``output_length``,
``hash_ids`` (ids of the prompt's 512-token blocks, chained: equal ids at the start of two
prompts are a shared prefix; the partial last block has an id of its own). The committed
conversation trace is ``benchmarks/data/mooncake-fast25/conversation_trace.jsonl.xz``;
``agents.py`` writes workloads of our own in the same format.
"""
from __future__ import annotations

import hashlib
import json
import lzma
import os
import random
from typing import Iterable, NamedTuple, Optional, Sequence

from replay.trace import rows as trace_rows

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data")
CONVERSATION = os.path.join(DATA, "mooncake-fast25", "conversation_trace.jsonl.xz")
BLOCK_TOKENS = 512          # the trace's block: one simulated page


class TraceRequest(NamedTuple):
    index: int
    timestamp_s: float      # from the trace's start, before load scaling
    input_tokens: int
    output_tokens: int
    hash_ids: tuple


def load(path: str = CONVERSATION, limit: Optional[int] = None) -> list[TraceRequest]:
    """The first ``limit`` requests (all when None) of a ``.jsonl`` or ``.jsonl.xz`` file, in
    timestamp order (stable), indexed from 0."""
    reqs: list[TraceRequest] = []
    for i, d in enumerate(trace_rows(path, limit)):
        n_in = int(d["input_length"])
        if n_in <= 0:
            raise ValueError(f"{path}: record {i + 1}: input_length must be > 0")
        reqs.append(TraceRequest(i, d["timestamp"] / 1000.0, n_in,
                                 max(1, int(d["output_length"])), tuple(d["hash_ids"])))
    reqs.sort(key=lambda r: r.timestamp_s)
    return [r._replace(index=i) for i, r in enumerate(reqs)]


def spread(reqs: Sequence[TraceRequest], seed: int = 0) -> list[TraceRequest]:
    """Each timestamp's requests at uniformly random times (sorted, seeded) up to the next
    timestamp, in the trace's order: a Poisson process given each bucket's count.

    The conversation trace's timestamps come in 3 s buckets (every request shares its
    timestamp with 9-27 others); replayed as they are, each bucket is a burst arriving at one
    instant, at any load. Real arrivals are not synchronized to 3 s."""
    rng = random.Random(seed)
    out, i, n = [], 0, len(reqs)
    while i < n:
        j = i
        while j < n and reqs[j].timestamp_s == reqs[i].timestamp_s:
            j += 1
        t0 = reqs[i].timestamp_s
        gap = (reqs[j].timestamp_s - t0) if j < n else (t0 - reqs[i - 1].timestamp_s if i else 0.0)
        times = sorted(t0 + gap * rng.random() for _ in range(j - i)) if j - i > 1 else [t0]
        out.extend(r._replace(timestamp_s=t) for r, t in zip(reqs[i:j], times))
        i = j
    return out


def write(path: str, reqs: Iterable[TraceRequest]) -> None:
    opener = lzma.open if path.endswith(".xz") else open
    with opener(path, "wt") as f:
        for r in reqs:
            f.write(json.dumps({"timestamp": round(r.timestamp_s * 1000), "input_length":
                                r.input_tokens, "output_length": r.output_tokens,
                                "hash_ids": list(r.hash_ids)}) + "\n")


def block_hash(page_hash: str) -> int:
    """The int64 block hash SGLang publishes in its KV events for a page: the first 16 hex
    characters as a signed 64-bit integer (``sglang.srt.mem_cache.utils.hash_str_to_int64``;
    no namespace seed, no LoRA, no cache salt)."""
    v = int(page_hash[:16], 16)
    return v - (1 << 64) if v >= 1 << 63 else v


class PageNames:
    """Each trace block id as a router sees its page: a 64-hex page hash (as SGLang's chained
    SHA-256 page keys look) and the int64 block hash of its KV events. Interned: a block id is
    hashed once per run."""

    def __init__(self) -> None:
        self._hex: dict[int, str] = {}
        self._int: dict[int, int] = {}
        self.block_of: dict[str, int] = {}      # page hash -> block id (the L3 view's key)

    def page_hash(self, block: int) -> str:
        h = self._hex.get(block)
        if h is None:
            h = hashlib.sha256(str(block).encode()).hexdigest()
            self._hex[block] = h
            self._int[block] = block_hash(h)
            self.block_of[h] = block
        return h

    def page_hashes(self, chain: Sequence[int]) -> tuple:
        return tuple(self.page_hash(b) for b in chain)

    def block_hashes(self, blocks: Iterable[int]) -> list[int]:
        get = self._int
        return [get[b] for b in blocks]          # every block was named before it was stored


class Workload:
    """A trace with the page hashes of every request, named once and shared by every run over
    it (hashing the chains is a fifth of a run's time otherwise)."""

    def __init__(self, requests: Sequence[TraceRequest]):
        self.requests = list(requests)
        self.names = PageNames()
        # a router sees the prompt's full pages only (SGLang hashes no partial page)
        self.page_hashes = [self.names.page_hashes(r.hash_ids[:r.input_tokens // BLOCK_TOKENS])
                            for r in self.requests]
        self.previous = previous_turns(self.requests)

    @property
    def distinct_blocks(self) -> int:
        return len(self.names.block_of)

    def __len__(self) -> int:
        return len(self.requests)


def previous_turns(reqs: Sequence[TraceRequest]) -> list[int]:
    """For each request, its conversation's previous turn: the latest earlier request whose
    full pages (at least 2) are a prefix of this one's; -1 if none. Ids are chained (an id
    names its whole prefix), so a prefix of k pages is named by (k, its last id)."""
    latest: dict = {}
    out = []
    for r in reqs:
        full = r.hash_ids[:r.input_tokens // BLOCK_TOKENS]
        best = -1
        for k in range(2, len(full) + 1):
            q = latest.get((k, full[k - 1]), -1)
            if q > best:
                best = q
        out.append(best)
        if len(full) >= 2:
            latest[(len(full), full[-1])] = r.index
    return out
