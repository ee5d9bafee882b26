"""Side pools in ``layer_first`` layout: one object per part, as the KV pool stores its pages,
not one per layer chunk; gathered through the backend's one staging buffer."""
from __future__ import annotations

import pytest
import torch
from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer

from pools import (fill_random, logical_anchor, make_hybrid_backend, mha_host, page_bytes,
                   page_hashes, shuffled_slots, slots, swa_host, v4_paged_host)

POOLS = {   # name -> (pool, objects a page is stored as: K and V, or the one part)
    "swa-36-layers": lambda: (PoolName.SWA, swa_host("layer_first", layers=36, heads=1,
                                                     head_dim=8), 2),
    "deepseek_v4-layer_first": lambda: (PoolName.DEEPSEEK_V4_C128,
                                        v4_paged_host("deepseek_v4_c128", "layer_first",
                                                      layers=6, item_bytes=128, pages=16), 1),
}


def anchor_for(pool):
    """The KV pool the side pool hangs off; DeepSeek-V4 pools share a logical anchor's slots."""
    if hasattr(pool, "slot_page_size"):
        return logical_anchor(page_size=pool.slot_page_size, tokens=pool.num_host_pages *
                              pool.slot_page_size)
    return mha_host("page_first")


def round_trip(backend, name, pool, pages: int, seed: int) -> list[str]:
    """Store ``pages`` pages of ``pool`` and load them into other, poisoned slots: byte for
    byte. Returns their page hashes."""
    at = backend.mem_pool_host if hasattr(pool, "slot_page_size") else pool
    keys = page_hashes(pages, at.page_size)
    src, dst = shuffled_slots(at, pages, seed), shuffled_slots(at, pages, seed + 1)
    fill_random(pool, src, seed)
    fill_random(pool, dst, seed + 2)
    want = page_bytes(pool, src)
    assert backend.batch_set_v2([PoolTransfer(name, host_indices=src, keys=keys)]) == \
        {name: [True] * pages}
    fill_random(pool, src, seed + 3)                  # no lazy reads of host memory
    assert backend.batch_get_v2([PoolTransfer(name, host_indices=dst, keys=keys)]) == \
        {name: [True] * pages}
    for w, g in zip(want, page_bytes(pool, dst)):
        assert torch.equal(w, g)
    return keys


@pytest.mark.parametrize("case", list(POOLS))
def test_a_layer_first_page_is_one_object_per_part(shared_store, case):
    name, pool, parts = POOLS[case]()
    backend = make_hybrid_backend(shared_store.master, anchor_for(pool), {name: pool})
    side = backend.side_pools[str(name)]
    assert len(side.geo.parts) == parts and side.stager is not None
    round_trip(backend, name, pool, 3, seed=1)
    assert backend.client.clear(prefix=f"{side.namespace}/") == 3 * parts
    backend.close()


def test_staged_side_pool_in_several_rounds_beside_staged_kv(shared_store, monkeypatch):
    import hicache_mc.sglang.staging as staging
    monkeypatch.setattr(staging, "STAGING_BYTES", 1)        # one page per round
    kv, swa = mha_host("layer_first"), swa_host("layer_first", layers=4)
    backend = make_hybrid_backend(shared_store.master, kv, {PoolName.SWA: swa})
    keys = round_trip(backend, PoolName.SWA, swa, 5, seed=11)
    src, dst = slots(kv, 5), slots(kv, 5)
    fill_random(kv, src, seed=12)
    assert backend.batch_set_v1(keys, src) == [True] * 5
    assert backend.batch_get_v1(keys, dst) == [True] * 5
    assert all(torch.equal(a, b) for a, b in zip(page_bytes(kv, dst), page_bytes(kv, src)))
    backend.close()


def test_a_pointer_outside_the_pool_is_refused_not_copied(shared_store):
    name, pool, _ = POOLS["swa-36-layers"]()
    backend = make_hybrid_backend(shared_store.master, mha_host("page_first"), {name: pool})
    side = backend.side_pools[str(name)]
    ptrs, _ = pool.get_page_buffer_meta(slots(pool, 1))
    outside = list(ptrs)
    outside[-1] = pool.kv_buffer.data_ptr() + pool.kv_buffer.numel() * pool.kv_buffer.element_size()
    with pytest.raises(ValueError, match="outside"):
        side.stager.put(side.keys(page_hashes(1, pool.page_size)), outside,
                        backend.client.batch_put_from)
    backend.close()
