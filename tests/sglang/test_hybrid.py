"""HiCacheMC's v2 API (hybrid models) with SGLang's real host pools on CPU and a real store."""
from __future__ import annotations

import pytest
import torch
from sglang.srt.mem_cache.hicache_storage import (PoolHitPolicy, PoolName, PoolTransfer,
                                                  PoolTransferResult)

from controllers import clear_layout, single_rank_layout
from pools import (dsa_pools, fill_random, logical_anchor, make_hybrid_backend, mamba_host,
                   mha_host, mla_host, page_bytes, page_hashes, shuffled_slots, slots, swa_host,
                   v4_paged_host)

TRAIL, ALL, GROUPS = (PoolHitPolicy.TRAILING_PAGES, PoolHitPolicy.ALL_PAGES,
                      PoolHitPolicy.BLOCK_GROUPS)


class Calls:
    """Counts the store calls a backend makes (one per batch is the contract)."""

    def __init__(self, backend):
        self.n: dict[str, int] = {}
        for name in ("batch_put_from", "batch_get_into", "batch_contains", "batch_exists"):
            setattr(backend.client, name, self._wrap(name, getattr(backend.client, name)))

    def _wrap(self, name, fn):
        def call(*a, **kw):
            self.n[name] = self.n.get(name, 0) + 1
            return fn(*a, **kw)
        return call


def _same_pages(pool, want, dst):
    got = page_bytes(pool, dst)
    assert len(got) == len(want)
    for w, g in zip(want, got):
        assert torch.equal(w, g)


# ------------------------------------------------------------------ round trips

SIDE_POOLS = {
    "mamba-page_first": lambda: (PoolName.MAMBA, mamba_host(layout="page_first")),
    "mamba-page_first_direct": lambda: (PoolName.MAMBA, mamba_host(layout="page_first_direct")),
    "mamba-conv_only": lambda: (PoolName.MAMBA, mamba_host(temporal_shape=(0,))),
    "mamba-side_state(flat)": lambda: (PoolName.MAMBA, mamba_host(extra_state=True)),
    "swa-mha-page_first": lambda: (PoolName.SWA, swa_host("page_first")),
    "swa-mha-layer_first": lambda: (PoolName.SWA, swa_host("layer_first")),
    "swa-mha-page_head": lambda: (PoolName.SWA, swa_host("page_head")),
    "draft_swa-mha": lambda: (PoolName.DRAFT_SWA, swa_host("page_first_direct", layers=1)),
    "draft-mla": lambda: (PoolName.DRAFT, mla_host("page_first", layers=1)),
}


@pytest.mark.parametrize("case", list(SIDE_POOLS))
def test_side_pool_round_trip_into_shuffled_poisoned_slots(shared_store, case):
    name, pool = SIDE_POOLS[case]()
    kv = mha_host("page_first")
    backend = make_hybrid_backend(shared_store.master, kv, {name: pool})
    side = backend.side_pools[str(name)]
    assert side.geo.zero_copy == ("flat" not in case)
    keys = page_hashes(3, kv.page_size)
    src, dst = shuffled_slots(pool, 3, seed=1), shuffled_slots(pool, 3, seed=2)
    fill_random(pool, src, seed=3)
    fill_random(pool, dst, seed=4)                          # poison
    want = page_bytes(pool, src)
    put = backend.batch_set_v2([PoolTransfer(name, host_indices=src, keys=keys)])
    assert put == {name: [True] * 3}
    fill_random(pool, src, seed=5)                          # no lazy reads of host memory
    got = backend.batch_get_v2([PoolTransfer(name, host_indices=dst, keys=keys)])
    assert got == {name: [True] * 3}
    _same_pages(pool, want, dst)
    backend.close()


@pytest.fixture
def parallel_layout():
    single_rank_layout()
    yield
    clear_layout()


