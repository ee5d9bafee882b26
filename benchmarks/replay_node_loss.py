"""What losing one node costs: Mooncake's conversation trace replayed against 4 nodes, one of
them SIGKILLed half-way, against the same replay with no loss.

    python benchmarks/replay_node_loss.py                    # 4,000 requests, 5 runs x 2
    python benchmarks/replay_node_loss.py --requests 1000 --policies chains

Every run is a fresh cluster (``hicache-mc master`` + ``--nodes`` nodes, each with room for the
whole trace twice over: no eviction, so the loss is the only thing that costs hits), replayed
in order by 4 instance processes as ``replay_trace.py`` does. At request ``--kill-at`` x N the
node holding the trace's first block (the system prompt every request starts with: the worst
node to lose) is SIGKILLed; the master drops it after 3 s (heartbeat 1 s x 3), while clients
find out at their first call to it. The same policy is replayed without the loss, and the hit
rate of the ``--window`` requests after the kill (and of all of them) is compared.

Policies (what the instances' puts say, with the client settings that go with it):

- ``per-page``: one put per block, each placed alone on the node with most room (how every
  page was placed before chains);
- ``no-chains``: puts name no parent (each call a chain of its own), one copy;
- ``chains``: puts name the block before them (SGLang's prefix keys), one copy;
- ``hot-10``: chains, and the puts of the hottest 10 % of chains (the most hits in the trace:
  known in hindsight, as an operator marking hot namespaces would) with ``replicas = 2``;
- ``read-copies``: chains, and ``replicas = 2`` with ``replicate_reads``: whatever a client
  reads gets a second copy, from the bytes it read.

Prints a table; writes ``results/replay_node_loss.json``. Targets (DESIGN.md): the drop is at
most the lost node's share of the bytes; with copies of the hottest 10 % of chains, <= 5 %.
"""
from __future__ import annotations

import argparse
import os
import sys
import uuid
from collections import Counter

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from common import table, write_json  # noqa: E402
from replay import services, trace  # noqa: E402
from replay.driver import replay  # noqa: E402
from replay.instance import chain_id  # noqa: E402

POLICIES = {
    "per-page": {"name_parents": False, "put_each": True},
    "no-chains": {"name_parents": False},
    "chains": {},
    "hot-10": {"replicas": 2, "hot": 0.10},
    "read-copies": {"replicas": 2, "replicate_reads": True},
}


def hottest(reqs, fraction: float) -> frozenset:
    """The ``fraction`` of chains with the most block hits in an unbounded shared cache."""
    seen, hits = set(), Counter()
    for r in reqs:
        hits[chain_id(r.hash_ids)] += trace.leading_run(r.hash_ids, seen)
        seen.update(r.hash_ids)
    ranked = sorted(hits, key=hits.__getitem__, reverse=True)
    return frozenset(ranked[:int(len(ranked) * fraction)])


def run(reqs, policy: str, kill_at: int, args) -> dict:
    """One replay; with ``kill_at`` >= 0 the first block's node dies before that request."""
    opts = POLICIES[policy]
    hot = hottest(reqs, opts["hot"]) if "hot" in opts else frozenset()
    namespace = f"loss/{uuid.uuid4().hex[:8]}"
    killed: dict = {}
    with services.hicache_cluster(args.nodes, args.dram) as cluster:
        spec = {"kind": "hicache-mc", "master": cluster.master, "transport": "auto",
                "replicas": opts.get("replicas", 1),
                "replicate_reads": opts.get("replicate_reads", False)}

        def before(i: int) -> None:
            if i == kill_at:
                killed.update(cluster.kill_holder(f"{namespace}/{reqs[0].hash_ids[0]}"))
        outcomes = replay(reqs, spec, args.instances, args.local_blocks, args.block_bytes,
                          before=before if kill_at >= 0 else None, namespace=namespace,
                          hot_chains=hot, name_parents=opts.get("name_parents", True),
                          put_each=opts.get("put_each", False))
        nodes = cluster.nodes_now()
    return {"outcomes": outcomes, "killed": killed, "hot_chains": len(hot),
            "used_end": sum(n.get("used", 0) for n in nodes)}


def hits(outcomes, start: int, stop: int) -> float:
    """Block hit rate (local + L3) of requests ``start`` .. ``stop - 1``."""
    part = outcomes[start:stop]
    return sum(o.local + o.l3 for o in part) / max(1, sum(o.blocks for o in part))


def compare(policy: str, base: dict, lost: dict, kill_at: int, window: int, distinct_bytes: int) -> dict:
    n = len(base["outcomes"])
    row = {"policy": policy, "hot_chains": lost["hot_chains"], **{
        f"{name}_{which}": hits(r["outcomes"], kill_at, stop)
        for which, stop in (("window", kill_at + window), ("rest", n))
        for name, r in (("base", base), ("lost", lost))}}
    for which in ("window", "rest"):
        b = row[f"base_{which}"]
        row[f"drop_{which}"] = 1 - row[f"lost_{which}"] / b if b else 0.0
    row["share"] = lost["killed"].get("share", 0.0)
    row["node"] = lost["killed"].get("node", "")
    row["memory_x"] = base["used_end"] / distinct_bytes      # bytes held / distinct bytes
    row["put_failed"] = sum(o.put_failed for o in lost["outcomes"][kill_at:])
    row["wrong"] = sum(o.wrong for r in (base, lost) for o in r["outcomes"])
    return row


COLUMNS = [("policy", ""), ("hot_chains", "d"), ("share", ".3f"), ("base_window", ".4f"),
           ("lost_window", ".4f"), ("drop_window", ".3f"), ("base_rest", ".4f"),
           ("lost_rest", ".4f"), ("drop_rest", ".3f"), ("memory_x", ".2f"), ("put_failed", "d"),
           ("wrong", "d")]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", default=trace.DEFAULT_TRACE)
    ap.add_argument("--requests", type=int, default=4000)
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--instances", type=int, default=4)
    ap.add_argument("--local-blocks", type=int, default=2000)
    ap.add_argument("--block-bytes", type=int, default=4096,
                    help="bytes per block (hit rates do not depend on it; memory does)")
    ap.add_argument("--kill-at", type=float, default=0.5, help="fraction of the requests")
    ap.add_argument("--window", type=int, default=500, help="requests after the kill compared")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--out", default="replay_node_loss")
    args = ap.parse_args(argv)
    reqs = trace.load(args.trace, args.requests)
    distinct_bytes = trace.distinct(reqs) * args.block_bytes
    args.dram = max(64 << 20, 4 * distinct_bytes // args.nodes)     # every block twice, twice over
    kill_at = int(args.kill_at * len(reqs))
    print(f"{len(reqs)} requests, {trace.distinct(reqs)} distinct blocks of {args.block_bytes} B; "
          f"{args.nodes} nodes of {args.dram >> 20} MiB; node of the first block killed before "
          f"request {kill_at}; window {args.window}", flush=True)
    rows = []
    for policy in [p for p in args.policies.split(",") if p]:
        base = run(reqs, policy, -1, args)
        lost = run(reqs, policy, kill_at, args)
        rows.append(compare(policy, base, lost, kill_at, args.window, distinct_bytes))
        print(f"  {policy:<12} drop {100 * rows[-1]['drop_window']:.1f} % in the window, "
              f"{100 * rows[-1]['drop_rest']:.1f} % after; share {100 * rows[-1]['share']:.1f} %",
              flush=True)
    print(table(rows, COLUMNS))
    doc = {"args": vars(args), "kill_at": kill_at, "rows": rows}
    print("wrote", write_json(args.out + ".json", doc))
    return 1 if any(r["wrong"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
