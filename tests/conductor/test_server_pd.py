"""PD mode through real HTTP: the conductor picks a prefill and a decode worker, sends both the
same request with the bootstrap host, port and room added (as SGLang's PD router does), and
answers with the decode worker's bytes; the prefill worker that holds the prefix wins."""
from __future__ import annotations

import pytest
import requests
from conductor_procs import ConductorProc, wait_for

from procs import free_port
from tokenizer import text, words

VOCAB = words()


@pytest.fixture(scope="module")
def conductor(tmp_path_factory, standins, tokenizer_dir):
    c = ConductorProc(tmp_path_factory.mktemp("conductor"), free_port(), [
        "--prefill", f"p0={standins.url('p0')}", "18998", "--prefill", f"p1={standins.url('p1')}",
        "--decode", f"d0={standins.url('d0')}", "--tokenizer", tokenizer_dir]).start()
    yield c
    c.stop()


def messages(seed: int, turns: int = 0) -> list:
    msgs = [{"role": "system", "content": f"pd {seed}"}, {"role": "user", "content": text(500, seed, VOCAB)}]
    for i in range(turns):
        msgs += [{"role": "assistant", "content": "ok"}, {"role": "user", "content": f"next {i}"}]
    return msgs


def test_prefill_and_decode_paired_with_bootstrap_info(conductor, standins):
    served = {n: standins.stats(n)["paired"] for n in ("p0", "p1", "d0")}
    body = {"messages": messages(1), "max_tokens": 5, "stream": True}
    with requests.post(conductor.url + "/v1/chat/completions", json=body, stream=True, timeout=30,
                       headers={"X-Standin-Tag": "pd-1"}) as r:
        assert r.status_code == 200, r.text
        got = b"".join(r.iter_content(None))
        prefill = r.headers["X-Conductor-Worker"]
    assert prefill in ("p0", "p1") and r.headers["X-Conductor-Decode-Worker"] == "d0"
    assert got == standins.sent("d0", "pd-1")          # the client reads the decode worker's bytes
    assert got.count(b'"content"') >= 5
    # both named the same bootstrap room (a stand-in refuses a PD request without one), and
    # the decode worker answered once that room's prefill had run, as SGLang's transfer does
    after = {n: standins.stats(n)["paired"] for n in ("p0", "p1", "d0")}
    assert after["d0"] == served["d0"] + 1 and after[prefill] == served[prefill] + 1
    assert standins.stats(prefill)["gpu_pages"] > 0


def test_the_prefill_worker_holding_the_prefix_wins(conductor, standins):
    first = conductor.post("/v1/chat/completions", {"messages": messages(2), "max_tokens": 3})
    assert first.status_code == 200, first.text
    holder = first.headers["X-Conductor-Worker"]
    wait_for(lambda: conductor.metrics().get(f'hicache_mc_conductor_events_batches{{worker="{holder}"}}', 0) > 0,
             10, "the prefill worker's events")
    for turns in (1, 2):
        r = conductor.post("/v1/chat/completions", {"messages": messages(2, turns), "max_tokens": 3})
        assert r.status_code == 200 and r.headers["X-Conductor-Worker"] == holder
    # decode workers never show up as prefix holders
    assert "d0" not in conductor.post("/query", {"token_ids": [1] * 40}).json()["default"]


def test_no_decode_worker_is_503(conductor, standins):
    assert conductor.admin("DELETE", "/workers/d0").status_code == 200
    try:
        r = conductor.post("/v1/chat/completions", {"messages": messages(3), "max_tokens": 3})
        assert r.status_code == 503 and "Retry-After" in r.headers
        assert r.json()["error"]["type"] == "service_unavailable"
        assert requests.get(conductor.url + "/ready", timeout=5).status_code == 503
    finally:
        assert conductor.admin("POST", "/workers", json={"url": standins.url("d0"), "name": "d0",
                                                         "role": "decode"}).ok
    wait_for(lambda: requests.get(conductor.url + "/ready", timeout=5).status_code == 200, 5, "ready again")
