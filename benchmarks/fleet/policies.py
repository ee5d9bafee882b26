"""Every routing policy the fleet benchmark compares, by name: the baselines of this folder
and the Conductor's own configurations (``core_configs``). A factory builds a fresh router for
one run from the run's L3 view, the performance model and a seed.

The admission control takes its slack after an ``@``: ``least_load+cap@1.5`` rejects past
1.5 x the SLO (plain ``least_load+cap``: 1.0). The core's ablations
(``core_configs(ablations=True)``: conductor-no-work, ...) are selectable by name, not in "all"."""
from __future__ import annotations

from dataclasses import replace
from typing import Callable

from hicache_mc.conductor import api
from hicache_mc.conductor.core import Admission, Conductor, ConductorConfig
from hicache_mc.conductor.model import Overlap
from hicache_mc.conductor.perf import PerfModel

from .baselines import LeastLoadRouter, LengthCapRouter, RandomRouter, RoundRobinRouter
from .cache_aware import SglangCacheAware
from .dynamo import DynamoKvRouter
from .l3 import L3View

Factory = Callable[[L3View, PerfModel, int], api.Router]

BASELINES: dict[str, Factory] = {
    "random": lambda view, perf, seed: RandomRouter(seed),
    "round_robin": lambda view, perf, seed: RoundRobinRouter(),
    "least_load": lambda view, perf, seed: LeastLoadRouter(),
    "least_load+cap": lambda view, perf, seed: LengthCapRouter(perf),
    "cache_aware": lambda view, perf, seed: SglangCacheAware(),
    "dynamo": lambda view, perf, seed: DynamoKvRouter(view, seed=seed),
}
# The baselines that keep a prefix on the instance that has it (the "affinity-style" ones the
# core must not fall below past the knee).
AFFINITY = ("cache_aware", "dynamo")


def core_configs(ablations: bool = False) -> dict[str, ConductorConfig]:
    """The Conductor's named configurations: its variants, or with ``ablations`` the default
    with one term beyond Algorithm 1 taken out (or, for overlap, put in) and triage's share
    swept: what each is worth (docs/conductor.md)."""
    base = ConductorConfig()
    if not ablations:
        return {
            "conductor": base,
            "conductor-local": replace(base, l3_aware=False),
            "conductor-early": replace(base, admission=Admission.EARLY),
            "conductor-predictive": replace(base, admission=Admission.PREDICTIVE),
            # Algorithm 1 as the paper writes it: none of the terms beyond it
            "conductor-alg1": replace(base, work_weight=0.0, inflight=False, kv_room=False,
                                      calibrate=False, triage=False),
        }
    early = replace(base, admission=Admission.EARLY)
    return {
        "conductor-no-work": replace(base, work_weight=0.0),
        "conductor-no-triage": replace(base, triage=False),
        **{f"conductor-triage-{share}": replace(base, triage_share=share)
           for share in (0.0, 0.3, 0.7, 1.0)},
        "conductor-no-inflight": replace(base, inflight=False),
        "conductor-no-kvroom": replace(base, kv_room=False),
        "conductor-no-calibrate": replace(base, calibrate=False),
        "conductor-overlap": replace(base, overlap=Overlap.HOST),
        "conductor-early-no-cascade": replace(early, cascade_tolerance=0.0),
        "conductor-early-no-quantile": replace(early, error_quantile=0.0),
        "conductor-early-no-kvroom": replace(early, kv_room=False),
        "conductor-early-no-calibrate": replace(early, calibrate=False),
    }


def core_policies(ablations: bool = False) -> dict[str, Factory]:
    """``core_configs`` as router factories."""
    def factory(config):
        return lambda view, perf, seed: Conductor(l3=view, config=config)

    return {name: factory(config) for name, config in core_configs(ablations).items()}


def all_policies() -> dict[str, Factory]:
    return {**BASELINES, **core_policies()}


def get(name: str) -> Factory:
    """The factory of ``name``; KeyError if there is none."""
    base, _, slack = name.partition("@")
    if slack and base == "least_load+cap":
        value = float(slack)
        return lambda view, perf, seed: LengthCapRouter(perf, slack=value)
    if slack:
        raise KeyError(name)
    known = all_policies()
    return known[name] if name in known else core_policies(ablations=True)[name]


def select(names: str) -> list[str]:
    """``names``: "all", or a comma-separated list of policy names."""
    if names == "all":
        return list(all_policies())
    chosen = [n.strip() for n in names.split(",") if n.strip()]
    for name in chosen:
        try:
            get(name)
        except (KeyError, ValueError):
            raise SystemExit(f"unknown policy {name!r}; known: {', '.join(all_policies())}, "
                             f"{', '.join(core_policies(ablations=True))} "
                             "(and least_load+cap@<slack>)") from None
    return chosen
