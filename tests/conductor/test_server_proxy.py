"""The conductor's HTTP surface, through real HTTP to stand-in SGLang workers: answers pass
through byte for byte (SSE too), the decision rides in headers, the info endpoints answer,
bad input gets a clear error while the server keeps serving, and workers come and go at
runtime through the admin API."""
from __future__ import annotations

import pytest
import requests
from conductor_procs import ADMIN_KEY, ConductorProc, wait_for

from procs import free_port

API_KEY = "client-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def conductor(tmp_path_factory, standins, tokenizer_dir):
    tmp = tmp_path_factory.mktemp("conductor")
    (tmp / "api.key").write_text(API_KEY)
    c = ConductorProc(tmp, free_port(), [
        "--worker-urls", f"w0={standins.url('w0')}", f"w1={standins.url('w1')}",
        "--tokenizer", tokenizer_dir, "--api-key-file", str(tmp / "api.key")],
        env={"HICACHE_MC_CONDUCTOR_MAX_BODY": "1MiB"}).start()
    yield c
    c.stop()


def chat(content: str, **kw) -> dict:
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 6, **kw}


BODIES = {
    "/v1/chat/completions": chat("stream me some tokens please", stream=True,
                                 stream_options={"include_usage": True}),
    "/v1/completions": {"prompt": "once upon a time", "max_tokens": 5, "stream": True},
    "/generate": {"text": "native api", "sampling_params": {"max_new_tokens": 4}, "stream": True},
}


@pytest.mark.parametrize("path", list(BODIES))
@pytest.mark.parametrize("stream", [True, False])
def test_answers_reach_the_client_byte_exact(conductor, standins, path, stream):
    tag = f"{path.strip('/').replace('/', '-')}-{stream}"
    body = dict(BODIES[path], stream=stream)
    with requests.post(conductor.url + path, json=body, headers={**AUTH, "X-Standin-Tag": tag},
                       stream=True, timeout=30) as r:
        assert r.status_code == 200, r.text
        got = b"".join(r.iter_content(chunk_size=None))
        worker = r.headers["X-Conductor-Worker"]
        assert worker in standins.workers
        assert float(r.headers["X-Conductor-Predicted-TTFT"]) > 0
        assert r.headers["Content-Type"].startswith("text/event-stream" if stream else "application/json")
    assert got == standins.sent(worker, tag)
    if stream:
        assert got.endswith(b"data: [DONE]\n\n") and got.count(b"data: ") > 3


def test_a_large_answer_passes_whole(conductor, standins):
    """An answer of many reads (300 kB; aiohttp hands it over 32-64 kB at a time)."""
    body = chat("a long answer please", standin_pad=300_000)
    r = requests.post(conductor.url + "/v1/chat/completions", json=body,
                      headers={**AUTH, "X-Standin-Tag": "large"}, timeout=30)
    assert r.status_code == 200
    assert r.content == standins.sent(r.headers["X-Conductor-Worker"], "large")
    assert len(r.content) > 300_000


def test_info_endpoints(conductor):
    assert requests.get(conductor.url + "/health", timeout=5).status_code == 200
    assert requests.get(conductor.url + "/ready", timeout=5).status_code == 200
    models = requests.get(conductor.url + "/v1/models", timeout=5).json()
    assert models["data"][0]["id"] == "standin-model"
    conductor.post("/v1/completions", {"prompt": "count me", "max_tokens": 2}, headers=AUTH)
    m = conductor.metrics()
    assert m['hicache_mc_conductor_worker_healthy{worker="w0"}'] == 1
    assert sum(v for k, v in m.items() if k.startswith("hicache_mc_conductor_decisions_total")) >= 1
    assert m["hicache_mc_conductor_index_bytes_per_block"] > 0
    assert "hicache_mc_conductor_overhead_seconds_count" in m


def test_bad_input_gets_a_clear_error_and_the_server_keeps_serving(conductor):
    url = conductor.url + "/v1/chat/completions"
    r = requests.post(url, data=b"{not json", headers=AUTH, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = requests.post(url, json=chat("x", max_tokens=-3), headers=AUTH, timeout=10)
    assert r.status_code == 400 and "max_tokens" in r.json()["error"]["message"]
    r = requests.post(url, json=chat("x" * (2 << 20)), headers=AUTH, timeout=10)
    assert r.status_code == 413
    r = requests.post(url, json=chat("x"), timeout=10)
    assert r.status_code == 401
    r = requests.post(url, json=chat("x"), headers={"Authorization": "Bearer wrong"}, timeout=10)
    assert r.status_code == 401
    r = requests.post(url, json=chat("x", stream=False), headers={**AUTH, "X-Conductor-TTFT-SLO": "soon"},
                      timeout=10)
    assert r.status_code == 400
    assert requests.post(url, json=chat("still here"), headers=AUTH, timeout=10).status_code == 200


def test_a_prompt_it_cannot_tokenize_is_routed_on_load(conductor):
    body = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
            "max_tokens": 2}
    r = requests.post(conductor.url + "/v1/chat/completions", json=body, headers=AUTH, timeout=30)
    assert "X-Conductor-Worker" in r.headers        # routed (the stand-in itself rejects images)
    assert any(k.startswith("hicache_mc_conductor_unroutable") for k in conductor.metrics())


def test_workers_added_and_removed_at_runtime(conductor, standins):
    assert requests.get(conductor.url + "/workers", timeout=5).status_code == 401
    assert conductor.admin("DELETE", "/workers/w1").status_code == 200
    assert set(conductor.workers()) == {"w0"}
    for i in range(4):
        r = conductor.post("/v1/completions", {"prompt": f"only w0 now {i}", "max_tokens": 2},
                           headers=AUTH)
        assert r.headers["X-Conductor-Worker"] == "w0"
    r = conductor.admin("POST", "/workers", json={"url": standins.url("w1"), "name": "w1"})
    assert r.status_code == 200, r.text
    wait_for(lambda: conductor.workers()["w1"]["healthy"], 10, "w1 back in the rotation")
    assert conductor.admin("POST", "/workers", json={"url": "ftp://nowhere"}).status_code == 400
    assert conductor.admin("DELETE", "/workers/nobody").status_code == 404
    bad = requests.get(conductor.url + "/workers", timeout=5,
                       headers={"Authorization": "Bearer " + ADMIN_KEY + "x"})
    assert bad.status_code == 401
