"""Routing through real HTTP, KV events and a real store: a request goes to the worker that
holds its prefix; once that worker has evicted the prefix to the L3, the choice follows the
cost model (the L3 serves every worker); the residency query answers per worker and tier."""
from __future__ import annotations

import threading

import pytest
import requests
from conductor_procs import ConductorProc, wait_for

from hicache_mc.conductor.chain import chain
from hicache_mc.conductor.prompts import PromptTokenizer
from conftest import L3_NAMESPACE
from procs import free_port
from tokenizer import text, words

PAGE = 16
VOCAB = words()


@pytest.fixture(scope="module")
def conductor(tmp_path_factory, standins, l3_store, tokenizer_dir):
    c = ConductorProc(tmp_path_factory.mktemp("conductor"), free_port(), [
        "--worker-urls", f"r0={standins.url('r0')}", f"r1={standins.url('r1')}", "--tokenizer", tokenizer_dir,
        "--l3-master", l3_store.master, "--l3-namespace", L3_NAMESPACE],
        env={"HICACHE_MC_CONDUCTOR_L3_BW": "10e9", "HICACHE_MC_CONDUCTOR_KV_BYTES_PER_TOKEN": "131072"}
    ).start()
    yield c
    c.stop()


@pytest.fixture(scope="module")
def prompts(tokenizer_dir):
    return PromptTokenizer(tokenizer_dir)


def convo(seed: int, turns: int = 0) -> list:
    """A conversation of its own from the first page on (its own system message)."""
    msgs = [{"role": "system", "content": f"session {seed}"},
            {"role": "user", "content": text(1500, seed, VOCAB)}]
    for i in range(turns):
        msgs += [{"role": "assistant", "content": f"answer {i}"}, {"role": "user", "content": f"more {i}"}]
    return msgs


def ask(c: ConductorProc, messages: list, **kw) -> requests.Response:
    r = c.post("/v1/chat/completions", {"messages": messages, "max_tokens": 2, **kw})
    assert r.status_code == 200, r.text
    return r


def query(c: ConductorProc, prompts: PromptTokenizer, messages: list) -> dict:
    ids = prompts.chat({"messages": messages})
    r = c.post("/query", {"token_ids": ids, "block_size": PAGE})
    assert r.status_code == 200, r.text
    return r.json()["default"]


def test_a_request_goes_to_the_worker_holding_its_prefix(conductor, prompts):
    first = ask(conductor, convo(1))
    holder = first.headers["X-Conductor-Worker"]
    cold = float(first.headers["X-Conductor-Predicted-TTFT"])
    wait_for(lambda: query(conductor, prompts, convo(1))[holder]["GPU"] > 1000, 10,
             "the holder's KV events")
    for turns in (1, 2, 3):
        r = ask(conductor, convo(1, turns))
        assert r.headers["X-Conductor-Worker"] == holder
        assert float(r.headers["X-Conductor-Predicted-TTFT"]) < cold
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 1000


def test_after_eviction_to_the_l3_the_choice_follows_the_cost_model(conductor, standins, prompts):
    holder = ask(conductor, convo(2)).headers["X-Conductor-Worker"]
    other = ({"r0", "r1"} - {holder}).pop()
    pages = len(chain(prompts.chat({"messages": convo(2)}), PAGE).page_hashes)
    wait_for(lambda: query(conductor, prompts, convo(2))[holder]["GPU"] == pages * PAGE, 10,
             "the holder's KV events")
    standins.control(holder, "evict")
    wait_for(lambda: all(q["GPU"] == 0 and q["EXTERNAL"] == pages * PAGE
                         for q in query(conductor, prompts, convo(2)).values()), 10,
             "the eviction's events and the L3 view")
    # the holder is busy now (requests sent to it directly); the other is idle
    busy = [threading.Thread(target=requests.post, args=(standins.url(holder) + "/v1/completions",),
                             kwargs={"json": {"prompt": text(2000, 100 + i, VOCAB), "max_tokens": 2},
                                     "timeout": 120}) for i in range(2)]
    for t in busy:
        t.start()
    wait_for(lambda: conductor.workers()[holder]["load"]["waiting_reqs"] > 0, 10,
             "the holder's load report")
    r = ask(conductor, convo(2, 1))
    assert r.headers["X-Conductor-Worker"] == other
    # the other worker really took the prefix from the L3 rather than computing it
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= (pages - 1) * PAGE
    for t in busy:
        t.join()


def test_query_answers_per_worker_and_tier(conductor, prompts):
    holder = ask(conductor, convo(3)).headers["X-Conductor-Worker"]
    ids = prompts.chat({"messages": convo(3)})
    c = chain(ids, PAGE)
    wait_for(lambda: query(conductor, prompts, convo(3))[holder]["GPU"] == len(c.page_hashes) * PAGE,
             10, "the holder's KV events")
    full = len(c.page_hashes) * PAGE
    by_tokens = query(conductor, prompts, convo(3))
    assert set(by_tokens) == {"r0", "r1"}
    assert by_tokens[holder] == {"longest_matched": full, "GPU": full, "CPU": full,
                                 "EXTERNAL": 0, "DP": {"0": full}}
    by_pages = conductor.post("/query_by_hash", {"page_hashes": c.page_hashes}).json()["default"]
    assert by_pages == by_tokens
    by_blocks = conductor.post("/query_by_hash", {"block_hash": c.block_hashes[:3],
                                                  "instance_id": holder}).json()["default"]
    assert by_blocks == {holder: {"longest_matched": 3 * PAGE, "GPU": 3 * PAGE, "CPU": 3 * PAGE,
                                  "DP": {"0": 3 * PAGE}}}
    for bad in ({"token_ids": "x"}, {"token_ids": [1, 2], "block_size": 7}, [1, 2]):
        assert conductor.post("/query", bad).status_code == 400
    assert conductor.post("/query_by_hash", {"page_hashes": ["ab"]}).status_code == 400
