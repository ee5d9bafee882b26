"""HiCacheMC under SGLang 0.5.23's own cache controllers (hybrid and base), real store."""
from __future__ import annotations

import logging
import time

import pytest
import torch
from sglang.srt.mem_cache.utils import get_hash_str

from controllers import ControllerRig, clear_layout, single_rank_layout
from pools import wait_view_out_of_sync

MHA_LAYOUTS = ["page_first", "page_first_direct", "page_head", "layer_first"]
_salt = iter(range(10_000, 1_000_000, 7919))


@pytest.fixture(scope="module", autouse=True)
def parallel_layout():
    single_rank_layout()
    yield
    clear_layout()


def tokens(pages: int, page_size: int) -> list[int]:
    base = next(_salt)
    return [(base + i) % 120_000 for i in range(pages * page_size)]


@pytest.fixture
def rig_factory(shared_store):
    rigs = []

    def make(**kw) -> ControllerRig:
        rig = ControllerRig(shared_store.master, **kw)
        rigs.append(rig)
        return rig
    yield make
    for rig in rigs:
        rig.close()


@pytest.mark.parametrize("hybrid", [True, False], ids=["hybrid", "base"])
@pytest.mark.parametrize("kind, layout", [("mha", l) for l in MHA_LAYOUTS] +
                         [("mla", "page_first"), ("mla", "layer_first")])
def test_backup_then_prefetch_every_byte(rig_factory, kind, layout, hybrid):
    rig = rig_factory(kind=kind, layout=layout, hybrid=hybrid)
    ps = rig.page_size
    toks = tokens(5, ps)
    assert rig.backup(toks, seed=1) == 5 * ps                  # every token acknowledged
    res = rig.prefetch(toks)
    assert res["hit"] == 5 * ps and res["loaded"] == 5 * ps
    assert rig.check_bytes(res) == 5
    rig.release(res)
    seen = rig.log.by_thread()
    assert seen["batch_set_v1"] == {"backup_thread_func"}
    assert seen["batch_exists"] == {"prefetch_thread_func"}
    assert seen["batch_get_v1"] == {"prefetch_io_aux_func"}
    assert not {"batch_get", "batch_set", "get", "set"} & set(seen)   # zero-copy path only


def test_unseen_tokens_are_a_miss_revoked_without_io(rig_factory):
    rig = rig_factory()
    res = rig.prefetch(tokens(4, rig.page_size))
    assert res == {"hit": 0, "loaded": 0, "indices": None, "hashes": []}
    assert rig.log.count()["batch_exists"] == 1 and rig.log.count()["batch_get_v1"] == 0


@pytest.mark.parametrize("hybrid", [True, False], ids=["hybrid", "base"])
def test_partial_prefix_hit_stops_exactly_at_the_first_unseen_page(rig_factory, hybrid):
    rig = rig_factory(hybrid=hybrid)
    ps = rig.page_size
    known = tokens(3, ps)
    assert rig.backup(known, seed=2) == 3 * ps
    res = rig.prefetch(known + tokens(2, ps))                 # 3 stored pages, then 2 unseen
    assert res["hit"] == 3 * ps and res["loaded"] == 3 * ps
    assert rig.check_bytes(res) == 3
    assert rig.log.sizes("batch_get_v1") == [3]               # only the hit is read
    rig.release(res)


def test_continuation_from_last_hash(rig_factory):
    rig = rig_factory()
    ps = rig.page_size
    toks = tokens(6, ps)
    assert rig.backup(toks, seed=3) == 6 * ps
    last = get_hash_str(toks[:2 * ps], None, page_size=ps)[-1]
    res = rig.prefetch(toks[2 * ps:], last_hash=last)         # the host already holds pages 0-1
    assert res["loaded"] == 4 * ps
    assert res["hashes"] == list(get_hash_str(toks, None, page_size=ps))[2:]
    assert rig.check_bytes(res) == 4
    rig.release(res)


@pytest.mark.parametrize("hybrid", [True, False], ids=["hybrid", "base"])
def test_more_than_128_pages_in_one_request(rig_factory, hybrid):
    pages, ps = 200, 4
    rig = rig_factory(hybrid=hybrid, page_size=ps, layers=2, head_dim=16, device_tokens=pages * ps)
    toks = tokens(pages, ps)
    assert rig.backup(toks, seed=4) == pages * ps
    assert rig.log.sizes("batch_set_v1") == [128, 72]        # backup goes in 128-page chunks
    res = rig.prefetch(toks)
    assert res["loaded"] == pages * ps
    assert rig.check_bytes(res) == pages
    # The hybrid controller asks once for the whole request; the base one per 128 pages.
    assert rig.log.sizes("batch_exists") == ([200] if hybrid else [128, 72])
    assert rig.log.sizes("batch_get_v1") == [128, 72]
    rig.release(res)


def test_model_shaped_pages(rig_factory):
    # Llama-3-8B at TP1: 32 layers, 8 KV heads, dim 128, bf16, page 64 -> 8 MiB per page.
    rig = rig_factory(page_size=64, layers=32, heads=8, head_dim=128, device_tokens=4 * 64,
                      host_ratio=2.5)
    toks = tokens(3, 64)
    assert rig.backup(toks, seed=5) == 3 * 64
    res = rig.prefetch(toks)
    assert res["loaded"] == 3 * 64 and rig.check_bytes(res) == 3
    rig.release(res)


def test_store_stopped_then_back_under_the_controller(store, caplog):
    caplog.set_level(logging.WARNING)
    rig = ControllerRig(store.master, timeout_s=1.0, circuit_open_s=0.3)
    try:
        ps = rig.page_size
        toks = tokens(3, ps)
        assert rig.backup(toks, seed=6) == 3 * ps
        store.stop()
        wait_view_out_of_sync(rig.backend)
        t0 = time.monotonic()
        assert rig.prefetch(toks)["hit"] == 0                 # a miss, not an error
        assert rig.backup(tokens(2, ps), seed=7) == 0         # acked, nothing completed
        assert time.monotonic() - t0 < 10
        assert rig.threads_alive()

        store.start()                                         # empty, same address
        deadline = time.monotonic() + 30
        while rig.backup(toks, seed=6) != 3 * ps:
            assert time.monotonic() < deadline, "no recovery after the store came back"
            time.sleep(0.3)
        res = rig.prefetch(toks)
        assert res["loaded"] == 3 * ps and rig.check_bytes(res) == 3
        assert rig.threads_alive()
        rig.release(res)
        # The controller logs (logger.exception) any exception a backend call raises into it.
        raised = [r for r in caplog.records if r.exc_info and r.name.startswith("sglang")]
        assert not raised, raised[0].getMessage()
    finally:
        rig.close()
