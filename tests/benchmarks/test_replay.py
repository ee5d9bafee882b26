"""Trace replay (benchmarks/replay_trace.py) on the first requests of the Mooncake trace, with
instances as separate processes against real stores; checks what is exact:

- an L3 with room for every block serves exactly the trace's ceiling (computed here from the
  hash_ids alone);
- an L3 of zero capacity (none at all, or a real store that admits no block) serves exactly
  what the local caches alone serve (simulated here);
- no block is ever read back wrong, also under heavy eviction and from an SSD tier.
"""
from __future__ import annotations

import importlib.util
import time
import os
import sys
from collections import OrderedDict

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from replay import trace  # noqa: E402
from replay.driver import replay  # noqa: E402
from replay.report import summarize  # noqa: E402

REQUESTS = 400          # 11,349 blocks, 9,821 distinct, ceiling 13.46 %
INSTANCES = 3
LOCAL_BLOCKS = 50       # small enough that local caches evict, so the LRU matters
BLOCK = 4096            # 9,821 distinct blocks: 40 MiB, within the 256 MiB store


@pytest.fixture(scope="module")
def reqs():
    return trace.load(limit=REQUESTS)


def ceiling_rate(reqs) -> float:
    """Leading run of blocks seen in any earlier request, from the hash_ids alone."""
    seen, hits, total = set(), 0, 0
    for r in reqs:
        ids = r.hash_ids
        n = 0
        while n < len(ids) and ids[n] in seen:
            n += 1
        hits, total = hits + n, total + len(ids)
        seen.update(ids)
    return hits / total


def local_only_rate(reqs, instances: int, capacity: int) -> float:
    """Round-robin instances, each an LRU of ``capacity`` blocks refreshed leaf-first."""
    caches = [OrderedDict() for _ in range(instances)]
    hits = total = 0
    for i, r in enumerate(reqs):
        cache = caches[i % instances]
        n = 0
        while n < len(r.hash_ids) and r.hash_ids[n] in cache:
            n += 1
        hits, total = hits + n, total + len(r.hash_ids)
        for b in reversed(r.hash_ids):
            cache[b] = None
            cache.move_to_end(b)
        while len(cache) > capacity:
            cache.popitem(last=False)
    return hits / total


def run(reqs, spec) -> dict:
    return summarize(replay(reqs, spec, INSTANCES, LOCAL_BLOCKS, BLOCK), BLOCK, 1.0)


def test_trace_figures(reqs):
    full = trace.load()
    assert (len(full), trace.blocks(full), trace.distinct(full)) == (12031, 288500, 182790)
    assert trace.ceiling(full) / trace.blocks(full) == pytest.approx(0.366, abs=5e-4)
    assert trace.ceiling(reqs) / trace.blocks(reqs) == ceiling_rate(reqs)


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_unbounded_l3_reaches_the_ceiling(store, reqs, transport):
    s = run(reqs, {"kind": "hicache-mc", "master": store.master, "transport": transport})
    assert s["wrong"] == 0
    assert s["put_failed"] == 0 and s["lost_after_exists"] == 0
    assert s["hit_rate"] == ceiling_rate(reqs)
    assert s["local_rate"] == local_only_rate(reqs, INSTANCES, LOCAL_BLOCKS) < s["hit_rate"]
    assert s["bytes_read"] == s["l3_hits"] * BLOCK > 0


def test_zero_capacity_is_local_only(reqs):
    s = run(reqs, {"kind": "none"})
    assert s["hit_rate"] == s["local_rate"] == local_only_rate(reqs, INSTANCES, LOCAL_BLOCKS)
    assert s["put"] == s["probed"] == 0


def test_store_that_admits_no_block_is_local_only(cluster, reqs):
    cluster.env["HICACHE_MC_MAX_VALUE"] = str(BLOCK // 2)   # every block is refused
    cluster.start_master()
    cluster.add_node(dram="16MiB")
    cluster.wait_nodes(1)
    s = run(reqs, {"kind": "hicache-mc", "master": cluster.master})
    assert s["hit_rate"] == local_only_rate(reqs, INSTANCES, LOCAL_BLOCKS)
    assert s["l3_hits"] == s["probed"] == 0
    assert s["put"] == s["put_failed"] > 0


def test_evicting_and_ssd_tiers_never_return_a_wrong_block(cluster, reqs, tmp_path):
    """1 MiB of DRAM (256 blocks) under an SSD tier of 64 MiB, and a DRAM-only node of 2 MiB:
    slots are reused all the time and reads come from disk."""
    cluster.start_master()
    cluster.add_node(dram="1MiB", args=("--ssd", "64MiB", "--ssd-dir", str(tmp_path / "ssd")))
    cluster.add_node(dram="2MiB")
    cluster.wait_nodes(2)
    s = run(reqs, {"kind": "hicache-mc", "master": cluster.master})
    assert s["wrong"] == 0
    assert s["local_rate"] < s["hit_rate"] <= ceiling_rate(reqs)
    from_disk = lambda ns: sum(n.get("ssd_promotions", 0) + n.get("ssd_demotions", 0)  # noqa: E731
                               for n in ns)
    end = time.monotonic() + 5                       # node counters travel with heartbeats
    while from_disk(cluster.stats()["nodes"]) == 0 and time.monotonic() < end:
        time.sleep(0.1)
    nodes = cluster.stats()["nodes"]
    assert sum(n.get("evictions", 0) for n in nodes) > 0
    # the SSD tier was used: blocks demoted to it, and staged back for reads
    assert from_disk(nodes) > 0


@pytest.mark.skipif(importlib.util.find_spec("mooncake") is None, reason="Mooncake Store not installed")
def test_mooncake_store_unbounded_reaches_the_ceiling(reqs):
    from replay.services import mooncake_store
    with mooncake_store(256 << 20) as st:
        s = run(reqs, st.spec)
    assert s["wrong"] == 0 and s["put_failed"] == 0
    assert s["hit_rate"] == ceiling_rate(reqs)
