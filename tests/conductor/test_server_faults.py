"""Faults, through real HTTP and real KV-event streams: a worker answering 5xx or killed
mid-run leaves the rotation (its unstarted requests go elsewhere, started ones end with a
clear error); a stalled event stream means load-only routing for that worker until it
resumes; a gap in the events is filled from the replay endpoint; a restarted conductor
rebuilds its index from the replay endpoints; the index keeps to its LRU bound."""
from __future__ import annotations

import threading

import pytest
import requests
from conductor_procs import ConductorProc, Cuttable, wait_for

from procs import free_port
from tokenizer import text, words

VOCAB = words()
PAGE = 16
WORKERS = ["f0", "f1", "f2", "f3"]


@pytest.fixture(scope="module")
def relay(standins):
    """f0's event PUB port behind a relay the tests can cut."""
    host, _, port = standins.workers["f0"]["events"].removeprefix("tcp://").rpartition(":")
    r = Cuttable((host, int(port)))
    yield r
    r.close()


@pytest.fixture(scope="module")
def conductor(tmp_path_factory, standins, relay, tokenizer_dir):
    c = ConductorProc(tmp_path_factory.mktemp("conductor"), free_port(),
                      ["--tokenizer", tokenizer_dir, "--page-size", str(PAGE)],
                      env={"HICACHE_MC_CONDUCTOR_STALL_S": "0.5"}).start(ready=False)
    for name in WORKERS:
        doc = {"url": standins.url(name), "name": name}
        if name == "f0":
            doc["events"] = f"tcp://127.0.0.1:{relay.port}"
            doc["replay"] = standins.workers["f0"]["replay"]
        assert c.admin("POST", "/workers", json=doc).status_code == 200
    wait_for(lambda: all(w["healthy"] for w in c.workers().values()), 20, "all workers healthy")
    yield c
    c.stop()


def convo(seed: int, turns: int = 0) -> list:
    msgs = [{"role": "system", "content": f"faults {seed}"}, {"role": "user", "content": text(600, seed, VOCAB)}]
    for i in range(turns):
        msgs += [{"role": "assistant", "content": f"a{i}"}, {"role": "user", "content": f"q{i} " * 20}]
    return msgs


def ask(c, messages, **kw):
    return c.post("/v1/chat/completions", {"messages": messages, "max_tokens": 2, **kw})


def held(c, prompts, messages, worker) -> int:
    """Tokens of the prompt the conductor believes ``worker`` holds (0 if it is left out)."""
    r = c.post("/query", {"token_ids": prompts.chat({"messages": messages})})
    return r.json()["default"].get(worker, {}).get("GPU", 0)


@pytest.fixture(scope="module")
def prompts(tokenizer_dir):
    from hicache_mc.conductor.prompts import PromptTokenizer
    return PromptTokenizer(tokenizer_dir)


def test_a_worker_answering_5xx_leaves_the_rotation_and_comes_back(conductor, standins):
    standins.control("f3", "fail", status=503)
    # out within 1 s of failing (its load polls run every 0.2 s); generous slack for this host
    wait_for(lambda: not conductor.workers()["f3"]["healthy"], 3.0, "f3 out of the rotation")
    for i in range(6):
        r = ask(conductor, convo(1000 + i))
        assert r.status_code == 200 and r.headers["X-Conductor-Worker"] != "f3"
    standins.control("f3", "fail", status=0)
    wait_for(lambda: conductor.workers()["f3"]["healthy"], 5.0, "f3 back in the rotation")


def test_a_stalled_event_stream_means_load_only_until_it_resumes(conductor, standins, prompts):
    holder = ask(conductor, convo(2)).headers["X-Conductor-Worker"]
    wait_for(lambda: held(conductor, prompts, convo(2), holder) > 0, 10, "the holder's events")
    standins.control(holder, "pause_events")
    r = ask(conductor, convo(2, 1))           # new pages on the holder: their events are due
    assert r.headers["X-Conductor-Worker"] == holder
    wait_for(lambda: not conductor.workers()[holder]["events_live"], 5, "the stream marked stalled")
    # its cache is unknown now: left out of residency answers, routed on load alone
    assert holder not in conductor.post("/query", {"token_ids": [1] * 64}).json()["default"]
    standins.control(holder, "resume_events")
    wait_for(lambda: conductor.workers()[holder]["events_live"], 5, "the stream live again")
    wait_for(lambda: held(conductor, prompts, convo(2, 1), holder) > held(conductor, prompts, convo(2), holder),
             5, "the held events applied")


