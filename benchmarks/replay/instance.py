"""One simulated serving instance: a process with its own local cache and its own L3 client.

Per request (a chain of block ids), the way SGLang's HiCache serves a prefix:

1. local hits: the leading run of the chain in this instance's LRU (its L2);
2. L3 probe: leading-run ``exists`` on the keys of the rest of the chain;
3. L3 load: ``get_into`` of those blocks into poisoned staging slots; every block the store
   reports as read is checked byte for byte; the L3 hits are the leading run of good blocks;
4. compute: the blocks after that are "computed" (their bytes derived from their ids) and
   ``put_from`` the staging slots, so every later request on any instance can load them;
5. the whole chain enters the local LRU.
"""
from __future__ import annotations

import time
import traceback
from typing import NamedTuple

from .backends import open_l3
from .blocks import BlockPool
from .trace import LocalLRU


class InstanceConfig(NamedTuple):
    local_blocks: int     # local LRU capacity, blocks
    block_bytes: int
    max_chain: int        # staging slots: the longest chain of the trace
    namespace: str        # key prefix of this replay: ``<namespace>/<block id>``
    # the chains whose puts ask for copies (``chain_id``s: e.g. the hottest 10 %), and whether
    # puts name their parent block at all (as SGLang does with its prefix keys)
    hot_chains: frozenset = frozenset()
    name_parents: bool = True
    put_each: bool = False  # one put per block: each placed alone (no chain at all)


def chain_id(chain: tuple) -> int:
    """A request's chain: its second block, the first after the system prompt all share."""
    return chain[1] if len(chain) > 1 else chain[0]


class Outcome(NamedTuple):
    """What one request did; times in seconds (0 where the call was not made)."""
    index: int
    blocks: int
    local: int            # served by the local cache
    l3: int               # served by the L3 (leading run of good reads after the local hits)
    probed: int           # the L3's exists answer
    read: int             # blocks the L3 delivered and that checked out (incl. past a gap)
    wrong: int            # blocks the L3 reported as read whose bytes were wrong
    put: int              # blocks offered to the L3
    put_failed: int
    t_exists: float
    t_get: float
    t_put: float


class Instance:
    def __init__(self, spec: dict, cfg: InstanceConfig):
        self.cfg = cfg
        self.l3 = open_l3(spec)
        self.pool = BlockPool(cfg.max_chain, cfg.block_bytes)
        self.ptrs = self.pool.ptrs(cfg.max_chain)
        self.l3.register(self.pool.ptr, self.pool.nbytes)
        self.lru = LocalLRU(cfg.local_blocks)

    def serve(self, index: int, chain: tuple) -> Outcome:
        lru, pool, bb = self.lru, self.pool, self.cfg.block_bytes
        k = lru.leading(chain)
        rest = chain[k:]
        probed = m = read = wrong = put = put_failed = 0
        t_exists = t_get = t_put = 0.0
        if rest and self.l3.enabled:
            keys = [f"{self.cfg.namespace}/{b}" for b in rest]
            t0 = time.perf_counter()
            probed = self.l3.exists(keys)
            t1 = time.perf_counter()
            t_exists = t1 - t0
            if probed:
                pool.poison(probed)
                ok = self.l3.get_into(keys[:probed], self.ptrs[:probed], [bb] * probed)
                t_get = time.perf_counter() - t1
                good = [g and pool.check(i, rest[i]) for i, g in enumerate(ok)]
                wrong = sum(ok) - sum(good)
                read = sum(good)
                while m < probed and good[m]:
                    m += 1
            todo = rest[m:]
            for i, b in enumerate(todo):
                pool.fill(i, b)
            t2 = time.perf_counter()
            before = k + m          # the blocks of the chain before the first one put
            parent = f"{self.cfg.namespace}/{chain[before - 1]}" \
                if before and self.cfg.name_parents else ""
            hot = len(todo) if chain_id(chain) in self.cfg.hot_chains else 0
            if self.cfg.put_each:
                done = [ok for i in range(len(todo)) for ok in self.l3.put_from(
                    keys[m + i:m + i + 1], self.ptrs[i:i + 1], [bb], "", 0)]
            else:
                done = self.l3.put_from(keys[m:], self.ptrs[:len(todo)], [bb] * len(todo), parent, hot)
            t_put = time.perf_counter() - t2
            put, put_failed = len(todo), len(todo) - sum(done)
        lru.touch(chain)
        return Outcome(index, len(chain), k, m, probed, read, wrong, put, put_failed,
                       t_exists, t_get, t_put)

    def close(self) -> None:
        self.l3.close()


def run_instance(idx: int, spec: dict, cfg: InstanceConfig, inq, outq) -> None:
    """Process body: ``("ready", idx, None)``, then one ``("done", idx, Outcome)`` per request
    taken from ``inq`` until ``None``; ``("error", idx, text)`` on any failure."""
    try:
        inst = Instance(spec, cfg)
    except Exception:
        outq.put(("error", idx, traceback.format_exc()))
        return
    outq.put(("ready", idx, None))
    try:
        while True:
            msg = inq.get()
            if msg is None:
                break
            outq.put(("done", idx, inst.serve(*msg)))
    except Exception:
        outq.put(("error", idx, traceback.format_exc()))
    finally:
        inst.close()
