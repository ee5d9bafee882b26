"""The conductor in front of two real SGLang servers on CPU (tests/live: a tiny Qwen2, HiCache
with hicache-mc as L3, ``--kv-events-config``): their KV events, load reports, page hashes
and chat template are SGLang's own. Through real HTTP: a chat streams through unchanged; a
request goes to the server holding its prefix (the conductor's chain matched SGLang's
events); after that server evicted the prefix, the L3 serves it and the choice uses it; a gap
in a server's events is filled from its replay endpoint; a restarted conductor rebuilds its
index; a server killed mid-run fails its streams clearly and the other takes the rest."""
from __future__ import annotations

import os
import re
import signal
import threading

import pytest
import requests
from conductor_procs import ConductorProc, Cuttable, http_bodies, wait_for

import live
from procs import Store, free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]
PAGE = live.ServerOptions().page_size


class Live:
    def __init__(self, store, servers, namespace, relay, tap):
        self.store, self.servers, self.namespace, self.relay = store, servers, namespace, relay
        self.tap = tap                  # b's HTTP port behind a relay that records its answers
        self.by_name = {s.name: s for s in servers}


@pytest.fixture(scope="module")
def fleet(tiny_model, tmp_path_factory):
    live.build_page_hash()
    store = Store(tmp_path_factory.mktemp("store")).start()
    try:
        with live.start_servers(tiny_model, store.master, tmp_path_factory.mktemp("servers"),
                                names=("a", "b"), options=live.ServerOptions(kv_events=True)) as servers:
            ns = wait_for(lambda: _namespace(servers[0]), 30, "the backend's namespace in the log")
            host, _, port = servers[0].kv_events.publisher.removeprefix("tcp://").rpartition(":")
            relay = Cuttable((host, int(port)))
            tap = Cuttable(("127.0.0.1", servers[1].port), record=True)
            try:
                yield Live(store, servers, ns, relay, tap)
            finally:
                relay.close()
                tap.close()
    finally:
        store.stop()


def _namespace(server) -> str:
    m = re.search(r"hicache_mc: .* namespace (\S+), master", server.log(200_000))
    return m.group(1) if m else ""


def start_conductor(tmp, fleet: Live, tiny_model, port=None) -> ConductorProc:
    """A conductor with both servers: a's events through the relay, b's found in /server_info."""
    c = ConductorProc(tmp, port or free_port(), [
        "--tokenizer", str(tiny_model), "--l3-master", fleet.store.master,
        "--l3-namespace", fleet.namespace]).start(ready=False)
    a, b = fleet.servers
    assert c.admin("POST", "/workers", json={
        "url": a.url, "name": "a", "events": f"tcp://127.0.0.1:{fleet.relay.port}",
        "replay": a.kv_events.replay}).ok
    assert c.admin("POST", "/workers", json={"url": f"http://127.0.0.1:{fleet.tap.port}", "name": "b",
                                             "events": b.kv_events.publisher,
                                             "replay": b.kv_events.replay}).ok
    wait_for(lambda: all(w["healthy"] and w["events"] for w in c.workers().values()), 30,
             "both servers in the rotation with their event streams")
    return c


@pytest.fixture(scope="module")
def conductor(tmp_path_factory, fleet, tiny_model):
    c = start_conductor(tmp_path_factory.mktemp("conductor"), fleet, tiny_model)
    yield c
    c.stop()


def convo(seed: int, turns: int = 0) -> list:
    msgs = [{"role": "system", "content": f"live {seed}"},
            {"role": "user", "content": live.prompt_text(400, seed)}]
    for i in range(turns):
        msgs += [{"role": "assistant", "content": f"answer {i}"}, {"role": "user", "content": f"and {i}?"}]
    return msgs


def chat(c: ConductorProc, messages: list, **kw) -> requests.Response:
    r = c.post("/v1/chat/completions", {"messages": messages, "max_tokens": 4, "temperature": 0, **kw},
               timeout=300)
    assert r.status_code == 200, r.text
    return r


