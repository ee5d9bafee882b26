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
- ``without_pool``: without the shared L3, the core's goodput over each routing baseline's
  (the issue's guide: 1.2-1.4x), target 1.2 over the best of them.
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


def evaluate(rows: list) -> dict:
    at = {(r["policy"], r["l3"], r["x"]): r for r in rows}
    xs = sorted({r["x"] for r in rows})
    modes = sorted({r["l3"] for r in rows}, reverse=True)
    policies = {r["policy"] for r in rows}
    good = lambda p, l3, x: at[(p, l3, x)]["goodput"]  # noqa: E731
    out: dict = {}
    if CORE in policies:
        for name, base, target in (("routing_vs_cache_aware", "cache_aware", 1.25),
                                   ("routing_vs_dynamo", "dynamo", 1.1)):
            if base in policies and True in modes:
                out[name] = [_entry(x, True, _ratio(good(CORE, True, x), good(base, True, x)),
                                    target) for x in xs if x >= 1.0]
        routing = [p for p in ROUTING if p in policies]
        affinity = [p for p in AFFINITY if p in policies]
        out["below_knee"] = [
            _entry(x, l3, _ratio(good(CORE, l3, x), max(good(p, l3, x) for p in routing)), 0.98)
            for l3 in modes for x in xs if x <= 1.0 and routing]
        out["past_knee"] = [
            _entry(x, l3, _ratio(good(CORE, l3, x), max(good(p, l3, x) for p in affinity)), 1.0)
            for l3 in modes for x in xs if x > 1.0 and affinity]
    if PREDICTIVE in policies and CONTROL in policies:
        out["admission"] = []
        for l3 in modes:
            for x in (x for x in xs if x > 1.0):
                p, c = at[(PREDICTIVE, l3, x)], at[(CONTROL, l3, x)]
                entry = _entry(x, l3, _ratio(p["goodput"], c["goodput"]), 1.0,
                               met=p["goodput"] > c["goodput"] and p["rejected"] < c["rejected"])
                entry.update(rejected=p["rejected"], control_rejected=c["rejected"])
                out["admission"].append(entry)
    if CORE in policies and False in modes:
        routing = [p for p in ROUTING if p in policies]
        out["without_pool"] = []
        for x in xs:
            entry = _entry(x, False, _ratio(good(CORE, False, x),
                                            max(good(p, False, x) for p in routing)), 1.2)
            entry["over"] = {p: round(_ratio(good(CORE, False, x), good(p, False, x)), 4)
                             for p in routing}
            out["without_pool"].append(entry)
    if len(modes) == 2:
        out["pool_share"] = {p: {str(x): round(_ratio(good(p, True, x), good(p, False, x)), 4)
                                 for x in xs} for p in sorted(policies)}
    if all(p in policies for p in ORDER):
        out["paper_ordering"] = []
        for l3 in (m for m in modes if m):
            for x in xs:
                ttft = [at[(p, l3, x)]["ttft_mean"] for p in ORDER]
                held = all(a > b for a, b in zip(ttft, ttft[1:]))
                out["paper_ordering"].append({"x": x, "l3": l3, "ttft_mean": dict(
                    zip(ORDER, (round(t, 3) for t in ttft))), "met": held})
    return out
