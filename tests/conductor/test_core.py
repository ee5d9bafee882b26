"""The Conductor's decisions, computed by hand: pull vs recompute, an idle worker vs the one
holding the prefix, SLO rejections (early and predictive), PD placement, and the degeneration
to least-load when every cache is empty."""
from __future__ import annotations

import hashlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache_mc.conductor.api import (BlocksStored, Decision, Finished, LoadReport, RejectReason,
                                      Rejection, Request, Role, Started, Tier, WorkerSpec)
from hicache_mc.conductor.chain import block_hash
from hicache_mc.conductor.core import Admission, Conductor, ConductorConfig

PT = 100                       # tokens per page
# Prefill: 1 ms per new token, nothing else. Decode: 10 ms + 10 ms per request in the batch.
LINEAR = dict(prefill_prior=(0.0, 1.0, 0.0), decode_prior=(0.01, 0.01, 0.0))


def spec(name, role=Role.BOTH, l3_bw=1e8):
    # a 1 MB page: 1 ms from L2 (1 GB/s), 10 ms from L3 (100 MB/s) plus its 1 ms from L2
    return WorkerSpec(name, role, page_tokens=PT, page_bytes=1_000_000, host_bw=1e9, l3_bw=l3_bw)


def pages(n, salt="p"):
    return [hashlib.sha256(f"{salt}{i}".encode()).hexdigest() for i in range(n)]


