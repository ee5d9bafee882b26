"""Runs of the fleet simulator over policies x shared L3 (with, without) x loads, on as many
processes as asked, and the knee they are placed around.

The knee is the load factor (trace time scaling) where least-load, with the shared L3,
stops meeting the TTFT SLO for 90 % of requests: with per-request SLOs, that is where its
p90 TTFT (relative to each request's SLO) crosses the SLO. Found by doubling from load 1
until attainment falls below 90 %, then bisecting (geometric) between the last load above
and the first below, then interpolating between them.
"""
from __future__ import annotations

import math
import os
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from typing import NamedTuple, Optional, Sequence

from hicache_mc.conductor.perf import PerfModel

from . import policies
from .sim import FleetConfig, FleetSim
from .workload import Workload

KNEE_POLICY = "least_load"
KNEE_ATTAINMENT = 0.9
# x the knee; 1.1 because with smooth arrivals the fleet saturates not far past the knee
LOAD_FACTORS = (0.25, 0.5, 0.75, 1.0, 1.1, 1.25, 1.5, 2.0)


@dataclass(frozen=True)
class Point:
    policy: str
    l3: bool
    load: float


class Knee(NamedTuple):
    load: float
    probes: dict          # load -> least-load's TTFT attainment


# The workload a pool's processes run against: set before the pool forks, so every process
# shares the parent's copy (naming a 12k-request trace's pages takes ~0.7 s).
_WORKLOAD: Optional[Workload] = None


def run_point(point: Point, fleet: FleetConfig, seed: int, perf: PerfModel,
              workload: Optional[Workload] = None) -> dict:
    workload = workload or _WORKLOAD
    factory = policies.get(point.policy)
    shape = fleet if point.l3 else fleet.without_l3()
    t0 = time.process_time()
    result = FleetSim(workload, shape, lambda view: factory(view, perf, seed), load=point.load,
                      seed=seed, perf=perf).run()
    return {"policy": point.policy, "l3": point.l3, "load": point.load, **result.as_dict(),
            "cpu_s": round(time.process_time() - t0, 3)}


def find_knee(workload: Workload, fleet: FleetConfig, seed: int, perf: PerfModel,
              iters: int = 6) -> Knee:
    probes: dict = {}

    def attainment(load: float) -> float:
        if load not in probes:
            probes[load] = run_point(Point(KNEE_POLICY, fleet.l3_pages > 0, load), fleet, seed,
                                     perf, workload)["ttft_ok"]
        return probes[load]

    lo, hi = 1.0, 1.0
    if attainment(1.0) >= KNEE_ATTAINMENT:
        while attainment(hi) >= KNEE_ATTAINMENT:
            lo, hi = hi, hi * 2
            if hi > 1024:
                raise RuntimeError("least-load meets its SLO at any load: no knee")
    else:
        while attainment(lo) < KNEE_ATTAINMENT:
            lo, hi = lo / 2, lo
            if lo < 1 / 1024:
                raise RuntimeError("least-load misses its SLO at any load: no knee")
    for _ in range(iters):
        mid = math.sqrt(lo * hi)
        if attainment(mid) >= KNEE_ATTAINMENT:
            lo = mid
        else:
            hi = mid
    a_lo, a_hi = probes[lo], probes[hi]
    knee = lo + (hi - lo) * (a_lo - KNEE_ATTAINMENT) / max(1e-9, a_lo - a_hi)
    return Knee(round(knee, 4), dict(sorted(probes.items())))


def sweep(workload: Workload, fleet: FleetConfig, names: Sequence[str],
          loads: Sequence[float], l3_modes: Sequence[bool], seed: int, perf: PerfModel,
          jobs: int = 1, progress=print) -> list[dict]:
    """One run per (policy, L3 mode, load); rows in that order."""
    global _WORKLOAD
    points = [Point(p, l3, load) for p in names for l3 in l3_modes for load in loads]
    if jobs <= 1:
        rows = []
        for pt in points:
            rows.append(run_point(pt, fleet, seed, perf, workload))
            progress(_line(rows[-1]))
        return rows
    _WORKLOAD = workload
    try:
        with ProcessPoolExecutor(max_workers=jobs) as pool:
            futures = [pool.submit(run_point, pt, fleet, seed, perf) for pt in points]
            rows = []
            for f in futures:
                rows.append(f.result())
                progress(_line(rows[-1]))
            return rows
    finally:
        _WORKLOAD = None


def _line(row: dict) -> str:
    return (f"  {row['policy']:22} {'L3' if row['l3'] else 'no L3':5} load {row['load']:6.3f}: "
            f"goodput {row['goodput']:6.2f}/s  SLO {row['slo_ok']:.3f}  "
            f"TTFT {row['ttft_mean']:6.2f} s  rejected {row['rejected']:5d}  "
            f"({row['cpu_s']:.1f} s)")


def default_jobs() -> int:
    return max(1, min(4, (os.cpu_count() or 1)))


COLLAPSE_POLICIES = ("least_load", "cache_aware", "dynamo", "conductor")
COLLAPSE_X = (1.0, 1.1, 1.25)


def collapse_check(workload: Workload, fleet: FleetConfig, knee: float, seed: int,
                   perf: PerfModel, jobs: int = 1) -> dict:
    """The routing comparison without abandonment (clients wait forever), with the L3, near
    the knee: the highest of ``COLLAPSE_X`` where some policy still meets both SLOs for half
    its requests (past it, queues grow for the rest of the trace and all goodput is ~0), and
    the core's goodput over cache_aware and Dynamo's there."""
    patient = replace(fleet, abandon_floor_s=0.0, abandon_slo_factor=0.0)
    names = [p for p in COLLAPSE_POLICIES if p in policies.all_policies()]
    factor = {round(knee * x, 4): x for x in COLLAPSE_X}
    rows = sweep(workload, patient, names, list(factor), (True,), seed, perf, jobs,
                 progress=lambda line: None)
    for r in rows:
        r["x"] = factor[r["load"]]
    alive = [x for x in COLLAPSE_X
             if max(r["slo_ok"] for r in rows if r["x"] == x) >= 0.5]
    top = max(alive) if alive else None
    good = {r["policy"]: r["goodput"] for r in rows if r["x"] == top}
    ratios = {f"conductor/{b}": round(good["conductor"] / good[b], 4)
              for b in ("cache_aware", "dynamo") if good.get(b) and "conductor" in good}
    return {"highest_x": top, "ratios": ratios, "rows": rows}
