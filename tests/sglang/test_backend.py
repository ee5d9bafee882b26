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
                                         ({"transport": "carrier-pigeon"}, "transport")])
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
