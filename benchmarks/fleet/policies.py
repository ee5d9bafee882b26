"""Every routing policy the fleet benchmark compares, by name: the baselines of this folder
and the Conductor's own variants (``hicache_mc.conductor.core.Conductor.variants()``, when
the core is installed). A factory builds a fresh router for one run from the run's L3 view,
the performance model and a seed.

The admission control takes its slack after an ``@``: ``least_load+cap@1.5`` rejects past
1.5 x the SLO (plain ``least_load+cap``: 1.0). The core's ablations
(``Conductor.ablations()``: conductor-no-work, ...) are selectable by name, not in "all"."""
from __future__ import annotations

from typing import Callable

from hicache_mc.conductor import api
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


def core_policies(ablations: bool = False) -> dict[str, Factory]:
    """The Conductor's variants (with ``ablations``: its ablations instead, each the default
    with one term beyond Algorithm 1 removed), or none when the core is not there yet."""
    try:
        from hicache_mc.conductor.core import Conductor
    except ImportError:
        return {}

    def factory(config):
        return lambda view, perf, seed: Conductor(l3=view, config=config)

    configs = Conductor.ablations() if ablations else Conductor.variants()
    return {name: factory(config) for name, config in configs.items()}


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