def test_an_event_gap_is_filled_from_the_replay_endpoint(conductor, standins, relay, prompts):
    before = conductor.metrics().get('hicache_mc_conductor_events_gaps{worker="f0"}', 0)
    relay.cut()
    # f0 computes pages the conductor does not hear of: sent to f0 directly
    body = {"messages": convo(3), "max_tokens": 2}
    assert requests.post(standins.url("f0") + "/v1/chat/completions", json=body, timeout=30).ok
    assert held(conductor, prompts, convo(3), "f0") == 0
    relay.mend()
    wait_for(lambda: held(conductor, prompts, convo(3), "f0") > 0, 10, "the missed events, replayed")
    assert conductor.metrics()['hicache_mc_conductor_events_gaps{worker="f0"}'] > before


def test_a_restarted_conductor_rebuilds_its_index_from_replay(tmp_path, standins, prompts, tokenizer_dir):
    urls = [f"{n}={standins.url(n)}" for n in ("f1", "f2", "f3")]
    first = ConductorProc(tmp_path, free_port(), ["--worker-urls", *urls, "--tokenizer", tokenizer_dir]).start()
    holder = ask(first, convo(4)).headers["X-Conductor-Worker"]
    wait_for(lambda: held(first, prompts, convo(4), holder) > 0, 10, "the first conductor's index")
    first.kill()                                   # SIGKILL: nothing saved on the way out
    again = ConductorProc(tmp_path, first.port, ["--worker-urls", *urls, "--tokenizer", tokenizer_dir]).start()
    try:
        wait_for(lambda: held(again, prompts, convo(4), holder) > 0, 5, "the index rebuilt")
        r = ask(again, convo(4, 1))
        assert r.headers["X-Conductor-Worker"] == holder
    finally:
        again.stop()


def test_the_index_keeps_to_its_lru_bound(tmp_path, standins, tokenizer_dir):
    c = ConductorProc(tmp_path, free_port(), ["--worker-urls", f"f1={standins.url('f1')}",
                      "--tokenizer", tokenizer_dir], env={"HICACHE_MC_CONDUCTOR_INDEX_BLOCKS": "64"}).start()
    try:
        for seed in range(5, 9):                    # ~40 pages each
            assert ask(c, convo(seed)).status_code == 200
        wait_for(lambda: c.metrics().get("hicache_mc_conductor_index_blocks") == 64, 10,
                 "the index at its bound")
        assert c.metrics()["hicache_mc_conductor_index_bytes_per_block"] > 0
    finally:
        c.stop()


def test_a_worker_killed_mid_run(conductor, standins):
    """Last: it kills f2. Its streams already answering end with an error event naming it; a
    request it had not answered yet is answered by another worker; it leaves the rotation."""
    for name in ("f0", "f1", "f3"):
        assert conductor.admin("DELETE", f"/workers/{name}").status_code == 200
    results: dict = {}

    def run(i, stream):
        body = {"messages": convo(50 + i), "max_tokens": 400, "stream": stream}
        with requests.post(conductor.url + "/v1/chat/completions", json=body, stream=True, timeout=60) as r:
            results[i] = (r.status_code, r.headers.get("X-Conductor-Worker"), b"".join(r.iter_content(None)))
    threads = [threading.Thread(target=run, args=(i, i < 3)) for i in range(4)]
    for t in threads:
        t.start()
    wait_for(lambda: standins.stats("f2")["running"] == 4, 10, "four requests decoding on f2")
    assert conductor.admin("POST", "/workers", json={"url": standins.url("f1"), "name": "f1"}).ok
    wait_for(lambda: conductor.workers()["f1"]["healthy"], 5, "f1 in the rotation")
    standins.control("f2", "crash")
    for t in threads:
        t.join()
    for i in range(3):
        status, worker, body = results[i]
        last = body.split(b"data: ")[-1]
        assert (status, worker) == (200, "f2") and b'"error"' in last and b"f2" in last
    status, worker, body = results[3]               # not started when f2 died: answered by f1
    assert (status, worker) == (200, "f1") and b'"choices"' in body
    wait_for(lambda: not conductor.workers()["f2"]["healthy"], 3.0, "f2 out of the rotation")
    r = ask(conductor, convo(60))
    assert r.status_code == 200 and r.headers["X-Conductor-Worker"] == "f1"