def test_dsa_indexer_round_trip_and_all_pages_hits(shared_store, parallel_layout):
    anchor, indexer = dsa_pools()
    backend = make_hybrid_backend(shared_store.master, anchor, {PoolName.INDEXER: indexer},
                                  mla=True)
    side = backend.side_pools["indexer"]
    assert side.geo.zero_copy and side.shared_by_tp
    keys = page_hashes(3, anchor.page_size)
    kv_idx, src, dst = slots(anchor, 3), shuffled_slots(indexer, 3, 1), shuffled_slots(indexer, 3, 2)
    fill_random(anchor, kv_idx, 1)
    fill_random(indexer, src, 2)
    fill_random(indexer, dst, 3)
    want = page_bytes(indexer, src)
    assert backend.batch_set_v1(keys, kv_idx) == [True] * 3
    # Pages 1 and 3 of the indexer only: all_pages stops at page 1.
    sel = torch.cat([src[:anchor.page_size], src[2 * anchor.page_size:]])
    assert backend.batch_set_v2([PoolTransfer(PoolName.INDEXER, host_indices=sel,
                                              keys=[keys[0], keys[2]])]) == \
        {PoolName.INDEXER: [True, True]}
    q = [PoolTransfer(PoolName.INDEXER, keys=keys, hit_policy=ALL)]
    assert backend.batch_exists_v2(keys, q) == PoolTransferResult(
        1, {PoolName.KV: 3, PoolName.INDEXER: 1}, [1])
    assert backend.batch_get_v2([PoolTransfer(PoolName.INDEXER, host_indices=dst, keys=keys)]) == \
        {PoolName.INDEXER: [True, False, True]}
    got = page_bytes(indexer, dst)
    assert torch.equal(got[0], want[0]) and torch.equal(got[2], want[2])
    backend.close()


def test_deepseek_v4_pools_under_a_logical_anchor(shared_store):
    c4 = v4_paged_host("deepseek_v4_c4", "page_first")
    c128 = v4_paged_host("deepseek_v4_c128", "layer_first", item_bytes=128)
    anchor = logical_anchor(page_size=64, tokens=512)
    backend = make_hybrid_backend(shared_store.master, anchor, {PoolName.DEEPSEEK_V4_C4: c4,
                                                                PoolName.DEEPSEEK_V4_C128: c128},
                                  mla=True)
    assert backend.logical_anchor
    assert len(backend.side_pools["deepseek_v4_c128"].geo.parts) == 1   # its layers: one object
    keys = page_hashes(3, 64)
    src, dst = shuffled_slots(anchor, 3, 1), shuffled_slots(anchor, 3, 2)   # V4 pools share
    for pool in (c4, c128):                                                 # the anchor's slots
        fill_random(pool, src, 3)
        fill_random(pool, dst, 4)
    want = {n: page_bytes(p, src) for n, p in ((PoolName.DEEPSEEK_V4_C4, c4),
                                                (PoolName.DEEPSEEK_V4_C128, c128))}
    both = lambda idx, ks: [PoolTransfer(n, host_indices=idx, keys=ks) for n in want]  # noqa: E731
    assert backend.batch_set_v1(keys, src) == [True] * 3                    # no bytes, no I/O
    assert backend.batch_set_v2(both(src[:2 * 64], keys[:2])) == {n: [True, True] for n in want}
    q = [PoolTransfer(n, keys=keys, hit_policy=ALL) for n in want]
    assert backend.batch_exists_v2(keys, q) == PoolTransferResult(
        2, {PoolName.KV: 3, PoolName.DEEPSEEK_V4_C4: 2, PoolName.DEEPSEEK_V4_C128: 2}, [1, 2])
    assert backend.batch_get_v2(both(dst, keys)) == {n: [True, True, False] for n in want}
    for n, pool in ((PoolName.DEEPSEEK_V4_C4, c4), (PoolName.DEEPSEEK_V4_C128, c128)):
        got = page_bytes(pool, dst)
        assert torch.equal(got[0], want[n][0]) and torch.equal(got[1], want[n][1])
    backend.close()


