"""PD disaggregation through the L3: a decode instance's output pages (SGLang's own
DecodeKVCacheOffloadManager) are the next turn's prefill hits, on any prefill instance."""
from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from sglang.srt.mem_cache.utils import get_hash_str

from controllers import ControllerRig, clear_layout, single_rank_layout
from decode_offload import DecodeRank, one_rank_group, server_args
from pools import read_token_kv

MODEL = "test/pd"
_rid = iter(range(1, 1_000_000))


@pytest.fixture(scope="module", autouse=True)
def parallel_layout():
    single_rank_layout()
    made = one_rank_group()
    yield
    if made:
        dist.destroy_process_group()
    clear_layout()


class Shape:
    page_size, layers, heads, head_dim = 16, 3, 4, 32


def tokens(n: int, salt: int) -> list[int]:
    return [(salt * 7919 + i) % 120_000 for i in range(n)]


def true_kv(n: int, seed: int, heads: int = Shape.heads) -> torch.Tensor:
    """The model's KV of ``n`` tokens (2, tokens, layers, heads, dim): what any instance that
    computes them holds."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, n, Shape.layers, heads, Shape.head_dim, generator=g).bfloat16()


@pytest.fixture
def decode_args(shared_store):
    """The decode server's flags (published for the test's decode ranks)."""
    made = []

    def publish(layout: str = "page_first", **extra):
        made.append(server_args(shared_store.master, page_size=Shape.page_size, layout=layout,
                                model=MODEL, **extra))
    yield publish
    for override in made:
        override.restore()


@pytest.fixture
def closing():
    objs = []
    yield objs.append
    for o in objs:
        o.close()


def heads(kv: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
    h = Shape.heads // tp
    return kv[..., rank * h:(rank + 1) * h, :]


@pytest.mark.parametrize("layout, decode_tp, lcm", [("page_first", 1, None),
                                                     ("page_head", 2, 2)],
                         ids=["same-tp", "decode-tp2-prefill-tp1"])
def test_second_turn_prefill_loads_prompt_and_answer_from_the_l3(shared_store, decode_args,
                                                                  closing, layout, decode_tp,
                                                                  lcm):
    ps = Shape.page_size
    decode_args(layout=layout)
    ranks = [DecodeRank(page_size=ps, layers=Shape.layers, heads=Shape.heads // decode_tp,
                        head_dim=Shape.head_dim, tp_rank=r, tp_size=decode_tp)
             for r in range(decode_tp)]
    for rank in ranks:
        closing(rank)

    def prefill() -> ControllerRig:     # a TP-1 prefill instance
        rig = ControllerRig(shared_store.master, layout=layout, page_size=ps, layers=Shape.layers,
                            heads=Shape.heads, head_dim=Shape.head_dim, model=MODEL,
                            **({"tp_lcm_size": lcm} if lcm else {}))
        closing(rig)
        return rig
    rid = next(_rid)
    prompt, answer = tokens(5 * ps + 7, rid), tokens(3 * ps + 4, rid + 1)
    kv = true_kv(len(prompt) + len(answer), seed=rid)
    aligned = len(prompt) // ps * ps

    # turn 1: prefill A computes the prompt and backs its whole pages up; decode takes the
    # prompt's KV and decodes the answer, offloading it page by page as it goes
    assert prefill().backup(prompt[:aligned], seed=0, kv=kv[:, :aligned]) == aligned
    for r, rank in enumerate(ranks):
        req = rank.admit(f"r{rid}", prompt, heads(kv, r, decode_tp)[:, :len(prompt)])
        for i in range(len(prompt), len(prompt) + len(answer)):
            rank.decode(req, [answer[i - len(prompt)]], heads(kv, r, decode_tp)[:, i:i + 1])
            rank.offload(req)
    # the decode offloads output_ids[:-1] from the prompt's last whole page, in whole pages
    offloaded = (len(prompt) + len(answer) - 1 - aligned) // ps * ps
    assert offloaded >= 3 * ps                     # the answer's pages, the prompt's tail too

    # turn 2, on another prefill instance: the prompt is turn 1's prompt, answer and a new
    # message; every page of turn 1 comes from the L3, byte for byte
    prefill_b = prefill()
    turn2 = prompt + answer + tokens(2 * ps, rid + 2)
    res = prefill_b.prefetch(turn2)
    assert res["loaded"] == aligned + offloaded
    assert torch.equal(read_token_kv(prefill_b.host, res["indices"][:res["loaded"]]),
                       kv[:, :res["loaded"]])
    prefill_b.release(res)


def test_answer_pages_behind_a_missing_prompt_are_orphans_until_a_prefill_stores_it(
        shared_store, decode_args, closing):
    ps = Shape.page_size
    decode_args()
    decode = DecodeRank(page_size=ps, layers=Shape.layers, heads=Shape.heads,
                        head_dim=Shape.head_dim)
    closing(decode)

    def prefill() -> ControllerRig:
        rig = ControllerRig(shared_store.master, page_size=ps, layers=Shape.layers,
                            heads=Shape.heads, head_dim=Shape.head_dim, model=MODEL)
        closing(rig)
        return rig
    rid = next(_rid)
    prompt, answer = tokens(4 * ps, rid), tokens(3 * ps + 1, rid + 1)
    kv = true_kv(len(prompt) + len(answer) + 2 * ps, seed=rid)
    # turn 1: the prompt's pages are not in the L3 (evicted, or never backed up); the decode
    # offloads its answer all the same, chained from the prompt
    req = decode.admit(f"r{rid}", prompt, kv[:, :len(prompt)])
    decode.decode(req, answer, kv[:, len(prompt):len(prompt) + len(answer)])
    decode.offload(req)
    answer_pages = len(answer) // ps

    # turn 2's lookup stops at the first prompt page: the answer pages are orphans, counted once
    prefill_b = prefill()
    turn2 = prompt + answer + tokens(2 * ps, rid + 2)
    hashes = list(get_hash_str(turn2, None, page_size=ps))
    deadline = time.monotonic() + 10            # B's residency view learns the decode's writes
    while prefill_b.backend.batch_exists(hashes) == 0 and \
            prefill_b.backend.orphans.total < answer_pages:
        assert time.monotonic() < deadline, "the orphans were never seen"
        time.sleep(0.01)
    assert prefill_b.backend.orphans.total == answer_pages
    assert prefill_b.prefetch(turn2)["loaded"] == 0
    assert prefill_b.backend.orphans.total == answer_pages

    # B computes turn 2 and backs its pages up (write_through): the chain is whole again, and
    # the next prefill loads the prompt, the answer the decode stored, and the new message
    aligned = len(turn2) // ps * ps
    assert prefill_b.backup(turn2[:aligned], seed=0, kv=kv[:, :aligned]) == aligned
    prefill_c = prefill()
    res = prefill_c.prefetch(turn2)
    assert res["loaded"] == aligned
    assert torch.equal(read_token_kv(prefill_c.host, res["indices"][:aligned]), kv[:, :aligned])
    prefill_c.release(res)
