"""The fleet benchmark end to end on a few hundred requests: knee search, a sweep of several
policies with and without the shared L3, the targets and the plot
(benchmarks/replay_fleet.py, benchmarks/fleet/); and our agent workload's format."""
from __future__ import annotations

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from fleet import agents, plots, sweep, targets, workload  # noqa: E402
from fleet.sim import FleetConfig  # noqa: E402
from fleet.workload import Workload  # noqa: E402
from hicache_mc.conductor.perf import PerfModel  # noqa: E402

PERF = PerfModel()


def test_tiny_sweep_end_to_end(tmp_path):
    wl = Workload(workload.spread(workload.load(limit=250)))
    fleet = FleetConfig(instances=4, l3_pages=wl.distinct_blocks // 2)
    knee = sweep.find_knee(wl, fleet, seed=0, perf=PERF, iters=3)
    below = [a for load, a in knee.probes.items() if load < knee.load]
    above = [a for load, a in knee.probes.items() if load > knee.load]
    assert below and above
    assert min(below) >= sweep.KNEE_ATTAINMENT > max(above)

    names = ["least_load", "least_load+cap", "cache_aware", "dynamo"]
    loads = [round(knee.load * f, 4) for f in (0.5, 1.5)]
    rows = sweep.sweep(wl, fleet, names, loads, (True, False), 0, PERF, jobs=1,
                       progress=lambda line: None)
    assert len(rows) == len(names) * 2 * 2
    for r in rows:
        r["x"] = round(r["load"] / knee.load, 4)
        assert r["served"] + r["rejected"] == r["requests"] == 250
        assert 0.0 <= r["slo_ok"] <= min(r["ttft_ok"], r["tbt_ok"]) <= 1.0
        assert r["goodput"] <= r["throughput"] + 1e-9
        assert 0.0 <= r["hit_gpu"] + r["hit_host"] + r["hit_l3"] <= 1.0
        if not r["l3"]:
            assert r["hit_l3"] == 0.0
        assert (r["rejected"] > 0) <= (r["policy"] == "least_load+cap")

    checks = targets.evaluate(rows)
    assert set(checks["pool_share"]) == set(names)
    json.dumps(checks)                                  # the results file takes it as is
    collapse = sweep.collapse_check(wl, fleet, knee.load, 0, PERF)
    assert collapse["highest_x"] in sweep.COLLAPSE_X + (None,)
    assert all(r["abandoned"] == 0 for r in collapse["rows"])       # clients wait forever
    png = tmp_path / "fleet.png"
    plots.plot(rows, str(png), "tiny")
    assert png.stat().st_size > 10_000


def test_agent_workload_shares_system_prompts_and_grows_sessions(tmp_path):
    reqs = agents.generate(seed=1, duration_s=120.0)
    assert reqs == agents.generate(seed=1, duration_s=120.0)          # deterministic
    assert [r.timestamp_s for r in reqs] == sorted(r.timestamp_s for r in reqs)
    mix = agents.AgentMix()
    for r in reqs:
        assert len(r.hash_ids) == -(-r.input_tokens // workload.BLOCK_TOKENS)
        assert r.input_tokens >= min(mix.system_prompts)
    # the hottest system prompt's first block opens many requests
    first = [r.hash_ids[0] for r in reqs]
    assert max(first.count(b) for b in set(first)) > len(reqs) // 4
    # one session's calls: each prompt extends the last; only its partial tail block changes
    import random
    calls = agents._session(random.Random(2), mix, agents._Ids(), 0, 0.0, [1.0] * 6)
    for (_, ctx_a, _, a), (_, ctx_b, _, b) in zip(calls, calls[1:]):
        full = ctx_a // workload.BLOCK_TOKENS
        assert ctx_b > ctx_a and b[:full] == a[:full]
        assert ctx_a % workload.BLOCK_TOKENS == 0 or a[full] not in b
    path = tmp_path / "agents.jsonl.xz"
    workload.write(str(path), reqs)
    back = workload.load(str(path))
    assert [(r.input_tokens, r.output_tokens, r.hash_ids) for r in back] == \
        [(r.input_tokens, r.output_tokens, r.hash_ids) for r in reqs]


def test_spread_keeps_each_bucket_in_place_and_the_order():
    raw = workload.load(limit=300)
    spread = workload.spread(raw, seed=3)
    assert spread == workload.spread(raw, seed=3) != workload.spread(raw, seed=4)
    assert [r.index for r in spread] == [r.index for r in raw]
    times = [r.timestamp_s for r in spread]
    assert times == sorted(times) and len(set(times)) > len({r.timestamp_s for r in raw})
    bounds = sorted({r.timestamp_s for r in raw})
    for a, b in zip(raw, spread):
        nxt = next((t for t in bounds if t > a.timestamp_s), None)
        assert a.timestamp_s <= b.timestamp_s and (nxt is None or b.timestamp_s < nxt)