def test_all_pools_of_a_batch_move_in_one_store_call(shared_store):
    kv, mamba, swa = mha_host("page_first"), mamba_host(), swa_host("page_first")
    backend = make_hybrid_backend(shared_store.master, kv, {PoolName.MAMBA: mamba,
                                                            PoolName.SWA: swa})
    calls = Calls(backend)
    keys = page_hashes(4, kv.page_size)
    m_src, s_src = shuffled_slots(mamba, 2, 1), shuffled_slots(swa, 3, 2)
    m_dst, s_dst = shuffled_slots(mamba, 2, 3), shuffled_slots(swa, 3, 4)
    for pool, idx, seed in ((mamba, m_src, 5), (swa, s_src, 6), (mamba, m_dst, 7), (swa, s_dst, 8)):
        fill_random(pool, idx, seed)
    want_m, want_s = page_bytes(mamba, m_src), page_bytes(swa, s_src)
    transfers = [PoolTransfer(PoolName.MAMBA, host_indices=m_src, keys=[keys[1], keys[3]]),
                 PoolTransfer(PoolName.SWA, host_indices=s_src, keys=keys[1:])]
    assert backend.batch_set_v2(transfers) == {PoolName.MAMBA: [True, True],
                                               PoolName.SWA: [True, True, True]}
    assert calls.n == {"batch_put_from": 1}
    got = backend.batch_get_v2([PoolTransfer(PoolName.MAMBA, host_indices=m_dst, keys=[keys[1], keys[3]]),
                                PoolTransfer(PoolName.SWA, host_indices=s_dst, keys=keys[1:])])
    assert got == {PoolName.MAMBA: [True, True], PoolName.SWA: [True, True, True]}
    assert calls.n == {"batch_put_from": 1, "batch_get_into": 1}
    _same_pages(mamba, want_m, m_dst)
    _same_pages(swa, want_s, s_dst)
    backend.close()


def test_get_v2_reports_missing_pages_per_pool(shared_store):
    kv, mamba = mha_host("page_first"), mamba_host()
    backend = make_hybrid_backend(shared_store.master, kv, {PoolName.MAMBA: mamba})
    keys = page_hashes(3, kv.page_size)
    idx = shuffled_slots(mamba, 3)
    fill_random(mamba, idx, 1)
    assert backend.batch_set_v2([PoolTransfer(PoolName.MAMBA, host_indices=idx[1:2],
                                              keys=keys[1:2])]) == {PoolName.MAMBA: [True]}
    got = backend.batch_get_v2([PoolTransfer(PoolName.MAMBA, host_indices=idx, keys=keys)])
    assert got == {PoolName.MAMBA: [False, True, False]}
    backend.close()


# ------------------------------------------------------------------ namespaces

