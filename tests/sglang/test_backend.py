"""HiCacheMC under SGLang's real factory and host pools, against a real store."""
from __future__ import annotations

import pytest
import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

from hicache_mc.errors import ConfigError
from hicache_mc.sglang import HiCacheMC
from pools import (MHA_LAYOUTS, MLA_LAYOUTS, fill_random, make_backend, mha_host, mla_host,
                   page_bytes, page_hashes, slots, storage_config)

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn]


def _host(kind, layout, dtype=torch.bfloat16, page_size=16, **kw):
    return (mla_host if kind == "mla" else mha_host)(layout, dtype, page_size, **kw)


def test_factory_loads_hicache_mc(shared_store):
    pool = mha_host("page_first")
    backend = make_backend(pool, shared_store.master)
    assert type(backend) is HiCacheMC and isinstance(backend, HiCacheStorage)
    backend.close()


@pytest.mark.parametrize("extra, name", [({"mastr": "tcp://x:1"}, "mastr"),
                                         ({"timeout_s": "soon"}, "timeout_s"),
                                         ({"transport": "carrier-pigeon"}, "transport"),
                                         ({"tenant": "a b/c"}, "tenant")])
def test_bad_settings_fail_start_naming_the_key(shared_store, extra, name):
    cfg = storage_config(shared_store.master, **extra)
    with pytest.raises(ConfigError, match=name):
        StorageBackendFactory.create_backend("dynamic", cfg, None)


def test_hicache_and_factory_keys_are_ignored(shared_store):
    cfg = storage_config(shared_store.master, prefetch_threshold=256, tp_lcm_size=2,
                         tenant="t1", kv_cache_dtype="auto")
    backend = StorageBackendFactory.create_backend("dynamic", cfg, None)
    assert backend.settings.tenant == "t1" and backend.client_config.timeout_s == 2.0
    backend.close()


CASES = [("mha", lay, dt, ps) for lay in MHA_LAYOUTS for dt in DTYPES for ps in (4, 64)] + \
        [("mla", lay, dt, ps) for lay in MLA_LAYOUTS for dt in DTYPES for ps in (4, 64)]


@pytest.mark.parametrize("kind, layout, dtype, page_size", CASES,
                         ids=[f"{k}-{l}-{str(d)[6:]}-ps{p}" for k, l, d, p in CASES])
def test_set_v1_then_get_v1_into_other_slots(shared_store, kind, layout, dtype, page_size):
    pool = _host(kind, layout, dtype, page_size, tokens=4 * page_size)
    backend = make_backend(pool, shared_store.master, mla=kind == "mla")
    keys = page_hashes(3, page_size)
    src, dst = slots(pool, 3), slots(pool, 3)
    fill_random(pool, src, seed=1)
    fill_random(pool, dst, seed=2)          # poison: a page not written stays wrong
    want = page_bytes(pool, src)

    assert backend.batch_exists(keys) == 0
    assert backend.batch_set_v1(keys, src) == [True, True, True]
    assert backend.batch_exists(keys) == 3
    fill_random(pool, src, seed=3)          # the store must not read host memory lazily
    assert backend.batch_get_v1(keys, dst) == [True, True, True]
    got = page_bytes(pool, dst)
    for w, g in zip(want, got):
        assert torch.equal(w, g)
    backend.close()


def test_exists_counts_the_leading_run(shared_store):
    pool = mha_host("page_first")
    backend = make_backend(pool, shared_store.master)
    keys = page_hashes(4, pool.page_size)
    idx = slots(pool, 4)
    fill_random(pool, idx, seed=4)
    per = pool.page_size
    assert backend.batch_set_v1(keys[:2], idx[:2 * per]) == [True, True]
    assert backend.batch_set_v1(keys[3:], idx[3 * per:]) == [True]
    assert backend.batch_exists(keys) == 2                  # hit, hit, miss, hit
    assert backend.exists(keys[3]) and not backend.exists(keys[2])
    got = backend.batch_get_v1(keys, idx)
    assert got[:3] == [True, True, False]   # SGLang uses the leading run; the store's Locate stops at a miss
    backend.close()


def test_unsupported_layout_is_refused_at_start(shared_store):
    pool = mha_host("page_unified")
    with pytest.raises(ValueError, match="page_unified"):
        make_backend(pool, shared_store.master)


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_set_v1_counts_stored_pages_and_never_rewrites(shared_store, layout):
    pool = mha_host(layout)
    backend = make_backend(pool, shared_store.master)
    keys = page_hashes(3, pool.page_size)
    idx, dst = slots(pool, 3), slots(pool, 3)
    fill_random(pool, idx, seed=5)
    want = page_bytes(pool, idx)
    assert backend.batch_set_v1(keys[:2], idx[:2 * pool.page_size]) == [True, True]
    fill_random(pool, idx, seed=6)                          # same keys, other bytes
    before = backend.client.counters["put_keys"]
    assert backend.batch_set_v1(keys, idx) == [True, True, True]
    if layout == "layer_first":                             # staged: the stored run is not even sent
        assert backend.client.counters["put_keys"] - before == 2
    assert backend.batch_get_v1(keys[:2], dst[:2 * pool.page_size]) == [True, True]
    for w, g in zip(want[:2], page_bytes(pool, dst[:2 * pool.page_size])):
        assert torch.equal(w, g)
    backend.close()


