"""The tables of docs/benchmarks.md's fleet section, from a results file of replay_fleet.py.

    python benchmarks/fleet/report.py benchmarks/results/fleet_conversation.json
"""
from __future__ import annotations

import json
import sys

SHOWN_X = (0.5, 1.0, 1.5, 2.0)


def goodput_table(doc: dict) -> str:
    rows = doc["rows"]
    xs = [x for x in SHOWN_X if any(r["x"] == x for r in rows)]
    at = {(r["policy"], r["l3"], r["x"]): r for r in rows}
    head = "| policy | " + " | ".join(f"{x}x L3 | {x}x none" for x in xs) + " |"
    out = [head, "|---|" + "---|" * (2 * len(xs))]
    for p in doc["policies"]:
        cells = []
        for x in xs:
            for l3 in (True, False):
                r = at.get((p, l3, x))
                cells.append("" if r is None else f"{r['goodput']:.2f}")
        out.append(f"| {p} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def detail_table(doc: dict, x: float, l3: bool = True) -> str:
    cols = ("goodput", "slo_ok", "ttft_mean", "ttft_p90", "ttft_p99", "tbt_p90", "rejected",
            "abandoned", "hit_gpu", "hit_host", "hit_l3")
    out = ["| policy | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
    for r in doc["rows"]:
        if r["x"] == x and r["l3"] == l3:
            cells = [f"{r.get(c, 0):d}" if isinstance(r.get(c, 0), int) else f"{r[c]:.3g}"
                     for c in cols]
            out.append(f"| {r['policy']} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def summary_table(doc: dict, l3: bool = True) -> str:
    """Per policy and load: goodput / p90 TTFT (s) / rejected / abandoned."""
    rows = [r for r in doc["rows"] if r["l3"] == l3]
    xs = sorted({r["x"] for r in rows})
    at = {(r["policy"], r["x"]): r for r in rows}
    out = ["| policy | " + " | ".join(f"{x}x" for x in xs) + " |", "|---|" + "---|" * len(xs)]
    for p in doc["policies"]:
        cells = [f"{r['goodput']:.2f} / {r['ttft_p90']:.1f} / {r['rejected']:,} / "
                 f"{r.get('abandoned', 0):,}" if (r := at.get((p, x))) else "" for x in xs]
        out.append(f"| {p} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def targets_table(doc: dict) -> str:
    out = ["| check | load | L3 | value | target | met |", "|---|---|---|---|---|---|"]
    for name, entries in doc["targets"].items():
        if name in ("pool_share", "paper_ordering"):
            continue
        for e in entries:
            out.append(f"| {name} | {e['x']}x | {'yes' if e['l3'] else 'no'} | {e['value']} | "
                       f"{e['target']} | {'yes' if e['met'] else '**no**'} |")
    return "\n".join(out)


def ordering_table(doc: dict) -> str:
    entries = doc["targets"].get("paper_ordering", [])
    if not entries:
        return ""
    names = list(entries[0]["ttft_mean"])
    out = ["| load | L3 | " + " | ".join(names) + " | ordering held |",
           "|---|---|" + "---|" * (len(names) + 1)]
    for e in entries:
        out.append(f"| {e['x']}x | {'yes' if e['l3'] else 'no'} | "
                   + " | ".join(f"{e['ttft_mean'][n]:.2f}" for n in names)
                   + f" | {'yes' if e['met'] else 'no'} |")
    return "\n".join(out)


def main() -> None:
    doc = json.load(open(sys.argv[1]))
    print(f"knee: {doc['knee']['load']}\n\ngoodput (requests/s within both SLOs):\n")
    print(goodput_table(doc))
    print("\nwith the L3: goodput / p90 TTFT (s) / rejected / abandoned:\n")
    print(summary_table(doc))
    for x in (1.0, 1.5):
        print(f"\nat {x}x the knee, with the L3:\n")
        print(detail_table(doc, x))
    print("\ntargets:\n")
    print(targets_table(doc))
    print("\nmean TTFT (s), the paper's ordering:\n")
    print(ordering_table(doc))
    collapse = doc.get("without_abandonment")
    if collapse:
        print(f"\nwithout abandonment: highest load before collapse {collapse['highest_x']}x, "
              f"ratios there {collapse['ratios']}")


if __name__ == "__main__":
    main()