def request(rid, prompt=1000, chain=None, **kw):
    return Request(rid, 0.0, prompt, chain if chain is not None else pages(prompt // PT), **kw)


class L3:
    """The shared pool: a set of page hashes; a lookup is the chain's leading run in it."""

    def __init__(self, held=()):
        self.held = set(held)

    def __call__(self, hashes):
        return next((i for i, h in enumerate(hashes) if h not in self.held), len(hashes))


def conductor(specs, l3=(), **cfg):
    c = Conductor(L3(l3), ConductorConfig(**{**LINEAR, **cfg}))
    for s in specs:
        c.add_worker(s)
    return c


def hold(c, worker, tier, chain, n):
    c.observe_events([BlocksStored(worker, tier, [block_hash(h) for h in chain[:n]])])


def test_an_idle_worker_pulls_from_the_pool_rather_than_queue_behind_the_prefix():
    c = conductor([spec("a"), spec("b")], l3=pages(10))
    busy = c.route(request("busy", prompt=2000, chain=pages(20, "x")), 0.0).worker   # 2 s of work
    idle = ({"a", "b"} - {busy}).pop()
    hold(c, busy, Tier.GPU, pages(10), 10)
    preds = {p.worker: p for p in c.predict(request("r"), 0.0)}
    # the busy worker: 2 s of queue, then 100 new tokens after its 9 cached pages (the 10th
    # page is recomputed: SGLang computes at least the last token)
    assert preds[busy].queue_s == pytest.approx(2.0) and preds[busy].pages == {Tier.GPU: 9}
    assert preds[busy].ttft_s == pytest.approx(2.0 + 0.1)
    # the idle one: 9 pages from L3 at 11 ms each, then the same 100 tokens
    assert preds[idle].pages == {Tier.L3: 9} and preds[idle].fetch_s == pytest.approx(0.099)
    assert preds[idle].ttft_s == pytest.approx(0.099 + 0.1)
    d = c.route(request("r"), 0.0)
    assert isinstance(d, Decision) and d.worker == idle


def test_recomputing_beats_a_slow_fetch():
    c = conductor([spec("a", l3_bw=1e7)], l3=pages(10))   # 101 ms a page vs 100 ms to compute it
    hold(c, "a", Tier.HOST, pages(10), 4)
    p = c.route(request("r"), 0.0).prediction
    # 4 pages from L2 at 1 ms beat their 100 ms of compute; 5 L3 pages at 101 ms do not
    assert p.pages == {Tier.HOST: 4} and p.recompute_pages == 5
    assert p.fetch_s == pytest.approx(0.004) and p.prefill_s == pytest.approx(0.6)


def test_the_l3_prefetch_runs_under_the_queue_so_a_queued_worker_pulls():
    """SGLang prefetches L3 pages into L2 while the request waits: the same slow pool that an
    idle worker should not use (101 ms a page > 100 ms of compute) is free behind a queue."""
    c = conductor([spec("a", l3_bw=1e7)], l3=pages(10))
    c.route(request("busy", prompt=2000, chain=pages(20, "x")), 0.0)      # 2 s queue
    p = c.predict(request("r"), 0.0)[0]
    assert p.queue_s == pytest.approx(2.0) and p.pages == {Tier.L3: 9}
    # 9 x 100 ms of prefetch hide under the 2 s; the 9 ms L2 -> L1 load and 100 tokens remain
    assert p.fetch_s == pytest.approx(0.009) and p.ttft_s == pytest.approx(2.0 + 0.009 + 0.1)


def test_the_ttft_slo_forces_a_rejection_with_tolerance():
    c = conductor([spec("a")], admission=Admission.EARLY, ttft_slo_s=0.5, slo_tolerance=0.1)
    r = c.route(request("r"), 0.0)                      # 1.0 s of prefill > 0.55 s
    assert isinstance(r, Rejection) and r.reason is RejectReason.TTFT_SLO
    assert r.retry_after_s == pytest.approx(0.45) and r.prediction.ttft_s == pytest.approx(1.0)
    at_slo = c.route(request("s", ttft_slo_s=1.0), 0.0)  # exactly at its own SLO: admitted
    assert isinstance(at_slo, Decision)
    assert isinstance(conductor([spec("a")], ttft_slo_s=0.5).route(request("r"), 0.0), Decision)


def start_running(c, n, now=0.0, out=10):
    for i in range(n):
        d = c.route(request(f"run{i}", prompt=100, max_new_tokens=out, tbt_slo_s=1.0), now)
        c.observe_started(Started(d.worker, f"run{i}", now))


def test_early_rejects_on_the_decode_batch_now_predictive_on_the_one_to_come():
    # 5 running requests of 10 tokens: TBT now 0.01 + 0.01 * 6 = 70 ms > 55 ms; they are done
    # in 10 x 60 ms, long before the new request's 1 s prefill ends
    early = conductor([spec("a")], admission=Admission.EARLY, tbt_slo_s=0.05, ttft_slo_s=10)
    start_running(early, 5)
    r = early.route(request("r"), 0.0)
    assert isinstance(r, Rejection) and r.reason is RejectReason.TBT_SLO
    assert r.prediction.tbt_s == pytest.approx(0.07)
    pred = conductor([spec("a")], admission=Admission.PREDICTIVE, tbt_slo_s=0.05, ttft_slo_s=10)
    start_running(pred, 5)
    d = pred.route(request("r"), 0.0)
    assert isinstance(d, Decision) and d.prediction.tbt_s == pytest.approx(0.02)


def test_pd_picks_the_lightest_decode_worker_and_rejects_when_none_fits():
    c = conductor([spec("p1", Role.PREFILL), spec("d1", Role.DECODE), spec("d2", Role.DECODE)],
                  admission=Admission.EARLY, tbt_slo_s=0.05, ttft_slo_s=10)
    loads = {"d1": 0, "d2": 0}
    for i in range(3):
        d = c.route(request(f"x{i}", prompt=100), 0.0)
        assert d.worker == "p1"
        loads[d.decode_worker] += 1
        c.observe_started(Started("p1", f"x{i}", 0.0))
    assert sorted(loads.values()) == [1, 2]             # each went to the smaller batch
    d = c.route(request("r"), 0.0)
    assert d.decode_worker == min(loads, key=loads.get)
    assert d.prediction.tbt_s == pytest.approx(0.01 + 0.01 * (1 + 1))
    for i in range(10):                                 # their own SLO admits them
        assert isinstance(c.route(request(f"y{i}", prompt=100, tbt_slo_s=1.0), 0.0), Decision)
        c.observe_started(Started("p1", f"y{i}", 0.0))
    r = c.route(request("z"), 0.0)
    assert isinstance(r, Rejection) and r.reason is RejectReason.TBT_SLO
    assert isinstance(conductor([spec("p1", Role.PREFILL)]).route(request("r"), 0.0), Rejection)


def test_a_finished_request_retires_its_work_and_feeds_the_fit():
    c = conductor([spec("a")])
    d = c.route(request("r"), 0.0)
    assert c.predict(request("q"), 0.0)[0].queue_s == pytest.approx(1.0)
    c.observe_started(Started("a", "r", 0.5))
    c.observe_finished(Finished("a", "r", 1.0, 1000, 11, {Tier.GPU: 0}, ttft_s=0.5, prefill_s=0.5))
    assert c.predict(request("q"), 1.0)[0].queue_s == 0.0
    assert c.prefill_model.fit.samples == 1 and c.decode_model.fit.samples == 1
    assert c.prefill_model.predict(1000, 0) < d.prediction.prefill_s


def test_a_load_report_adds_the_load_this_router_did_not_send():
    c = conductor([spec("a"), spec("b")])
    c.route(request("r", prompt=1000), 0.0)            # a: 1 s; seconds per prompt token 1 ms
    c.observe_load(LoadReport("b", 0.0, waiting_reqs=3, waiting_tokens=3000))
    q = {p.worker: p.queue_s for p in c.predict(request("q"), 0.5)}
    assert q == pytest.approx({"a": 0.5, "b": 2.5})


OPS = st.lists(st.tuples(st.sampled_from(["route", "start", "finish", "report", "tick"]),
                         st.integers(1, 40), st.integers(0, 3)), max_size=60)


@settings(max_examples=150, deadline=None)
@given(OPS, st.sampled_from([0.0, 0.5]), st.integers(2, 5), st.booleans())
def test_with_every_cache_empty_the_choice_is_least_load(ops, work_weight, n, triage):
    """No events, no L3, no prefix shared with a request in flight: the scores differ by the
    queue alone, so the choice is the worker with the least predicted queue. Triage, which
    sends a request the queues make late everywhere to the longest queue (tested below), is
    on with SLOs no request misses, off with the default SLO."""
    c = Conductor(None, ConductorConfig(work_weight=work_weight, triage=triage,
                                        ttft_slo_s=1e6 if triage else 2.0))
    names = [f"w{i}" for i in range(n)]
    for w in names:
        c.add_worker(spec(w))
    now, sent, started = 0.0, [], []
    for k, (op, size, pick) in enumerate(ops):
        if op == "route":
            req = request(f"r{k}", prompt=size * PT, chain=pages(size, f"r{k}:"))
            preds = c.predict(req, now)
            d = c.route(req, now)
            least = min(p.queue_s for p in preds)
            assert d.prediction.queue_s == pytest.approx(least)
            assert len({round(p.prefill_s + p.fetch_s, 9) for p in preds}) == 1
            sent.append((d.worker, f"r{k}"))
        elif op == "start" and sent:
            w, rid = sent.pop(pick % len(sent))
            c.observe_started(Started(w, rid, now))
            started.append((w, rid))
        elif op == "finish" and started:
            w, rid = started.pop(pick % len(started))
            c.observe_finished(Finished(w, rid, now, size * PT, 5, {}, ttft_s=0.3))
        elif op == "report":
            c.observe_load(LoadReport(names[pick % n], now, waiting_tokens=size * 50))
        else:
            now += size / 20



def test_a_request_late_everywhere_goes_to_the_longest_queue():
    """Admission off, SLO 1 s. a is 2 s deep, b 3 s: a new request is late on either (2.1 s
    at best), so it goes behind b's longer queue, where it holds up no request that could
    still be on time. Without triage the best TTFT wins, as in Algorithm 1."""
    for triage, expect in ((True, "b"), (False, "a")):
        c = conductor([spec("a"), spec("b")], ttft_slo_s=1.0, triage=triage, inflight=False)
        c.route(request("qa", prompt=2000, chain=pages(20, "qa"), ttft_slo_s=9.0), 0.0)
        c.route(request("qb", prompt=3000, chain=pages(30, "qb"), ttft_slo_s=9.0), 0.0)
        d = c.route(request("r", prompt=100, chain=pages(1, "r")), 0.0)
        assert isinstance(d, Decision) and d.worker == expect and d.late is triage
        assert d.prediction.queue_s == pytest.approx(3.0 if triage else 2.0)


def test_a_request_predicted_on_time_or_under_half_its_slo_keeps_its_best_worker():
    """One worker is 3 s deep, the other idle, SLO 1 s. 0.8 s on the idle one meets the SLO:
    it goes there. With recent TTFTs 10x their predictions, 0.3 s is judged (0.3 + 0.1) x 10
    - 0.1 = 3.9 s, late; but a prediction under half the SLO is trusted: the idle one again.
    0.6 s is judged late and not trusted: the busy one."""
    for prompt, error, to_busy in ((800, 1.0, False), (300, 10.0, False), (600, 10.0, True)):
        c = conductor([spec("a"), spec("b")], ttft_slo_s=1.0, inflight=False)
        busy = c.route(request("q", prompt=3000, chain=pages(30, "q"), ttft_slo_s=9.0), 0.0).worker
        c.gate.error = error
        d = c.route(request("r", prompt=prompt, chain=pages(prompt // PT, "r")), 0.0)
        assert (d.worker == busy) is to_busy and d.late is to_busy


def test_a_request_too_long_for_its_slo_even_on_an_idle_worker_is_not_triaged():
    """Triage is for requests the queues make late. A 1,500-token prompt takes 1.5 s on an
    idle worker, past its 1 s SLO whatever the router does: it keeps its best worker (the
    idle one) instead of joining the 3 s queue."""
    c = conductor([spec("a"), spec("b")], ttft_slo_s=1.0, inflight=False)
    busy = c.route(request("q", prompt=3000, chain=pages(30, "q"), ttft_slo_s=9.0), 0.0).worker
    d = c.route(request("r", prompt=1500, chain=pages(15, "r")), 0.0)
    assert d.worker != busy and not d.late


def test_a_request_on_time_on_some_worker_is_not_triaged_though_another_scores_better():
    """SLO 1.15 s. a holds the 6-page prefix behind a 1.2 s queue (1.201 s); b has no cache and
    a 0.5 s queue (1.101 s: on time); c is 3 s deep. The work term makes a score best, yet
    the request is on time on b: it is not late everywhere, and stays off c's queue."""
    from hicache_mc.conductor.api import LoadReport
    c = conductor([spec("a"), spec("b"), spec("c")], ttft_slo_s=1.15, inflight=False)
    chain = pages(6, "r")
    hold(c, "a", Tier.GPU, chain, 6)
    for w, tokens in (("a", 1200), ("b", 500), ("c", 3000)):
        c.observe_load(LoadReport(w, 0.0, waiting_tokens=tokens))
    ttft = {p.worker: p.ttft_s for p in c.predict(request("r", prompt=601, chain=chain), 0.0)}
    assert ttft == pytest.approx({"a": 1.201, "b": 1.101, "c": 3.601})
    d = c.route(request("r", prompt=601, chain=chain), 0.0)
    assert d.worker != "c" and not d.late


def test_an_unknown_ttft_teaches_neither_the_gate_nor_the_queue_scale():
    """A non-streamed answer without SGLang's timing has no TTFT (NaN): the gate's error and
    the queue calibration ignore it, so admission still refuses a request 5x over its SLO."""
    import math
    c = conductor([spec("a")], inflight=False, admission=Admission.EARLY, ttft_slo_s=9.0,
                  error_quantile=0.95)
    for i in range(70):
        c.observe_load(LoadReport("a", float(i), waiting_tokens=2000))
        d = c.route(request(f"r{i}", prompt=1000, chain=pages(10, f"r{i}")), float(i))
        assert isinstance(d, Decision)
        c.observe_finished(Finished("a", f"r{i}", i + 1.0, 1000, 10, {}, math.nan, ok=True))
    assert c.gate.error == 1.0 and c.queue_scale == 1.0
    r = c.route(request("late", prompt=5000, chain=pages(50, "late"), ttft_slo_s=1.0), 80.0)
    assert isinstance(r, Rejection)


def test_the_servers_settings_reach_the_core():
    """``triage = false`` (and the gate's settings) in the conductor's config file reach the
    core the server builds."""
    from hicache_mc.conductor.server import make_router
    from hicache_mc.config import ConductorServerConfig
    for triage in (True, False):
        core = make_router(ConductorServerConfig(triage=triage, admission="early", work_weight=1.0),
                           None)
        assert core.config.triage is triage and core.config.admission is Admission.EARLY
        assert core.config.work_weight == 1.0