def test_layer_first_staging_in_several_rounds(shared_store, monkeypatch):
    import hicache_mc.sglang.staging as staging
    monkeypatch.setattr(staging, "STAGING_BYTES", 1)        # one page per round
    for kind in ("mha", "mla"):
        pool = _host(kind, "layer_first")
        backend = make_backend(pool, shared_store.master, mla=kind == "mla")
        assert backend._stager._pages_per_round == 1
        keys = page_hashes(5, pool.page_size)
        src, dst = slots(pool, 5), slots(pool, 5)
        fill_random(pool, src, seed=7)
        fill_random(pool, dst, seed=8)
        assert backend.batch_set_v1(keys, src) == [True] * 5
        assert backend.batch_get_v1(keys, dst) == [True] * 5
        for w, g in zip(page_bytes(pool, src), page_bytes(pool, dst)):
            assert torch.equal(w, g)
        backend.close()


@pytest.mark.parametrize("kind, layout", [("mha", l) for l in MHA_LAYOUTS] + [("mla", "page_first")])
def test_flat_page_api_shares_objects_with_v1(shared_store, kind, layout):
    pool = _host(kind, layout)
    backend = make_backend(pool, shared_store.master, mla=kind == "mla")
    keys = page_hashes(3, pool.page_size)
    src, dst = slots(pool, 3), slots(pool, 3)
    fill_random(pool, src, seed=9)
    fill_random(pool, dst, seed=10)
    want = page_bytes(pool, src)
    flat = [pool.get_data_page(s, flat=True) for s in src[::pool.page_size].tolist()]
    assert backend.batch_set(keys[:2], flat[:2]) is True
    assert backend.set(keys[2], flat[2]) is True
    assert backend.exists(keys[2]) and backend.batch_exists(keys) == 3
    assert backend.batch_get_v1(keys, dst) == [True] * 3    # written flat, read zero-copy
    for w, g in zip(want, page_bytes(pool, dst)):
        assert torch.equal(w, g)
    got = backend.batch_get(keys + page_hashes(1, pool.page_size),
                            [pool.get_dummy_flat_data_page() for _ in range(4)])
    assert got[3] is None
    for w, g in zip(want, got[:3]):
        assert torch.equal(w, g.view(torch.uint8))
    one = backend.get(keys[1], pool.get_dummy_flat_data_page())
    assert torch.equal(want[1], one.view(torch.uint8))
    backend.close()


def test_namespaces_keep_deployments_apart(shared_store):
    keys = page_hashes(2, 16)

    def stored(pool, **kw):
        backend = make_backend(pool, shared_store.master, **kw)
        try:
            return backend, backend.batch_exists(keys)
        finally:
            backend.close()

    pool = mha_host("page_first")
    writer = make_backend(pool, shared_store.master)
    idx = slots(pool, 2)
    fill_random(pool, idx, seed=11)
    assert writer.batch_set_v1(keys, idx) == [True, True]
    writer.close()
    assert stored(mha_host("page_first"))[1] == 2                     # same deployment: shared
    assert stored(mha_host("page_first", torch.float16))[1] == 0      # dtype
    assert stored(mha_host("page_first_direct"))[1] == 0              # layout, same page size
    assert stored(mha_host("page_first"), model="other/model")[1] == 0
    assert stored(mha_host("page_first"), tenant="blue")[1] == 0
    assert stored(mha_host("page_first"), tp_rank=1, tp_size=2)[1] == 0


def test_mla_pages_are_shared_by_tp_ranks_and_written_once(shared_store):
    keys = page_hashes(3, 16)
    rank0_pool, rank1_pool = mla_host("page_first"), mla_host("page_first")
    rank0 = make_backend(rank0_pool, shared_store.master, mla=True, tp_rank=0, tp_size=2)
    rank1 = make_backend(rank1_pool, shared_store.master, mla=True, tp_rank=1, tp_size=2)
    idx0, idx1 = slots(rank0_pool, 3), slots(rank1_pool, 3)
    fill_random(rank0_pool, idx0, seed=12)
    fill_random(rank1_pool, idx1, seed=13)
    assert not rank1.is_writer and rank1.batch_set_v1(keys, idx1) == [True] * 3
    assert rank1.batch_exists(keys) == 0                    # the non-writer stored nothing
    assert rank0.batch_set_v1(keys, idx0) == [True] * 3
    assert rank1.batch_get_v1(keys, idx1) == [True] * 3
    for w, g in zip(page_bytes(rank0_pool, idx0), page_bytes(rank1_pool, idx1)):
        assert torch.equal(w, g)
    rank0.close()
    rank1.close()


