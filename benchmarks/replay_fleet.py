"""Replay a FAST'25-format trace against a simulated SGLang fleet under every routing policy,
with and without the shared L3, across loads from light to twice the knee.

    python benchmarks/replay_fleet.py                          # conversation trace, all policies
    python benchmarks/replay_fleet.py --trace agents           # our agent workload (agents.py)
    python benchmarks/replay_fleet.py --trace my.jsonl --policies least_load,conductor --load 2

The fleet (``benchmarks/fleet/``): ``--instances`` SGLang instances (Llama-3-8B on one H100
each, ``hicache_mc.conductor.perf``), GPU and host pools, one shared L3 of ``--l3`` x the
trace's distinct blocks (``--l3-modes``: with it, without it, or both). The load factor
scales the trace's time (2 = twice as fast). Without ``--load``/``--loads``, the command finds
the knee (where least-load with the L3 stops meeting the TTFT SLO for 90 % of requests) and
sweeps ``--load-factors`` x the knee (0.25 to 2).

Writes ``benchmarks/results/fleet_<out>.json`` (every run's figures, the knee, the targets of
issue 26 checked) and ``fleet_<out>.png``; prints a table per load and the targets.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from dataclasses import asdict

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))
from common import RESULTS, table, write_json  # noqa: E402
from fleet import agents, plots, policies, sweep, targets, workload  # noqa: E402
from fleet.sim import FleetConfig  # noqa: E402
from hicache_mc.conductor.perf import L1_TOKENS, PerfModel  # noqa: E402

GB = 1e9


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", default="conversation",
                    help="conversation (the committed FAST'25 trace), agents, or a path")
    ap.add_argument("--requests", type=int, help="only the first N requests")
    ap.add_argument("--policies", default="all", help="all, or a comma-separated list")
    ap.add_argument("--instances", type=int, default=8)
    ap.add_argument("--l1-tokens", type=int, default=L1_TOKENS, help="GPU KV pool per instance")
    ap.add_argument("--l2-ratio", type=float, default=2.0, help="host pool / GPU pool")
    ap.add_argument("--l3", type=float, default=0.5, help="L3 room, x the distinct blocks")
    ap.add_argument("--l3-bw", type=float, default=200.0, help="L3 aggregate GB/s")
    ap.add_argument("--path-bw", type=float, default=25.0, help="L3 <-> instance GB/s")
    ap.add_argument("--host-bw", type=float, default=25.0, help="host -> GPU GB/s")
    ap.add_argument("--l3-modes", choices=("both", "on", "off"), default="both")
    ap.add_argument("--load", type=float, help="one load factor; no sweep")
    ap.add_argument("--loads", help="comma-separated load factors; no knee search")
    ap.add_argument("--knee", type=float, help="the knee, if known (skips the search)")
    ap.add_argument("--load-factors", default=",".join(map(str, sweep.LOAD_FACTORS)),
                    help="loads to sweep, x the knee")
    ap.add_argument("--perturb", type=float, default=0.0, help="lognormal sigma of timing noise")
    ap.add_argument("--no-overlap-load", dest="overlap_load", action="store_false",
                    help="host -> GPU loads before the compute, not layer by layer under it")
    ap.add_argument("--ttft-slo", default="0.5,2.0",
                    help="BASE,FACTOR: TTFT SLO = BASE s + FACTOR x the prompt's cold prefill")
    ap.add_argument("--tbt-slo", type=float, default=0.1, help="s per output token")
    ap.add_argument("--abandon", default="30,10",
                    help="FLOOR,FACTOR: a client gives up on a request still queued after "
                         "max(FLOOR s, FACTOR x its TTFT SLO); 'off': never")
    ap.add_argument("--no-collapse-check", dest="collapse_check", action="store_false",
                    help="skip the routing runs without abandonment near the knee")
    ap.add_argument("--event-delay", type=float, default=0.05)
    ap.add_argument("--event-loss", type=float, default=0.0)
    ap.add_argument("--no-spread", dest="spread", action="store_false",
                    help="replay each timestamp's requests at one instant (see workload.spread)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--jobs", type=int, default=sweep.default_jobs())
    ap.add_argument("--out", help="results name (fleet_<out>.json); default: the trace's")
    return ap.parse_args()


def load_trace(args) -> tuple:
    if args.trace == "conversation":
        return (workload.load(workload.CONVERSATION, args.requests),
                "FAST'25 conversation trace")
    if args.trace == "agents":
        return agents.generate(args.seed, limit=args.requests), f"agents.py --seed {args.seed}"
    return workload.load(args.trace, args.requests), args.trace


def ceiling(reqs) -> float:
    """Prompt tokens an unbounded cache shared by every instance would serve, under the
    simulator's rules (full pages only; a match stops a token short of the prompt)."""
    seen, hits, total, pt = set(), 0, 0, workload.BLOCK_TOKENS
    for r in reqs:
        chain, n = r.hash_ids[:r.input_tokens // pt], 0
        while n < len(chain) and chain[n] in seen:
            n += 1
        hits += min(n, (r.input_tokens - 1) // pt) * pt
        total += r.input_tokens
        seen.update(chain)
    return hits / max(1, total)


def fleet_config(args, distinct: int) -> FleetConfig:
    l1 = args.l1_tokens // workload.BLOCK_TOKENS
    floor, factor = (0.0, 0.0) if args.abandon == "off" else map(float, args.abandon.split(","))
    return FleetConfig(instances=args.instances, l1_pages=l1, l2_pages=int(l1 * args.l2_ratio),
                       host_bw=args.host_bw * GB, l3_pages=int(args.l3 * distinct),
                       l3_bandwidth=args.l3_bw * GB, l3_path_bw=args.path_bw * GB,
                       event_delay_s=args.event_delay, event_loss=args.event_loss,
                       perturb_sigma=args.perturb, overlap_load=args.overlap_load,
                       ttft_slo_base_s=float(args.ttft_slo.split(",")[0]),
                       ttft_slo_factor=float(args.ttft_slo.split(",")[1]),
                       tbt_slo_s=args.tbt_slo, abandon_floor_s=floor, abandon_slo_factor=factor)


def loads_to_run(args, wl, fleet, perf) -> tuple:
    """(knee or None, absolute loads)."""
    if args.load:
        return args.knee, [args.load]
    if args.loads:
        return args.knee, [float(x) for x in args.loads.split(",")]
    knee = args.knee
    probes = {}
    if knee is None:
        t0 = time.time()
        found = sweep.find_knee(wl, fleet, args.seed, perf)
        knee, probes = found.load, found.probes
        print(f"knee: load {knee:.3f} ({len(probes)} least-load runs, {time.time() - t0:.0f} s)")
    args.knee_probes = probes
    return knee, [round(knee * f, 4) for f in factors(args)]


def factors(args) -> list:
    return [float(x) for x in args.load_factors.split(",")]


def report(rows: list, checks: dict) -> None:
    cols = [("policy", ""), ("l3", ""), ("goodput", ".2f"), ("slo_ok", ".3f"), ("ttft_mean", ".2f"),
            ("ttft_p90", ".2f"), ("tbt_p90", ".3f"), ("rejected", "d"), ("abandoned", "d"),
            ("hit_gpu", ".3f"), ("hit_host", ".3f"), ("hit_l3", ".3f")]
    for x in sorted({r["x"] for r in rows}):
        print(f"\nload {x} x knee")
        print(table([dict(r, l3="yes" if r["l3"] else "no") for r in rows if r["x"] == x], cols))
    print("\ntargets:")
    for name, entries in checks.items():
        if name == "pool_share":
            continue
        for e in entries:
            print(f"  {name:24} x{e['x']:<5} {'L3' if e['l3'] else 'no L3':5} "
                  f"{e.get('value', e.get('ttft_mean'))}  {'met' if e['met'] else 'MISSED'}")


def commit() -> str:
    """The checkout's commit, with "+dirty" when it has changes: the code the figures came from."""
    def git(*cmd):
        return subprocess.run(["git", *cmd], cwd=HERE, capture_output=True, text=True).stdout
    head = git("rev-parse", "--short", "HEAD").strip()
    return head + ("+dirty" if git("status", "--porcelain", "--untracked-files=no").strip() else "")


def main() -> None:
    args = parse()
    code = commit()
    perf = PerfModel()
    reqs, source = load_trace(args)
    if args.spread:
        reqs = workload.spread(reqs, args.seed)
    wl = workload.Workload(reqs)
    fleet = fleet_config(args, wl.distinct_blocks)
    names = policies.select(args.policies)
    modes = {"both": (True, False), "on": (True,), "off": (False,)}[args.l3_modes]
    print(f"{source}: {len(wl)} requests, {wl.distinct_blocks} distinct blocks, "
          f"ceiling {ceiling(reqs):.3f}; {args.instances} instances, L3 {fleet.l3_pages} pages; "
          f"policies {', '.join(names)}")
    knee, loads = loads_to_run(args, wl, fleet, perf)
    t0 = time.time()
    rows = sweep.sweep(wl, fleet, names, loads, modes, args.seed, perf, args.jobs)
    factor = {round(knee * f, 4): f for f in factors(args)} if knee else {}
    for r in rows:
        r["x"] = factor.get(r["load"], round(r["load"] / knee, 4) if knee else r["load"])
    checks = targets.evaluate(rows) if knee else {}
    collapse = None
    if knee and args.collapse_check and fleet.abandon_floor_s + fleet.abandon_slo_factor > 0:
        collapse = sweep.collapse_check(wl, fleet, knee, args.seed, perf, args.jobs)
        print(f"without abandonment: highest load before collapse {collapse['highest_x']}x "
              f"knee; ratios there {collapse['ratios']}")
    report(rows, checks)
    name = args.out or ("conversation" if args.trace == "conversation" else
                        "agents" if args.trace == "agents" else
                        os.path.basename(args.trace).split(".")[0])
    doc = {"command": " ".join(sys.argv), "commit": code,
           "trace": {"source": source, "requests": len(wl), "spread": args.spread,
           "distinct_blocks": wl.distinct_blocks, "ceiling": round(ceiling(reqs), 4)},
           "fleet": asdict(fleet), "perf": asdict(perf), "seed": args.seed,
           "knee": {"load": knee, "policy": sweep.KNEE_POLICY,
                    "ttft_attainment": sweep.KNEE_ATTAINMENT,
                    "probes": getattr(args, "knee_probes", {})},
           "policies": names, "sweep_wall_s": round(time.time() - t0, 1),
           "targets": checks, "without_abandonment": collapse, "rows": rows}
    path = write_json(f"fleet_{name}.json", doc)
    png = os.path.join(RESULTS, f"fleet_{name}.png")
    plots.plot(rows, png, f"{source}: {args.instances} instances (solid: shared L3, dashed: none)")
    print(f"\nwrote {path} and {png}")


if __name__ == "__main__":
    main()
