"""The queue model beyond one report: in-flight prefixes, room in the GPU pool, calibration,
and the work term, each hand-computed."""
from __future__ import annotations

import pytest

from hicache_mc.conductor.api import Finished, Request, Started, Tier, WorkerSpec
from hicache_mc.conductor.load import InFlight, WorkerLoad
from hicache_mc.conductor.pending import STRIDE, PendingIndex

from test_core import PT, conductor, hold, pages, request, spec


def test_pending_prefixes_count_requests_and_lead_per_worker():
    p = PendingIndex()
    for w in ("a", "b"):
        p.add_worker(w)
    chain = list(range(100, 200))
    p.add("a", chain[:3])
    p.add("a", chain[:2])
    p.add("b", chain[:80])
    # a's whole requests are the chain's prefix: exact; b's 80 pages too
    assert p.lookup(chain) == {"a": 3, "b": 80}
    # a chain that leaves b's request after 70 pages: the last kept page it holds is the 64th
    fork = chain[:70] + [7, 8, 9]
    assert p.lookup(fork) == {"a": 3, "b": 2 * STRIDE}
    p.remove("a", chain[:3])
    assert p.lookup(chain) == {"a": 2, "b": 80}     # the second request still holds 2 pages
    p.remove("a", chain[:2])
    p.remove("b", chain[:80])
    assert p.lookup(chain) == {} and len(p) == 0
    p.add("b", [5])
    p.remove_worker("b")
    assert p.lookup([5]) == {} and len(p) == 0


def test_a_turn_follows_its_queued_parent_instead_of_recomputing_elsewhere():
    """The parent (1,001 tokens: 10 whole pages) is still queued on a; b is as busy with
    something else. The child shares the parent's 10 pages: on a they are in L1 by its turn
    (FCFS); on b nothing has them (no event yet, not in the L3)."""
    chain = pages(20)
    for inflight in (True, False):
        c = conductor([spec("a"), spec("b")], inflight=inflight, ttft_slo_s=10.0)   # none late
        assert c.route(request("parent", prompt=1001, chain=chain[:10]), 0.0).worker == "a"
        assert c.route(request("other", prompt=1000, chain=pages(10, "o")), 0.0).worker == "b"
        preds = {p.worker: p for p in c.predict(request("child", prompt=2000, chain=chain), 0.0)}
        assert preds["b"].ttft_s == pytest.approx(1.0 + 2.0) and preds["b"].pages == {}
        if inflight:
            assert preds["a"].pages == {Tier.GPU: 10}
            assert preds["a"].ttft_s == pytest.approx(1.001 + 1.0)
        else:
            assert preds["a"].ttft_s == pytest.approx(1.001 + 2.0)
        child = c.route(request("child", prompt=2000, chain=chain), 0.0).worker
        assert child == ("a" if inflight else "b")
        for rid, w in (("parent", "a"), ("other", "b"), ("child", child)):
            c.observe_finished(Finished(w, rid, 3.0, 1000, 1, {}, ttft_s=1.0))
        assert len(c.pending) == 0          # what a request left in flight goes with it


def test_room_in_the_gpu_pool_bounds_the_queue():
    """A 10,000-token pool; running: 4,000 + 1,000 out, ending at 1 s (100 tokens x 10 ms
    after its first token at 0) and 3,000 + 1,000 ending at 3 s. A 3,000-token request with
    1,000 out needs 1,000 more than the 2,000 free: it waits for the first end."""
    w = WorkerLoad(capacity_tokens=10_000)
    for rid, prompt, out, start in (("x", 4000, 1000, -9.0), ("y", 3000, 1000, -7.0)):
        w.dispatch(InFlight(rid, start, prompt, 0.0, out), start)
        w.started(rid, start, w.decode(start))
    assert w.room_wait_s(0.0, 1000, 0.01) == 0.0                  # fits in the 2,000 free
    assert w.room_wait_s(0.0, 4000, 0.01) == pytest.approx(1.0)   # x ends at -9 + 1000 x 10 ms
    assert w.room_wait_s(0.0, 8000, 0.01) == pytest.approx(3.0)   # both must end
    w.finished("x")
    assert w.room_wait_s(0.0, 4000, 0.01) == 0.0
    assert WorkerLoad().room_wait_s(0.0, 10**9, 0.01) == 0.0        # pool size unknown


def test_a_full_pool_makes_the_worker_wait_in_its_predicted_queue():
    c = conductor([WorkerSpec("a", page_tokens=PT, page_bytes=1, host_bw=1e9, l3_bw=1e9,
                              l1_pages=50)], out_tokens=100)      # a 5,000-token pool
    d = c.route(request("big", prompt=4000, chain=pages(40, "big")), 0.0)
    c.observe_started(Started(d.worker, "big", 4.0))             # 4,100 held until ~5 s
    p = c.predict(request("r", prompt=1000, chain=pages(10, "r")), 4.0)[0]
    # 4,100 + 1,100 > 5,000: wait for "big", 100 tokens x the decode prior (10 + 10 ms)
    assert p.queue_s == pytest.approx(100 * 0.02)


def test_calibration_scales_queues_to_the_waits_requests_met():
    c = conductor([spec("a")])
    for k in range(100):
        rid = f"r{k}"
        c.route(request("busy" + rid, prompt=1000, chain=pages(10, "b" + rid)), 0.0)
        c.route(request(rid, prompt=1000, chain=pages(10, rid)), 0.0)   # queued 1 s
        c.observe_finished(Finished("a", "busy" + rid, 1.0, 1000, 1, {}, ttft_s=1.0, prefill_s=1.0))
        # it waited 2 s, not 1
        c.observe_finished(Finished("a", rid, 3.0, 1000, 1, {}, ttft_s=3.0, prefill_s=1.0))
    assert c.queue_scale == pytest.approx(2.0, rel=0.01)
    c.route(request("q0", prompt=1000, chain=pages(10, "q0")), 0.0)
    assert c.predict(request("q1", prompt=1000, chain=pages(10, "q1")), 0.0)[0].queue_s == \
        pytest.approx(2.0, rel=0.01)


def test_the_work_term_keeps_a_request_where_it_costs_less_once_queues_form():
    """a holds the prefix (0.1 s of work) behind a 1.5 s queue; b is 1 s deep and would
    recompute it (1 s of work): TTFT 1.6 s on a vs 2.0 s on b; Algorithm 1 takes a. With b
    only 0.5 s deep, the TTFTs are 1.6 vs 1.5 and Algorithm 1 takes b, while the work term
    (queue / mean work x work) keeps it on a, where it delays the queue behind less."""
    for b_queue, ww, expect in ((1000, 0.0, "a"), (500, 0.0, "b"), (500, 1.0, "a")):
        c = conductor([spec("a"), spec("b")], work_weight=ww, inflight=False)
        hold(c, "a", Tier.GPU, pages(10), 10)
        c.route(request("qa", prompt=1500, chain=pages(15, "qa")), 0.0)
        c.route(request("qb", prompt=b_queue, chain=pages(b_queue // PT, "qb")), 0.0)
        q = {p.worker: p.queue_s for p in c.predict(request("r"), 0.0)}
        assert q == pytest.approx({"a": 1.5, "b": b_queue / 1000})
        assert c.route(request("r"), 0.0).worker == expect
