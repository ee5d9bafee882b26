"""Issue 26's targets, checked on one sweep's rows (every policy in the same run).

Each check is a list of entries ``{x, l3, value, target, met}``: ``x`` the load as a multiple
of the knee, ``value`` the measured ratio (or ordering), ``met`` whether it reaches
``target``. A policy missing from the sweep leaves its checks out.

- ``routing_vs_cache_aware`` / ``routing_vs_dynamo``: goodput of the core (rejection off) over
  SGLang's ``cache_aware`` (target 1.25) and Dynamo's cost (1.1) with the shared L3: the
  issue's point is 1.5x the knee; every load from the knee up is listed.
- ``below_knee``: at or below the knee, the core's goodput over the best routing baseline's
  (random, round-robin, least-load, cache_aware, Dynamo), target 0.98.
- ``past_knee``: past the knee, over the best affinity-style baseline (cache_aware, Dynamo),
  target 1.0.
- ``admission``: prediction-based rejection against the length-cap control past the knee:
  more goodput (ratio > 1) and fewer rejections.
- ``pool_share``: each policy's goodput with the shared L3 over without.
- ``without_pool``: without the shared L3, from the knee up, the core's goodput over each
  routing baseline's (the issue's guide: 1.2-1.4x), target 1.2 over the best of them.
- ``paper_ordering``: mean TTFT random > least-load > local cache-aware > the core (the
  paper's random > load balancing > local cache-aware > global cache-aware), with the shared
  L3 (the paper's global pool; without it the core knows no more than the local variant).
"""
from __future__ import annotations

CORE, LOCAL, PREDICTIVE, CONTROL = ("conductor", "conductor-local", "conductor-predictive",
                                    "least_load+cap")
ROUTING = ("random", "round_robin", "least_load", "cache_aware", "dynamo")
AFFINITY = ("cache_aware", "dynamo")
ORDER = ("random", "least_load", LOCAL, CORE)


def _entry(x, l3, value, target, met=None) -> dict:
    return {"x": x, "l3": l3, "value": round(value, 4), "target": target,
            "met": bool(value >= target) if met is None else bool(met)}


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else (float("inf") if a > 0 else 1.0)


class _Sweep:
    """A sweep's rows, by (policy, L3, x)."""

    def __init__(self, rows: list):
        self.at = {(r["policy"], r["l3"], r["x"]): r for r in rows}
        self.xs = sorted({r["x"] for r in rows})
        self.modes = sorted({r["l3"] for r in rows}, reverse=True)
        self.policies = {r["policy"] for r in rows}

    def good(self, policy: str, l3: bool, x: float) -> float:
        return self.at[(policy, l3, x)]["goodput"]

    def best(self, names, l3: bool, x: float) -> float:
        return max(self.good(p, l3, x) for p in names)

    def present(self, names) -> list:
        return [p for p in names if p in self.policies]


def _routing(s: _Sweep) -> dict:
    out: dict = {}
    for name, base, target in (("routing_vs_cache_aware", "cache_aware", 1.25),
                               ("routing_vs_dynamo", "dynamo", 1.1)):
        if base in s.policies and True in s.modes:
            out[name] = [_entry(x, True, _ratio(s.good(CORE, True, x), s.good(base, True, x)),
                                target) for x in s.xs if x >= 1.0]
    routing, affinity = s.present(ROUTING), s.present(AFFINITY)
    if routing:
        out["below_knee"] = [
            _entry(x, l3, _ratio(s.good(CORE, l3, x), s.best(routing, l3, x)), 0.98)
            for l3 in s.modes for x in s.xs if x <= 1.0]
    if affinity:
        out["past_knee"] = [
            _entry(x, l3, _ratio(s.good(CORE, l3, x), s.best(affinity, l3, x)), 1.0)
            for l3 in s.modes for x in s.xs if x > 1.0]
    if routing and False in s.modes:
        out["without_pool"] = []
        for x in (x for x in s.xs if x >= 1.0):      # below, every policy serves nearly all
            entry = _entry(x, False, _ratio(s.good(CORE, False, x), s.best(routing, False, x)),
                           1.2)
            entry["over"] = {p: round(_ratio(s.good(CORE, False, x), s.good(p, False, x)), 4)
                             for p in routing}
            out["without_pool"].append(entry)
    return out


def _admission(s: _Sweep) -> list:
    out = []
    for l3 in s.modes:
        for x in (x for x in s.xs if x > 1.0):
            p, c = s.at[(PREDICTIVE, l3, x)], s.at[(CONTROL, l3, x)]
            entry = _entry(x, l3, _ratio(p["goodput"], c["goodput"]), 1.0,
                           met=p["goodput"] > c["goodput"] and p["rejected"] < c["rejected"])
            entry.update(rejected=p["rejected"], control_rejected=c["rejected"])
            out.append(entry)
    return out


def _ordering(s: _Sweep) -> list:
    out = []
    for x in s.xs:
        ttft = [s.at[(p, True, x)]["ttft_mean"] for p in ORDER]
        out.append({"x": x, "l3": True, "met": all(a > b for a, b in zip(ttft, ttft[1:])),
                    "ttft_mean": dict(zip(ORDER, (round(t, 3) for t in ttft)))})
    return out


def evaluate(rows: list) -> dict:
    s = _Sweep(rows)
    out: dict = _routing(s) if CORE in s.policies else {}
    if PREDICTIVE in s.policies and CONTROL in s.policies:
        out["admission"] = _admission(s)
    if len(s.modes) == 2:
        out["pool_share"] = {p: {str(x): round(_ratio(s.good(p, True, x), s.good(p, False, x)), 4)
                                 for x in s.xs} for p in sorted(s.policies)}
    if all(p in s.policies for p in ORDER) and True in s.modes:
        out["paper_ordering"] = _ordering(s)
    return out
