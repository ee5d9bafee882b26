"""batch_exists_v2 against hand-computed answers: real host pools, a real store, one round trip.

Six pages ``p1..p6`` (stop point ``k`` = the prefix of the first ``k`` pages). Each case stores
exactly the objects it names, then compares the whole PoolTransferResult.
"""
from __future__ import annotations

import pytest
from sglang.srt.mem_cache.hicache_storage import (PoolHitPolicy, PoolName, PoolTransfer,
                                                  PoolTransferResult)

from pools import (fill_random, logical_anchor, make_hybrid_backend, mamba_host, mha_host,
                   mla_host, page_hashes, slots, swa_host)
from test_hybrid import Calls

TRAIL, ALL, GROUPS = (PoolHitPolicy.TRAILING_PAGES, PoolHitPolicy.ALL_PAGES,
                      PoolHitPolicy.BLOCK_GROUPS)
N = 6
SWA_WINDOW = 2


class Rig:
    """KV + Mamba + SWA (window 2) + an all-pages draft pool, one backend, fresh page hashes."""

    def __init__(self, master, anchor=None, make=make_hybrid_backend):
        self.kv = anchor if anchor is not None else mha_host("page_first")
        self.pools = {PoolName.MAMBA: mamba_host(), PoolName.SWA: swa_host("page_first"),
                      PoolName.DRAFT: mla_host("page_first", layers=1)}
        self.backend = make(master, self.kv, self.pools)   # any HiCacheStorage with v2
        self.keys = page_hashes(N, 16)

    def store(self, name, pages: list[int]) -> None:
        """Store pool ``name``'s object at these 1-based pages."""
        keys = [self.keys[p - 1] for p in pages]
        if name == PoolName.KV:
            idx = slots(self.kv, len(keys))
            fill_random(self.kv, idx, 1)
            assert self.backend.batch_set_v1(keys, idx) == [True] * len(keys)
            return
        pool = self.pools[name]
        idx = slots(pool, len(keys))
        fill_random(pool, idx, 2)
        assert self.backend.batch_set_v2([PoolTransfer(name, host_indices=idx, keys=keys)]) == \
            {name: [True] * len(keys)}
        pool.free(idx)

    def query(self, *names) -> PoolTransferResult:
        """What HybridCacheController asks: trailing pools name their window's keys."""
        ts = {PoolName.MAMBA: PoolTransfer(PoolName.MAMBA, keys=self.keys[-1:], hit_policy=TRAIL),
              PoolName.SWA: PoolTransfer(PoolName.SWA, keys=self.keys[-SWA_WINDOW:], hit_policy=TRAIL),
              PoolName.DRAFT: PoolTransfer(PoolName.DRAFT, keys=self.keys, hit_policy=ALL)}
        return self.backend.batch_exists_v2(self.keys, [ts[n] for n in names])


@pytest.fixture
def rig(shared_store):
    r = Rig(shared_store.master)
    yield r
    r.backend.close()


def result(kv, hits, restorable):
    return PoolTransferResult(kv, hits, restorable)


def test_full_hit(rig):
    for name in (PoolName.KV, PoolName.MAMBA, PoolName.SWA, PoolName.DRAFT):
        rig.store(name, list(range(1, N + 1)))
    calls = Calls(rig.backend)
    got = rig.query(PoolName.MAMBA, PoolName.SWA, PoolName.DRAFT)
    assert got == result(6, {PoolName.KV: 6, PoolName.MAMBA: 6, PoolName.SWA: 6,
                             PoolName.DRAFT: 6}, [1, 2, 3, 4, 5, 6])
    assert calls.n == {"batch_contains": 1}                 # every pool in one round trip


def test_kv_only_query_is_the_leading_kv_run(rig):
    rig.store(PoolName.KV, [1, 2, 3, 5, 6])
    assert rig.query() == result(3, {PoolName.KV: 3}, [1, 2, 3])


def test_kv_miss_in_the_middle_cuts_every_pool(rig):
    rig.store(PoolName.KV, [1, 2, 4, 5, 6])                 # page 3 lost
    rig.store(PoolName.MAMBA, [2, 4, 6])
    rig.store(PoolName.DRAFT, list(range(1, N + 1)))
    got = rig.query(PoolName.MAMBA, PoolName.DRAFT)
    assert got == result(2, {PoolName.KV: 2, PoolName.MAMBA: 2, PoolName.DRAFT: 2}, [2])


def test_trailing_states_at_some_stop_points_leave_holes(rig):
    rig.store(PoolName.KV, list(range(1, N + 1)))
    rig.store(PoolName.MAMBA, [2, 4, 6])                    # state saved at stop points 2, 4, 6
    rig.store(PoolName.SWA, [1, 2, 4, 5, 6])                # window 2: points 1, 2, 5, 6
    assert rig.query(PoolName.MAMBA) == result(6, {PoolName.KV: 6, PoolName.MAMBA: 6}, [2, 4, 6])
    assert rig.query(PoolName.SWA) == result(6, {PoolName.KV: 6, PoolName.SWA: 6}, [1, 2, 5, 6])
    got = rig.query(PoolName.MAMBA, PoolName.SWA)
    assert got == result(6, {PoolName.KV: 6, PoolName.MAMBA: 6, PoolName.SWA: 6}, [2, 6])


def test_latest_trailing_state_missing_falls_back_to_an_earlier_stop_point(rig):
    rig.store(PoolName.KV, list(range(1, N + 1)))
    rig.store(PoolName.MAMBA, [1, 3])
    got = rig.query(PoolName.MAMBA)
    assert got == result(3, {PoolName.KV: 6, PoolName.MAMBA: 3}, [1, 3])