def test_pools_never_share_keys_and_another_shape_is_a_miss(shared_store):
    keys = page_hashes(2, 16)
    kv = mha_host("page_first")
    swa = mha_host("page_first")                            # same shape as the KV pool
    mamba = mamba_host()
    backend = make_hybrid_backend(shared_store.master, kv, {PoolName.SWA: swa,
                                                            PoolName.MAMBA: mamba})
    idx = slots(kv, 2)
    fill_random(kv, idx, 1)
    assert backend.batch_set_v1(keys, idx) == [True, True]
    trail = [PoolTransfer(PoolName.SWA, keys=keys, hit_policy=TRAIL)]
    assert backend.batch_exists_v2(keys, trail).kv_hit_pages == 0     # KV bytes are not SWA's
    m_idx = slots(mamba, 1)
    assert backend.batch_set_v2([PoolTransfer(PoolName.MAMBA, host_indices=m_idx,
                                              keys=keys[1:])])[PoolName.MAMBA] == [True]
    mamba_q = [PoolTransfer(PoolName.MAMBA, keys=keys[1:], hit_policy=TRAIL)]
    assert backend.batch_exists_v2(keys, mamba_q).restorable_prefix_pages == [2]
    backend.close()

    def restorable(**mamba_kw):
        other = make_hybrid_backend(shared_store.master, mha_host("page_first"),
                                    {PoolName.MAMBA: mamba_host(**mamba_kw)})
        try:
            return other.batch_exists_v2(keys, mamba_q).restorable_prefix_pages
        finally:
            other.close()

    assert restorable() == [2]                                        # same deployment
    assert restorable(conv_shapes=((8, 4), (4, 3))) == []             # other conv state shape
    assert restorable(layers=3) == []                                 # other layer count
    assert restorable(temporal_dtype=torch.bfloat16) == []            # other SSM dtype

    def namespace(temporal_dtype):
        b = make_hybrid_backend(shared_store.master, mha_host("page_first"),
                                {PoolName.MAMBA: mamba_host(temporal_dtype=temporal_dtype)})
        b.close()
        return b.side_pools["mamba"].namespace
    # an SSM state of another dtype of the same size: same bytes per page, other meaning
    assert namespace(torch.bfloat16) != namespace(torch.float16)


def test_mla_side_pools_are_written_once_mamba_per_rank(shared_store):
    keys = page_hashes(2, 16)
    ranks = []
    for rank in (0, 1):
        kv, draft, mamba = mla_host("page_first"), mla_host("page_first", layers=1), mamba_host()
        b = make_hybrid_backend(shared_store.master, kv, {PoolName.DRAFT: draft,
                                                          PoolName.MAMBA: mamba},
                                mla=True, tp_rank=rank, tp_size=2)
        ranks.append((b, draft, mamba))
    (b0, d0, m0), (b1, d1, m1) = ranks
    d_idx, m_idx = slots(d1, 2), slots(m1, 1)
    fill_random(d1, d_idx, 1)
    put = b1.batch_set_v2([PoolTransfer(PoolName.DRAFT, host_indices=d_idx, keys=keys),
                           PoolTransfer(PoolName.MAMBA, host_indices=m_idx, keys=keys[1:])])
    assert put == {PoolName.DRAFT: [True, True], PoolName.MAMBA: [True]}
    q = [PoolTransfer(PoolName.DRAFT, keys=keys, hit_policy=ALL)]
    assert b0.batch_exists_v2(keys, q).extra_pool_hit_pages.get(PoolName.DRAFT) is None  # rank 1 is no writer
    d_idx0 = slots(d0, 2)
    fill_random(d0, d_idx0, 2)
    assert b0.batch_set_v2([PoolTransfer(PoolName.DRAFT, host_indices=d_idx0, keys=keys)]) == \
        {PoolName.DRAFT: [True, True]}
    assert b1.batch_get_v2([PoolTransfer(PoolName.DRAFT, host_indices=d_idx, keys=keys)]) == \
        {PoolName.DRAFT: [True, True]}                      # rank 1 reads rank 0's copy
    _same_pages(d1, page_bytes(d0, d_idx0), d_idx)
    # Mamba state is TP-sharded (each rank its own keys); the MLA-replicated pools are shared.
    assert b0.side_pools["mamba"].namespace != b1.side_pools["mamba"].namespace
    assert b0.side_pools["draft"].namespace == b1.side_pools["draft"].namespace
    for b, _, _ in ranks:
        b.close()


