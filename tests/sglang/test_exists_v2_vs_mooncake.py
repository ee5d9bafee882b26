"""Our batch_exists_v2 answers against SGLang's built-in ``mooncake`` backend, case by case.

Both backends get the same real host pools and store exactly the same objects through their own
batch_set_v1 / batch_set_v2, then answer the same queries; each answer must equal the other's
and the hand-computed one. Mooncake: a real ``mooncake_master`` and a holder process
(benchmarks/replay/services.py), SGLang's ``MooncakeStore`` over TCP in this process.
Mooncake refuses unregistered pools and ``block_groups`` (it raises), so those cases are ours only.
"""
from __future__ import annotations

import os
import sys

import pytest

pytest.importorskip("mooncake.store", reason="the Mooncake store is not installed")

from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig, PoolName  # noqa: E402
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402

from pools import register_pools  # noqa: E402
from test_exists_v2 import N, Rig, result  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from benchmarks.replay.services import mooncake_store  # noqa: E402

K, M, S, D = PoolName.KV, PoolName.MAMBA, PoolName.SWA, PoolName.DRAFT
EVERY = list(range(1, N + 1))

# (stored pages per pool, pools queried, expected result)
CASES = {
    "full_hit": ({K: EVERY, M: EVERY, S: EVERY, D: EVERY}, (M, S, D),
                 result(6, {K: 6, M: 6, S: 6, D: 6}, EVERY)),
    "kv_only": ({K: [1, 2, 3, 5, 6]}, (), result(3, {K: 3}, [1, 2, 3])),
    "kv_miss_in_the_middle": ({K: [1, 2, 4, 5, 6], M: [2, 4, 6], D: EVERY}, (M, D),
                              result(2, {K: 2, M: 2, D: 2}, [2])),
    "mamba_holes": ({K: EVERY, M: [2, 4, 6]}, (M,), result(6, {K: 6, M: 6}, [2, 4, 6])),
    "swa_holes": ({K: EVERY, S: [1, 2, 4, 5, 6]}, (S,), result(6, {K: 6, S: 6}, [1, 2, 5, 6])),
    "mamba_and_swa": ({K: EVERY, M: [2, 4, 6], S: [1, 2, 4, 5, 6]}, (M, S),
                      result(6, {K: 6, M: 6, S: 6}, [2, 6])),
    "latest_state_missing": ({K: EVERY, M: [1, 3]}, (M,), result(3, {K: 6, M: 3}, [1, 3])),
    "all_pages_hole": ({K: EVERY, D: [1, 2, 3, 5, 6], M: [2, 5]}, (D, M),
                       result(2, {K: 6, D: 3, M: 5}, [2])),
    "side_pool_missing": ({K: EVERY, S: EVERY}, (S, M), result(0, {K: 6, S: 6}, [])),
    "nothing_stored": ({}, (M,), result(0, {}, [])),
}


@pytest.fixture(scope="module")
def mooncake():
    with mooncake_store(256 << 20) as st:
        yield st.spec["master"]


def make_mooncake(master, anchor, side):
    cfg = HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
        model_name="test/vs-mooncake",
        extra_config={"master_server_address": master, "metadata_server": "P2PHANDSHAKE",
                      "protocol": "tcp", "global_segment_size": 0, "local_hostname": "127.0.0.1",
                      "check_server": False})
    return register_pools(StorageBackendFactory.create_backend("mooncake", cfg, anchor), anchor, side)


@pytest.mark.parametrize("case", list(CASES))
def test_same_answer_as_mooncake(shared_store, mooncake, case):
    stored, queried, want = CASES[case]
    rigs = [Rig(shared_store.master), Rig(mooncake, make=make_mooncake)]
    try:
        answers = []
        for rig in rigs:
            for name, pages in stored.items():
                rig.store(name, pages)
            answers.append(rig.query(*queried))
        ours, theirs = answers
        assert type(rigs[1].backend).__name__ == "MooncakeStore"
        assert theirs == want
        assert ours == want
    finally:
        for rig in rigs:
            rig.backend.close()
