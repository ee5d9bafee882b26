"""Each baseline router follows its documented rule, on hand-built cases
(benchmarks/fleet/: baselines.py, cache_aware.py, approx_tree.py, dynamo.py)."""
from __future__ import annotations

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from fleet.approx_tree import ApproxTree  # noqa: E402
from fleet.baselines import (LeastLoadRouter, LengthCapRouter, RandomRouter,  # noqa: E402
                             RoundRobinRouter)
from fleet.cache_aware import CacheAwareConfig, SglangCacheAware  # noqa: E402
from fleet.dynamo import DynamoConfig, DynamoKvRouter  # noqa: E402
from fleet.workload import block_hash  # noqa: E402
from hicache_mc.conductor import api  # noqa: E402
from hicache_mc.conductor.perf import PerfModel  # noqa: E402

PT = 512


def spec(name):
    return api.WorkerSpec(name, page_tokens=PT)


def page(i):
    return f"{i + 1:016x}" + "ab" * 24          # distinct in the 16 hex digits events use


def request(rid, pages, tokens=None, slo=None):
    hashes = tuple(page(p) for p in pages)
    return api.Request(str(rid), 0.0, tokens or PT * len(pages), hashes, ttft_slo_s=slo)


def fleet(router, n):
    for i in range(n):
        router.add_worker(spec(f"w{i}"))
    return router


def load(router, worker, n, start=1000):
    """Put ``n`` requests in flight on ``worker`` (routed there by hand)."""
    for i in range(n):
        router.send(request(start + i, [start + i]), worker)


def finish(router, rid, worker="w0"):
    router.observe_finished(api.Finished(worker, str(rid), 0.0, PT, 1, {}, 0.1))


# -- cache-blind ------------------------------------------------------------------------------

def test_round_robin_cycles_and_random_is_seeded():
    rr = fleet(RoundRobinRouter(), 3)
    assert [rr.route(request(i, [i]), 0.0).worker for i in range(4)] == ["w0", "w1", "w2", "w0"]
    picks = [[fleet(RandomRouter(seed=5), 4).route(request(i, [i]), 0).worker for i in range(1)]
             for _ in range(2)]
    assert picks[0] == picks[1]


def test_least_load_picks_fewest_in_flight_and_rotates_ties():
    ll = fleet(LeastLoadRouter(), 3)
    load(ll, "w0", 2)
    load(ll, "w2", 1, start=2000)
    assert ll.route(request(1, [1]), 0.0).worker == "w1"
    finish(ll, 1000, "w0")
    finish(ll, 1001, "w0")                        # now 0 / 1 / 1
    assert ll.route(request(2, [2]), 0.0).worker == "w0"
    even = fleet(LeastLoadRouter(), 3)            # all idle: ties spread over the fleet
    assert {even.route(request(i, [i]), 0.0).worker for i in range(3)} == {"w0", "w1", "w2"}


def test_length_cap_rejects_cold_work_past_the_slo_and_releases_at_first_token():
    perf = PerfModel()
    cap = fleet(LengthCapRouter(perf, slack=1.0), 1)
    one = perf.prefill_s(8 * PT)
    slo = 2.5 * one                               # room for two such prompts, not three
    assert isinstance(cap.route(request(1, range(8), slo=slo), 0.0), api.Decision)
    assert isinstance(cap.route(request(2, range(8), slo=slo), 0.0), api.Decision)
    third = cap.route(request(3, range(8), slo=slo), 0.0)
    assert isinstance(third, api.Rejection) and third.reason is api.RejectReason.TTFT_SLO
    cap.observe_started(api.Started("w0", "1", 0.1))
    assert isinstance(cap.route(request(4, range(8), slo=slo), 0.0), api.Decision)


# -- SGLang cache_aware -----------------------------------------------------------------------

def cache_aware(n=2, **kw):
    return fleet(SglangCacheAware(CacheAwareConfig(**kw)), n)


def test_cache_aware_follows_a_match_over_the_threshold():
    ca = cache_aware()
    assert ca.route(request(1, [1, 2, 3, 4]), 0.0).worker == "w0"     # empty trees: w0
    assert ca.route(request(2, [9]), 0.0).worker == "w1"              # smallest tree now
    # 3 of 5 pages matched on w0: 0.6 > 0.5
    assert ca.route(request(3, [1, 2, 3, 7, 8]), 0.0).worker == "w0"


def test_cache_aware_threshold_is_strict_half_goes_to_the_smallest_tree():
    ca = cache_aware()
    ca.route(request(1, [1, 2, 3, 4]), 0.0)                            # w0: 4 pages
    ca.route(request(2, [20, 21, 22, 23, 24, 25]), 0.0)                # w1: 6 pages
    # exactly half of the tokens matched on w1: not > 0.5, so the smallest tree (w0)
    assert ca.route(request(3, [20, 21, 22, 30, 31, 32]), 0.0).worker == "w0"
    # the match share counts tokens: a short last page tips it over the threshold
    assert ca.route(request(4, [20, 21, 22, 40], tokens=3 * PT + 100), 0.0).worker == "w1"