def test_mha_draft_over_an_mla_target_is_per_rank(shared_store):
    # EAGLE-MHA draft on an MLA model: the draft pool holds each rank's own heads.
    keys = page_hashes(1, 16)
    ranks = []
    for rank in (0, 1):
        draft = mha_host("page_first", layers=1)
        b = make_hybrid_backend(shared_store.master, mla_host("page_first"),
                                {PoolName.DRAFT: draft}, mla=True, tp_rank=rank, tp_size=2)
        ranks.append((b, draft))
    (b0, d0), (b1, d1) = ranks
    assert not b0.side_pools["draft"].shared_by_tp
    assert b0.side_pools["draft"].namespace != b1.side_pools["draft"].namespace
    idx = slots(d1, 1)
    assert b1.batch_set_v2([PoolTransfer(PoolName.DRAFT, host_indices=idx, keys=keys)]) == \
        {PoolName.DRAFT: [True]}
    assert all(b1.client.batch_contains(b1.side_pools["draft"].keys(keys)))   # rank 1 wrote
    assert b0.batch_get_v2([PoolTransfer(PoolName.DRAFT, host_indices=slots(d0, 1), keys=keys)]) \
        == {PoolName.DRAFT: [False]}                        # and rank 0 never reads it
    for b, _ in ranks:
        b.close()


def test_sglang_backs_up_per_rank_pools_on_every_rank(shared_store, parallel_layout):
    """SGLang's HybridCacheController backs side pools of an MLA model up on the writer rank
    only; the plugin's should_backup hook makes every rank back up the pools HiCacheMC keys per
    rank (an MHA draft), else ranks > 0 never hit that pool and SGLang's min over ranks is 0."""
    from types import SimpleNamespace

    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController

    from hicache_mc.sglang.plugin import _backup_per_rank
    anchor, indexer = dsa_pools()
    pools = {PoolName.DRAFT: mha_host("page_first", layers=1), PoolName.INDEXER: indexer}
    backend = make_hybrid_backend(shared_store.master, anchor, pools, mla=True, tp_rank=1,
                                  tp_size=2)
    rank1 = SimpleNamespace(storage_backend=backend, backup_skip=True,
                            storage_backend_type="hicache_mc")
    original = HybridCacheController.should_backup
    draft, shared = PoolTransfer(PoolName.DRAFT, keys=["a"]), PoolTransfer(PoolName.INDEXER, keys=["a"])
    assert not original(rank1, draft)                       # SGLang alone: the writer only
    assert _backup_per_rank(original, rank1, draft)         # per-rank keys: every rank
    assert not _backup_per_rank(original, rank1, shared)    # one shared copy: the writer's
    backend.close()


# ------------------------------------------------------------------ robustness

def test_bad_v2_calls_answer_misses_instead_of_raising(shared_store):
    kv, mamba = mha_host("page_first"), mamba_host()
    backend = make_hybrid_backend(shared_store.master, kv, {PoolName.MAMBA: mamba})
    keys = page_hashes(2, 16)
    two = slots(mamba, 2)
    assert backend.batch_set_v2([PoolTransfer(PoolName.MAMBA, host_indices=two[:1], keys=keys),
                                 PoolTransfer(PoolName.SWA, host_indices=two, keys=keys)]) == \
        {PoolName.MAMBA: [False, False], PoolName.SWA: [False, False]}
    assert backend.batch_get_v2([PoolTransfer(PoolName.MAMBA, host_indices=None, keys=keys)]) == \
        {PoolName.MAMBA: [False, False]}
    mixed = backend.batch_set_v2([PoolTransfer(PoolName.MAMBA, host_indices=two, keys=keys),
                                  PoolTransfer(PoolName.SWA, host_indices=two, keys=keys)])
    assert mixed == {PoolName.MAMBA: [True, True], PoolName.SWA: [False, False]}
    assert backend.batch_set_v2([]) == {} and backend.batch_get_v2(None) == {}
    odd = PoolTransfer(PoolName.MAMBA, host_indices=two, keys=keys)
    odd.keys = 12345                                        # not a list: still no exception
    assert backend.batch_get_v2([odd]) == {PoolName.MAMBA: []}
    assert backend.batch_exists_v2([], []) == PoolTransferResult(0, {}, [])
    backend.close()                                         # closed client: still no exception
    assert backend.batch_get_v2([PoolTransfer(PoolName.MAMBA, host_indices=two, keys=keys)]) == \
        {PoolName.MAMBA: [False, False]}
    r = backend.batch_exists_v2(keys, [PoolTransfer(PoolName.MAMBA, keys=keys[1:], hit_policy=TRAIL)])
    assert r.kv_hit_pages == 0 and not r.restorable_prefix_pages