@pytest.fixture(scope="module")
def tok(tiny_model):
    from hicache_mc.conductor.prompts import PromptTokenizer
    return PromptTokenizer(str(tiny_model))


def held(c: ConductorProc, tok, messages: list) -> dict:
    """What the conductor believes each server holds of the conversation's prompt (tokens);
    a server it cannot vouch for (its event stream stalled) holds nothing here."""
    got = c.post("/query", {"token_ids": tok.chat({"messages": messages})}).json()["default"]
    empty = {"longest_matched": 0, "GPU": 0, "CPU": 0, "EXTERNAL": 0}
    return {name: got.get(name, empty) for name in ("a", "b")}


def test_a_chat_streams_through_unchanged(conductor, fleet):
    """The client reads exactly the bytes SGLang wrote (recorded between conductor and b)."""
    assert conductor.admin("DELETE", "/workers/a").status_code == 200      # b answers this one
    try:
        body = {"messages": convo(1), "max_tokens": 12, "temperature": 0, "stream": True}
        with requests.post(conductor.url + "/v1/chat/completions", json=body, stream=True,
                           timeout=300) as r:
            assert r.status_code == 200 and r.headers["X-Conductor-Worker"] == "b", r.text
            got = b"".join(r.iter_content(None))
        sse = [x for tape in fleet.tap.recorded for x in http_bodies(bytes(tape)) if x.startswith(b"data: ")]
        # streamed: many events, if fewer than the 12 tokens (SGLang holds back a token whose
        # text is not complete yet; one run gave 10 events, the role's and [DONE] included)
        assert got in sse and got.endswith(b"data: [DONE]\n\n") and got.count(b"data: ") > 5
    finally:
        a = fleet.by_name["a"]
        assert conductor.admin("POST", "/workers", json={
            "url": a.url, "name": "a", "events": f"tcp://127.0.0.1:{fleet.relay.port}",
            "replay": a.kv_events.replay}).ok
        wait_for(lambda: conductor.workers()["a"]["healthy"], 10, "a back")


def idle(c: ConductorProc) -> bool:
    """Both servers' last load reports show nothing running or waiting."""
    loads = [w["load"] for w in c.workers().values()]
    return all(ld and not ld["running_reqs"] and not ld["waiting_reqs"] for ld in loads)


def test_a_request_goes_to_the_server_holding_its_prefix(conductor, tok):
    holder = chat(conductor, convo(2)).headers["X-Conductor-Worker"]
    # SGLang's own events, hashed from SGLang's own tokens, match the conductor's chain
    wait_for(lambda: held(conductor, tok, convo(2))[holder]["GPU"] >= 20 * PAGE, 30, "the holder's events")
    for turns in (1, 2):
        # the other server can fetch the prefix from the L3, and with a tiny model that costs
        # little: with both idle the holder's GPU pages are the cheapest, and win
        wait_for(lambda: idle(conductor), 30, "both servers idle in their load reports")
        r = chat(conductor, convo(2, turns))
        assert r.headers["X-Conductor-Worker"] == holder
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 20 * PAGE


def test_after_the_holder_evicted_the_prefix_the_l3_serves_it(conductor, fleet, tok):
    holder = chat(conductor, convo(3)).headers["X-Conductor-Worker"]
    full = wait_for(lambda: held(conductor, tok, convo(3))[holder]["GPU"], 30, "the holder's events")
    wait_for(lambda: held(conductor, tok, convo(3))[holder]["EXTERNAL"] >= full, 120, "the prefix in the L3")
    server = fleet.by_name[holder]
    for seed in range(100, 130):                 # fill the holder's GPU and host pools
        server.generate(live.prompt_ids(600, seed), max_new_tokens=1)
        if held(conductor, tok, convo(3))[holder]["CPU"] == 0:
            break
    assert held(conductor, tok, convo(3))[holder]["CPU"] == 0, "the holder still holds the prefix"
    r = conductor.post("/generate", {"text": tok.tok.apply_chat_template(
        convo(3, 1), tokenize=False, add_generation_prompt=True), "sampling_params": {"max_new_tokens": 2}},
        timeout=300)
    assert r.status_code == 200, r.text
    details = r.json()["meta_info"]["cached_tokens_details"]
    assert details["storage"] >= full - PAGE and details["storage_backend"] == "HiCacheMC", details