def test_cache_aware_balances_only_past_both_thresholds():
    ca = cache_aware()                             # abs 32, rel 1.5
    ca.route(request(1, [1, 2]), 0.0)             # w0 holds the prefix, 1 in flight
    load(ca, "w0", 32)                            # 33 vs 0: abs 33 > 32, 33 > 1.5 x 0
    assert ca.route(request(2, [1, 2, 3]), 0.0).worker == "w1"        # imbalanced: least load
    ca2 = cache_aware()
    ca2.route(request(1, [1, 2]), 0.0)
    load(ca2, "w0", 31)                           # 32 vs 0: abs not exceeded
    assert ca2.route(request(2, [1, 2, 3]), 0.0).worker == "w0"       # cache wins
    ca3 = cache_aware()
    ca3.route(request(1, [1, 2]), 0.0)
    load(ca3, "w0", 99)                           # 100 ...
    load(ca3, "w1", 67, start=5000)               # ... vs 67: abs 33 > 32 but 100 < 1.5 x 67
    assert ca3.route(request(2, [1, 2, 3]), 0.0).worker == "w0"


def test_cache_aware_builds_its_tree_from_its_own_routing_not_from_events():
    ca = cache_aware()
    ca.observe_events([api.BlocksStored("w1", api.Tier.GPU, [block_hash(page(1))])])
    ca.route(request(1, [50]), 0.0)               # w0 (empty trees)
    assert ca.route(request(2, [1, 2]), 0.0).worker == "w1"   # smallest tree: no match at all
    assert ca.tree.match([page(1)]).tenant == "w1"             # because it routed it there


def test_approx_tree_evicts_least_recently_used_leaves_past_its_size():
    t = ApproxTree()
    t.insert([page(1), page(2), page(3)], "w0", now=1.0)
    t.insert([page(1), page(4)], "w0", now=2.0)
    t.insert([page(1), page(2)], "w1", now=3.0)
    assert t.size == {"w0": 4, "w1": 2}
    assert t.evict(2) == 2                        # w0: page 3 (oldest leaf), then page 2
    assert t.size["w0"] == 2 and t.match([page(1), page(4)]) == (2, "w0")
    assert t.match([page(1), page(2), page(3)]) == (2, "w1")   # 3 is gone, 2 is w1's


# -- Dynamo ------------------------------------------------------------------------------------

def dynamo(l3_pages=0, n=2, **kw):
    return fleet(DynamoKvRouter(lambda hashes: l3_pages, DynamoConfig(**kw)), n)


def stored(router, worker, tier, pages):
    router.observe_events([api.BlocksStored(worker, tier, [block_hash(page(p)) for p in pages])])


def test_dynamo_cost_hand_computed():
    r = dynamo(l3_pages=6)
    stored(r, "w0", api.Tier.GPU, [1, 2, 3, 4])
    stored(r, "w1", api.Tier.HOST, [1, 2, 3, 4, 5])
    blocks = [block_hash(page(p)) for p in range(1, 11)]
    # w0: 4 device + 2 more from the shared pool: 4 x 1.0 + 2 x 0.5 = 5
    assert r.credit("w0", blocks, 6) == pytest.approx(5.0)
    # w1: 5 host + 1 from the pool: 5 x 0.75 + 1 x 0.5 = 4.25
    assert r.credit("w1", blocks, 6) == pytest.approx(4.25)
    # cost = (0 + 10 - credit) + (0 + 10): w0 15 < w1 15.75
    assert r.route(request(1, range(1, 11)), 0.0).worker == "w0"
    # w0 now carries 5 prefill blocks and 10 active ones: 5 + 5 + 10 + 10 = 30 vs 15.75
    assert r.route(request(2, range(1, 11)), 0.0).worker == "w1"


def test_dynamo_releases_prefill_at_first_token_and_decode_at_the_end():
    r = dynamo()
    r.route(request(1, range(1, 5)), 0.0)
    w = r._sent["1"]
    assert r.prefill[w] == 4 and len(r.active[w]) == 4
    r.observe_started(api.Started(w, "1", 0.1))
    assert r.prefill[w] == 0 and len(r.active[w]) == 4
    r.observe_finished(api.Finished(w, "1", 0.2, 4 * PT, 1, {}, 0.1))
    assert r.active[w] == {} and r.inflight[w] == 0


def test_dynamo_removed_blocks_lose_their_credit():
    r = dynamo()
    stored(r, "w1", api.Tier.GPU, [1, 2, 3])
    r.observe_events([api.BlocksRemoved("w1", api.Tier.GPU, [block_hash(page(3))])])
    assert r.credit("w1", [block_hash(page(p)) for p in (1, 2, 3)], 0) == 2.0


def test_the_control_takes_its_slack_by_name():
    from fleet import policies
    assert policies.get("least_load+cap@1.5")(None, PerfModel(), 0).slack == 1.5
    assert policies.get("least_load+cap")(None, PerfModel(), 0).slack == 1.0
    with pytest.raises(KeyError):
        policies.get("dynamo@2")