def test_clear_removes_only_its_own_namespace(shared_store):
    keys = page_hashes(2, 16)
    backends = []
    for tenant in ("red", "green"):
        pool = mha_host("page_first")
        b = make_backend(pool, shared_store.master, tenant=tenant)
        idx = slots(pool, 2)
        fill_random(pool, idx, seed=14)
        assert b.batch_set_v1(keys, idx) == [True, True]
        backends.append(b)
    backends[0].clear()
    assert backends[0].batch_exists(keys) == 0
    assert backends[1].batch_exists(keys) == 2
    for b in backends:
        b.close()


def test_get_stats_reports_batches_then_starts_afresh(shared_store):
    from sglang.srt.observability.metrics_collector import StorageMetrics
    pool = mha_host("page_first")
    backend = make_backend(pool, shared_store.master)
    keys = page_hashes(3, pool.page_size)
    idx = slots(pool, 3)
    fill_random(pool, idx, seed=15)
    backend.batch_set_v1(keys, idx)
    backend.batch_get_v1(keys, idx)
    stats = backend.get_stats()
    assert isinstance(stats, StorageMetrics)
    assert stats.backup_pgs == [3] and stats.prefetch_pgs == [3]
    assert stats.backup_bandwidth[0] > 0 and stats.prefetch_bandwidth[0] > 0
    again = backend.get_stats()
    assert again.backup_pgs == [] and again.prefetch_bandwidth == []
    backend.close()


def test_bad_calls_answer_misses_instead_of_raising(shared_store):
    pool = mha_host("page_first")
    backend = make_backend(pool, shared_store.master)
    keys = page_hashes(2, pool.page_size)
    short = slots(pool, 1)                                  # one page of slots for two keys
    assert backend.batch_set_v1(keys, short) == [False, False]
    assert backend.batch_get_v1(keys, short) == [False, False]
    assert backend.batch_set(keys, [torch.zeros(3), torch.zeros(3)]) is False
    assert backend.batch_get(keys, [torch.zeros(3), torch.zeros(3)]) == [None, None]
    backend.close()
    assert backend.batch_exists(keys) == 0                  # closed client: still no exception
    assert backend.batch_get_v1(keys, slots(pool, 2)) == [False, False]


def test_the_backend_answers_probes_from_its_residency_view(shared_store):
    """On by default: once the view of the backend's namespace is in sync, batch_exists is
    answered locally (and still right); view = off asks the master every time."""
    import time
    pool = mha_host("page_first")
    backend = make_backend(pool, shared_store.master)
    view = backend.client.view
    assert view is not None
    keys = page_hashes(3, pool.page_size)
    idx = slots(pool, 3)
    fill_random(pool, idx, seed=9)
    per = pool.page_size
    assert backend.batch_set_v1(keys[:2], idx[:2 * per]) == [True, True]
    # in sync, and past this rank's own writes (its fence): then the view answers the probe
    end = time.monotonic() + 10
    while True:
        answers = view.counters["view_answers"]
        found = backend.batch_exists(keys)
        if view.counters["view_answers"] == answers + 1:
            break
        assert found == 2                   # (the master answered meanwhile)
        assert time.monotonic() < end, "the backend's view never answered"
        time.sleep(0.02)
    assert found == 2
    assert backend.batch_get_v1(keys[:2], idx[:2 * per]) == [True, True]
    backend.close()
    off = make_backend(mha_host("page_first"), shared_store.master, view="off")
    assert off.client.view is None
    assert off.batch_exists(keys) == 2
    off.close()


def test_backups_name_their_chain_and_hot_pages_get_copies(tmp_path):
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo

    from hicache_mc import protocol as P
    from hicache_mc.keys import batch_page_keys
    from procs import Cluster, request
    c = Cluster(tmp_path)
    c.start_master()
    for n in (1, 2):
        c.add_node(dram="64MiB")
        c.wait_nodes(n)
    try:
        pool = mha_host("page_first")
        backend = make_backend(pool, c.master, replicas=2, hot_pages=1)
        hashes, src = page_hashes(8, pool.page_size), slots(pool, 8)
        fill_random(pool, src, seed=5)
        per = pool.page_size * 4
        # SGLang backs a chain up in calls, each with the page hashes before it (prefix_keys)
        assert backend.batch_set_v1(hashes[:4], src[:per], HiCacheStorageExtraInfo([])) == [True] * 4
        assert backend.batch_set_v1(hashes[4:], src[per:], HiCacheStorageExtraInfo(hashes[:4])) == [True] * 4
        keys = batch_page_keys(backend.spaces[0], hashes, backend.geometry.parts)
        where = [e[0] for e in request(c.master, P.LocateRequest(keys)).located()]
        assert len(set(where)) == 1, where          # the whole chain on one node
        stats = request(c.master, P.StatsRequest()).stats
        assert stats["copies_placed"] == 2          # the first page's K and V, on the other node
        c.wait_objects(len(keys) + 2)
        backend.close()
    finally:
        c.stop()