def test_a_pool_that_cannot_be_stored_is_refused_at_start(shared_store):
    class NoPages:
        page_size, layout = 1, "page_first"

    with pytest.raises(ValueError, match="NoPages"):
        make_hybrid_backend(shared_store.master, mha_host("page_first"), {PoolName.INDEXER: NoPages()})


def test_clear_removes_side_pool_objects_too(shared_store):
    kv, mamba = mha_host("page_first"), mamba_host()
    backend = make_hybrid_backend(shared_store.master, kv, {PoolName.MAMBA: mamba}, tenant="clr")
    keys = page_hashes(1, 16)
    assert backend.batch_set_v2([PoolTransfer(PoolName.MAMBA, host_indices=slots(mamba, 1),
                                              keys=keys)]) == {PoolName.MAMBA: [True]}
    q = [PoolTransfer(PoolName.MAMBA, keys=keys, hit_policy=TRAIL)]
    kv_idx = slots(kv, 1)
    assert backend.batch_set_v1(keys, kv_idx) == [True]
    assert backend.batch_exists_v2(keys, q).restorable_prefix_pages == [1]
    assert all(backend.client.batch_contains(backend.side_pools["mamba"].keys(keys)))
    backend.clear()
    assert not any(backend.client.batch_contains(backend.side_pools["mamba"].keys(keys)))
    backend.close()



def test_side_pool_pages_are_counted_apart_from_kv_pages(shared_store):
    from prometheus_client import REGISTRY
    kv, state = mha_host("page_first"), mamba_host(layout="page_first")
    backend = make_hybrid_backend(shared_store.master, kv, {PoolName.MAMBA: state})
    keys = page_hashes(3, kv.page_size)
    kv_src, src, dst = slots(kv, 3), slots(state, 1), shuffled_slots(state, 2, seed=2)
    fill_random(kv, kv_src, seed=3)
    fill_random(state, src, seed=1)
    exported = lambda op: REGISTRY.get_sample_value(           # noqa: E731
        "hicache_mc_sglang_pages_total", {"pool": "mamba", "op": op}) or 0
    before = exported("backup"), exported("prefetch")
    backend.get_stats()                                     # start afresh
    # a node of 3 KV pages with its trailing state, as SGLang backs it up
    assert backend.batch_set_v2([PoolTransfer(PoolName.KV, host_indices=kv_src, keys=keys),
                                 PoolTransfer(PoolName.MAMBA, host_indices=src, keys=keys[-1:])]) \
        == {PoolName.KV: [True] * 3, PoolName.MAMBA: [True]}
    assert backend.batch_get_v2([PoolTransfer(PoolName.MAMBA, host_indices=dst,
                                              keys=keys[-1:] + ["absent"])]) == \
        {PoolName.MAMBA: [True, False]}
    stats = backend.get_stats()                             # SGLang's: KV pages only
    assert stats.backup_pgs == [3] and stats.prefetch_pgs == []
    assert len(stats.backup_bandwidth) == 1 and stats.backup_bandwidth[0] > 0
    traffic = backend.traffic()
    page = backend.side_pools["mamba"].geo.page_bytes
    assert (traffic["mamba"].backup_pages, traffic["mamba"].backup_bytes) == (1, page)
    assert (traffic["mamba"].prefetch_pages, traffic["kv"].backup_pages) == (1, 3)
    assert (exported("backup") - before[0], exported("prefetch") - before[1]) == (1, 1)
    backend.close()
