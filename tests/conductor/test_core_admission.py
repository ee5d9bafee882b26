"""Admission beyond one request: the cascade memory, and the gate's limits."""
from __future__ import annotations

import pytest

from hicache_mc.conductor.admission import Admission, Gate
from hicache_mc.conductor.api import Decision, Prediction, Rejection, Request, Tier
from hicache_mc.conductor.chain import block_hash

from test_core import conductor, hold, pages, request, spec


def test_limits_take_the_requests_slo_and_the_tolerance():
    g = Gate(Admission.EARLY, -0.2, 1.0, ttft_slo_s=2.0, tbt_slo_s=0.1)
    assert g.limits(Request("r", 0, 1, [])) == pytest.approx((1.6, 0.08, 1.0))
    assert g.limits(Request("r", 0, 1, [], ttft_slo_s=5.0), 1.0) == pytest.approx((10.0, 0.2, 1.0))
    ok = Prediction("w", 1.5, 0, 0, 1.5, tbt_s=0.05)
    assert g.limits(Request("r", 0, 1, [])).met(ok)
    assert not g.limits(Request("r", 0, 1, [])).met(Prediction("w", 1.7, 0, 0, 1.7))


def test_ttfts_are_judged_at_a_quantile_of_the_measured_errors():
    """Requests took 2x, 3x their predictions (with the 0.1 s floor): at the 0.5 quantile a
    0.9 s prediction is judged as (0.9 + 0.1) x 3 - 0.1 = 2.9 s."""
    g = Gate(Admission.EARLY, 0.0, 1.0, ttft_slo_s=2.0, tbt_slo_s=0.1, quantile=0.5)
    for k in range(64):
        predicted = 0.4
        g.observe(predicted, (predicted + 0.1) * (2 if k % 2 else 3) - 0.1)
    limits = g.limits(Request("r", 0, 1, []))
    assert limits.error == pytest.approx(3.0)
    assert not limits.met(Prediction("w", 0.9, 0, 0, 0.9))
    assert limits.met(Prediction("w", 0.55, 0, 0, 0.55))            # 1.95 s
    assert Gate(Admission.EARLY, 0.0, 1.0, 2.0, 0.1).limits(Request("r", 0, 1, [])).error == 1.0


def test_a_turn_after_a_rejected_one_gets_the_cascade_margin():
    """SLO 1 s, tolerance 0, cascade tolerance 1: a turn is judged at 2 s when it continues a
    rejected prompt's uncached pages, at 1 s otherwise."""
    c = conductor([spec("a")], admission=Admission.EARLY, slo_tolerance=0.0,
                  cascade_tolerance=1.0, ttft_slo_s=1.0, error_quantile=0.0)
    chain = pages(30)
    first = c.route(request("t1", prompt=1500, chain=chain[:15]), 0.0)       # 1.5 s > 1 s
    assert isinstance(first, Rejection)
    # the next turn: 1.5 s of compute too, its first 14 pages are the rejected turn's
    second = c.route(request("t2", prompt=1500, chain=chain[:15]), 0.0)
    assert isinstance(second, Decision)
    assert c.gate.cascades_admitted == 1
    # the margin is spent: the conversation's page is forgotten once admitted
    third = c.route(request("t3", prompt=1501, chain=chain[:15]), 0.0)
    assert isinstance(third, Rejection)
    # another conversation gets no margin
    assert isinstance(c.route(request("x", prompt=1500, chain=pages(15, "x")), 0.0), Rejection)
    # and nothing beyond the margin: 2.5 s > 2 s
    assert isinstance(c.route(request("y1", prompt=2500, chain=pages(25, "y")), 0.0), Rejection)
    assert isinstance(c.route(request("y2", prompt=2600, chain=pages(26, "y")), 0.0), Rejection)


def test_a_rejected_prompt_held_by_a_cache_is_not_remembered():
    """Its last page is cached somewhere (a shared prefix): a page others share says nothing
    about a conversation, so it earns no margin."""
    c = conductor([spec("a")], admission=Admission.EARLY, slo_tolerance=0.0,
                  cascade_tolerance=1.0, ttft_slo_s=0.2)
    hold(c, "a", Tier.GPU, pages(10), 10)
    busy = c.route(request("busy", prompt=1000, chain=pages(10, "q"), ttft_slo_s=9.0), 0.0)
    assert isinstance(busy, Decision)                                        # 1 s of queue
    assert isinstance(c.route(request("r", prompt=1001), 0.0), Rejection)   # all 10 cached
    assert c.gate.continued([block_hash(h) for h in pages(10)]) is None


def test_the_memory_is_bounded():
    g = Gate(Admission.EARLY, 0.0, 1.0, 1.0, 0.1, memory=3)
    for page in range(10):
        g.remember(page)
    assert g.continued([0, 1, 2, 3, 4, 5, 6]) is None
    assert g.continued([7, 100]) == 7 and g.continued([9]) == 9