def test_all_pages_pool_with_a_hole(rig):
    rig.store(PoolName.KV, list(range(1, N + 1)))
    rig.store(PoolName.DRAFT, [1, 2, 3, 5, 6])
    rig.store(PoolName.MAMBA, [2, 5])
    got = rig.query(PoolName.DRAFT, PoolName.MAMBA)
    assert got == result(2, {PoolName.KV: 6, PoolName.DRAFT: 3, PoolName.MAMBA: 5}, [2])


def test_a_side_pool_missing_entirely_is_a_miss(rig):
    rig.store(PoolName.KV, list(range(1, N + 1)))
    rig.store(PoolName.SWA, list(range(1, N + 1)))
    assert rig.query(PoolName.SWA, PoolName.MAMBA) == \
        result(0, {PoolName.KV: 6, PoolName.SWA: 6}, [])


def test_an_unregistered_pool_is_a_miss(rig):
    rig.store(PoolName.KV, list(range(1, N + 1)))
    t = PoolTransfer(PoolName.INDEXER, keys=rig.keys, hit_policy=ALL)
    assert rig.backend.batch_exists_v2(rig.keys, [t]) == result(0, {PoolName.KV: 6}, [])


def test_block_groups_report_whole_groups_and_never_gate(rig):
    rig.store(PoolName.KV, list(range(1, N + 1)))
    # Draft keys as a compressed form: 2 keys per group, one group per 3 FULL pages.
    rig.store(PoolName.DRAFT, [1, 2, 3])                    # groups (1,2) whole, (3,4) not
    t = PoolTransfer(PoolName.DRAFT, keys=rig.keys[:4], hit_policy=GROUPS, block_pages=3,
                     group_pages=2)
    got = rig.backend.batch_exists_v2(rig.keys, [t])
    assert got == result(6, {PoolName.KV: 6, PoolName.DRAFT: 3}, [1, 2, 3, 4, 5, 6])


def test_a_dead_store_answers_zero_hits(shared_store, tmp_path):
    from procs import Cluster
    cluster = Cluster(tmp_path)
    cluster.start_serve("64MiB")
    r = Rig(cluster.master)
    r.store(PoolName.KV, list(range(1, N + 1)))
    r.store(PoolName.MAMBA, list(range(1, N + 1)))
    assert r.query(PoolName.MAMBA).kv_hit_pages == 6
    cluster.stop()
    got = r.query(PoolName.MAMBA, PoolName.SWA)
    assert got.kv_hit_pages == 0 and not got.restorable_prefix_pages
    assert r.backend.batch_get_v2([PoolTransfer(PoolName.MAMBA, host_indices=slots(
        r.pools[PoolName.MAMBA], 1), keys=r.keys[:1])]) == {PoolName.MAMBA: [False]}
    r.backend.close()


def test_logical_anchor_lets_the_side_pools_decide(shared_store):
    r = Rig(shared_store.master, anchor=logical_anchor())
    b = r.backend
    assert b.logical_anchor and b.geometry is None
    idx = r.kv.alloc(2 * 16)
    assert b.batch_set_v1(r.keys[:2], idx) == [True, True]  # no KV bytes to move
    assert b.batch_get_v1(r.keys[:2], idx) == [True, True]
    assert b.batch_exists(r.keys) == 0                      # never a hit without side pools
    assert b.batch_exists_v2(r.keys, []) == result(0, {}, [])
    r.store(PoolName.SWA, [1, 2, 3, 4])
    r.store(PoolName.DRAFT, [1, 2, 3, 4, 5])
    got = r.query(PoolName.SWA, PoolName.DRAFT)
    # KV counts every page (it has no bytes); SWA's points 1-4, draft's 1-5: restorable 1-4.
    assert got == result(4, {PoolName.KV: 6, PoolName.SWA: 4, PoolName.DRAFT: 5}, [1, 2, 3, 4])
    b.close()


def test_every_pool_is_answered_by_the_residency_view(rig):
    """The KV pages and each side pool live in namespaces of their own; once the view follows
    them all (registration starts it), batch_exists_v2 is answered by it (the master only for
    the keys it lacks), as the master would answer it."""
    import time
    rig.store(PoolName.KV, [1, 2, 3, 4, 5, 6])
    rig.store(PoolName.MAMBA, [2, 4, 6])
    rig.store(PoolName.SWA, [1, 2, 5, 6])
    want = result(6, {PoolName.KV: 6, PoolName.MAMBA: 6, PoolName.SWA: 6}, [2, 6])
    view = rig.backend.client.view
    end = time.monotonic() + 10
    while True:
        answers = view.counters["view_answers"]
        got = rig.query(PoolName.MAMBA, PoolName.SWA)
        if view.counters["view_answers"] == answers + 1:
            break
        assert got == want                  # (the master answered meanwhile)
        assert time.monotonic() < end, "the view never answered a query over three namespaces"
        time.sleep(0.02)
    assert got == want


def test_a_kv_transfer_among_the_pools_is_answered_from_the_kv_pages(rig):
    rig.store(PoolName.KV, [1, 2, 3, 5, 6])
    got = rig.backend.batch_exists_v2(rig.keys, [PoolTransfer(PoolName.KV, keys=rig.keys,
                                                              hit_policy=ALL)])
    assert got == result(3, {PoolName.KV: 3}, [1, 2, 3])


def test_kv_pages_behind_a_missing_one_are_counted_as_orphans_once(rig):
    rig.store(PoolName.KV, [1, 3, 4, 6])                   # p2 and p5 missing: p3, p4, p6 orphaned
    assert rig.query().kv_hit_pages == 1
    assert rig.backend.orphans.total == 3
    rig.query()                                             # the same lookup again: no recount
    assert rig.backend.orphans.total == 3
