"""HiCacheMC under SGLang's own HybridCacheController with KV + Mamba state (Qwen3-Next shaped,
scaled down), on CPU, against a real store. The test plays the scheduler (and its Mamba
component): it backs up nodes with their trailing state, submits prefetches with the Mamba
placeholder transfer, allocates the host slots once the hit is known, and reads the acks.
"""
from __future__ import annotations

import itertools
from array import array

import pytest
import torch
from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle
from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.utils import get_hash_str

from controllers import ACK_TIMEOUT_S, ControllerRig, clear_layout, single_rank_layout
from pools import fill_random, mamba_host, page_bytes

PS = 16
_salt = itertools.count(7001)


@pytest.fixture(scope="module", autouse=True)
def parallel_layout():
    single_rank_layout()
    yield
    clear_layout()


@pytest.fixture
def rig(shared_store):
    mamba = mamba_host(layers=3)
    r = ControllerRig(shared_store.master, side={PoolName.MAMBA: mamba})
    r.mamba = mamba
    yield r
    r.close()


def _tokens(pages: int) -> list[int]:
    base = next(_salt) * 10_000
    return [base + i for i in range(pages * PS)]


def backup(rig, tokens, hashes, first: int, last: int, state_seed=None) -> torch.Tensor | None:
    """Back up pages [first, last) as one node; with ``state_seed``, its trailing Mamba state
    (the state after page ``last``). Returns the state's bytes."""
    idx = rig.host.alloc((last - first) * PS)
    fill_random(rig.host, idx, seed=first + 1)
    extra, want = None, None
    if state_seed is not None:
        slot = rig.mamba.alloc(1)
        fill_random(rig.mamba, slot, seed=state_seed)
        want = page_bytes(rig.mamba, slot)[0]
        extra = [PoolTransfer(PoolName.MAMBA, host_indices=slot, keys=[hashes[last - 1]],
                              hit_policy=PoolHitPolicy.TRAILING_PAGES)]
    op_id = rig.ctl.write_storage(idx, tokens[first * PS:last * PS], hash_value=hashes[first:last],
                                  prefix_keys=hashes[:first] or None, extra_pools=extra)
    op = rig.ctl.ack_backup_queue.get(timeout=ACK_TIMEOUT_S)
    assert op.id == op_id and op.completed_tokens == (last - first) * PS
    rig.host.free(idx)
    return want


def prefetch(rig, tokens) -> dict:
    """One prefetch with the Mamba placeholder transfer, as the unified cache submits it."""
    t = PoolTransfer(PoolName.MAMBA, keys=["__placeholder__"],
                     hit_policy=PoolHitPolicy.TRAILING_PAGES)
    op = rig.ctl.submit_prefetch(CacheRequestHandle(f"r{next(_salt)}", 0),
                                 RadixKey(array("q", tokens)), None, None, None, [t]).operation
    assert rig.ctl.prefetch_hit_queue.get(timeout=ACK_TIMEOUT_S) is op
    hit = op.storage_hit_count
    if hit < rig.ctl.prefetch_threshold:
        rig.ctl.terminate_prefetch(op)
        return {"hit": 0, "loaded": 0, "state": None, "pool_hits": {}}
    op.host_indices = rig.ctl.alloc_prefetch_host_buffers(op, hit)
    slot = rig.mamba.alloc(1)
    fill_random(rig.mamba, slot, seed=99)                   # poison
    op.pool_transfers[0].host_indices = slot
    rig.ctl.prefetch_buffer.put(op)
    loaded, pool_hits = 0, {}
    while True:
        ack = rig.ctl.ack_prefetch_queue.get(timeout=ACK_TIMEOUT_S)
        assert ack.operation is op
        loaded = ack.completed_tokens if ack.completed_tokens is not None else loaded
        pool_hits = ack.pool_hits or pool_hits
        if ack.completed_req:
            break
    return {"hit": hit, "loaded": loaded, "state": page_bytes(rig.mamba, slot)[0],
            "keys": op.pool_transfers[0].keys, "pool_hits": pool_hits}


def test_state_at_an_earlier_stop_point_limits_the_hit(rig):
    tokens = _tokens(6)
    hashes = list(get_hash_str(tokens, None, page_size=PS))
    want4 = backup(rig, tokens, hashes, 0, 4, state_seed=41)
    backup(rig, tokens, hashes, 4, 6)                        # KV only: no state after page 6
    got = prefetch(rig, tokens)
    assert got["hit"] == got["loaded"] == 4 * PS            # KV has 6 pages, state only at 4
    assert got["keys"] == [hashes[3]]
    assert got["pool_hits"][PoolName.MAMBA] == 1
    assert torch.equal(got["state"], want4)
    assert rig.log.count()["batch_exists_v2"] == 1 and rig.log.count()["batch_set_v2"] == 1


def test_latest_state_is_loaded_when_every_stop_point_has_one(rig):
    tokens = _tokens(6)
    hashes = list(get_hash_str(tokens, None, page_size=PS))
    want4 = backup(rig, tokens, hashes, 0, 4, state_seed=42)
    want6 = backup(rig, tokens, hashes, 4, 6, state_seed=43)
    assert not torch.equal(want4, want6)
    got = prefetch(rig, tokens)
    assert got["hit"] == got["loaded"] == 6 * PS
    assert got["keys"] == [hashes[5]] and torch.equal(got["state"], want6)


def test_kv_without_any_state_is_no_hit(rig):
    tokens = _tokens(4)
    hashes = list(get_hash_str(tokens, None, page_size=PS))
    backup(rig, tokens, hashes, 0, 4)
    assert prefetch(rig, tokens)["hit"] == 0
    assert rig.log.count()["batch_get_v1"] == 0 and rig.log.count()["batch_get_v2"] == 0


def test_a_side_pool_refused_at_attach_leaves_sglang_detached(shared_store):
    """SGLang's hybrid attach registers side pools after its threads started, outside its own
    rollback: a pool HiCacheMC refuses left the controller attached. The plugin's hook rolls
    the attach back; a later attach then succeeds."""
    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController

    from hicache_mc.sglang.plugin import _attach_or_roll_back

    class NoPages:              # a side pool with neither page API: refused, naming it
        page_size, layout, can_use_write_back_jit = 1, "page_first", False

    rig = ControllerRig(shared_store.master, side={PoolName.INDEXER: NoPages()}, attach=False)
    ctl, attach = rig.ctl, HybridCacheController.attach_storage_backend

    def attach_all(how, pools=None):
        how(ctl, "dynamic", PS, "test/controller", dict(rig.config),
            host_pools=pools or ctl.mem_pool_host.entries)
    with pytest.raises(ValueError, match="NoPages"):
        attach_all(attach)
    assert ctl.enable_storage and ctl.backup_thread.is_alive()     # SGLang alone: half attached
    ctl.detach_storage_backend()

    with pytest.raises(ValueError, match="NoPages"):
        attach_all(lambda *a, **kw: _attach_or_roll_back(attach, *a, **kw))
    assert not ctl.enable_storage and ctl.storage_backend is None
    assert not any(t.is_alive() for t in (ctl.prefetch_thread, ctl.prefetch_io_aux_thread,
                                          ctl.prefetch_sync_thread, ctl.backup_thread))
    attach_all(lambda *a, **kw: _attach_or_roll_back(attach, *a, **kw),     # without that pool
               [ctl.mem_pool_host.anchor_entry])
    assert ctl.enable_storage and ctl.storage_backend.client is not None
    ctl.detach_storage_backend()
