"""SGLang's HiCacheMC backend, unchanged, with ``transport: mooncake``: byte-exact pages.

Real sglang host pools on CPU and the real backend factory (helpers from tests/sglang), against a
store whose node runs a Transfer Engine; every page travels through the TE over loopback TCP.
"""
from __future__ import annotations

import os
import sys

import pytest

pytest.importorskip("mooncake.engine", reason="the Mooncake transfer engine is not installed")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "sglang"))
from sglang_env import apply_torchvision_stub  # noqa: E402

apply_torchvision_stub()                      # as tests/sglang/conftest.py does, before sglang
os.environ.pop("SGLANG_TEST_HICACHE_BACKEND_RANDOM_DELAY", None)
os.environ.pop("SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE", None)

import torch  # noqa: E402
from pools import (fill_random, make_backend, mha_host, mla_host, page_bytes,  # noqa: E402
                   page_hashes, slots)

CASES = [("mha", "page_first"), ("mha", "page_first_direct"), ("mha", "page_head"),
         ("mha", "layer_first"), ("mla", "page_first"), ("mla", "layer_first")]


@pytest.mark.parametrize("kind, layout", CASES, ids=[f"{k}-{l}" for k, l in CASES])
def test_set_then_get_into_other_slots_through_the_te(te_store, kind, layout):
    page_size = 16
    pool = (mla_host if kind == "mla" else mha_host)(layout, torch.bfloat16, page_size,
                                                     tokens=4 * page_size)
    backend = make_backend(pool, te_store.master, mla=kind == "mla", transport="mooncake")
    try:
        client = backend.client
        keys = page_hashes(3, page_size)
        src, dst = slots(pool, 3), slots(pool, 3)
        fill_random(pool, src, seed=1)
        fill_random(pool, dst, seed=2)          # poison: a page not written stays wrong
        want = page_bytes(pool, src)
        assert backend.batch_set_v1(keys, src) == [True] * 3
        assert backend.batch_exists(keys) == 3
        fill_random(pool, src, seed=3)
        assert backend.batch_get_v1(keys, dst) == [True] * 3
        for w, g in zip(want, page_bytes(pool, dst)):
            assert torch.equal(w, g)
        assert client.te._regions, "the backend registered no memory with the TE"
        moved = client.te.counters
        assert moved["direct"] + moved["staged"] == 2 * 3 * (1 if kind == "mla" else 2)
        if layout != "layer_first":             # zero-copy layouts: straight into the host pool
            assert moved["staged"] == 0
    finally:
        backend.close()