def test_an_event_gap_is_filled_from_the_replay_endpoint(conductor, fleet, tok):
    fleet.relay.cut()
    a = fleet.by_name["a"]
    ids = tok.chat({"messages": convo(4)})
    a.generate(ids, max_new_tokens=1)               # a computes pages the conductor misses
    fleet.relay.mend()
    wait_for(lambda: held(conductor, tok, convo(4))["a"]["GPU"] >= 20 * PAGE, 30, "the missed events")
    assert conductor.metrics()['hicache_mc_conductor_events_gaps{worker="a"}'] >= 1


def test_a_restarted_conductor_rebuilds_its_index(tmp_path, fleet, tiny_model, tok):
    first = start_conductor(tmp_path, fleet, tiny_model)
    holder = chat(first, convo(5)).headers["X-Conductor-Worker"]
    wait_for(lambda: held(first, tok, convo(5))[holder]["GPU"] > 0, 30, "the holder's events")
    first.kill()
    again = start_conductor(tmp_path, fleet, tiny_model, port=first.port)
    try:
        wait_for(lambda: held(again, tok, convo(5))[holder]["GPU"] > 0, 10,
                 "the index rebuilt from the replay endpoints")
        assert chat(again, convo(5, 1)).headers["X-Conductor-Worker"] == holder
    finally:
        again.stop()


def test_a_server_killed_mid_run(conductor, fleet):
    """Last: b dies while it streams one answer and holds another in its queue. The stream
    ends with an error naming b; the other request, not answered yet, is answered by a; b
    leaves the rotation at once."""
    assert conductor.admin("DELETE", "/workers/a").status_code == 200
    results: dict = {}
    long = {"max_tokens": 2500, "temperature": 0, "ignore_eos": True}

    def stream():
        body = {"messages": convo(60), "stream": True, **long}
        with requests.post(conductor.url + "/v1/chat/completions", json=body, stream=True, timeout=300) as r:
            chunks = r.iter_content(None)
            results["stream"] = [next(chunks)]
            results["stream"] += list(chunks)

    def whole():
        r = requests.post(conductor.url + "/v1/chat/completions", timeout=300,
                          json={"messages": convo(61), **long})
        results["whole"] = (r.status_code, r.headers.get("X-Conductor-Worker"), r.content)
    threads = [threading.Thread(target=stream), threading.Thread(target=whole)]
    # the stream first: b runs whichever it got first, and the other waits in its queue
    # (b's KV pool, 4096 tokens, holds one of them at a time)
    threads[0].start()
    wait_for(lambda: "stream" in results, 120, "b streaming an answer")
    threads[1].start()

    def both_at_b():
        load = fleet.by_name["b"].loads()["loads"][0]
        return load["num_running_reqs"] + load["num_waiting_reqs"] == 2
    wait_for(both_at_b, 120, "b streaming one answer, the other request queued")
    a = fleet.by_name["a"]
    assert conductor.admin("POST", "/workers", json={"url": a.url, "name": "a",
                                                     "events": a.kv_events.publisher,
                                                     "replay": a.kv_events.replay}).ok
    wait_for(lambda: conductor.workers()["a"]["healthy"], 10, "a back in the rotation")
    os.killpg(fleet.by_name["b"].proc.pid, signal.SIGKILL)
    for t in threads:
        t.join()
    last = b"".join(results["stream"]).split(b"data: ")[-1]
    assert b'"error"' in last and b"worker b" in last
    status, worker, body = results["whole"]
    assert (status, worker) == (200, "a") and b'"choices"' in body
    wait_for(lambda: not conductor.workers()["b"]["healthy"], 3.0, "b out of the rotation")
    assert chat(conductor, convo(70)).headers["X-Conductor-Worker"] == "a"
