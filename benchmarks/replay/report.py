"""Figures of one replay, and the plot of hit rate against L3 capacity."""
from __future__ import annotations

import os
import sys
from typing import Sequence

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import pct  # noqa: E402

from .instance import Outcome  # noqa: E402


def summarize(outcomes: Sequence[Outcome], block_bytes: int, wall_s: float) -> dict:
    """Hit rates, block counts, L3 load/put latency (ms), bytes and throughput of one replay.

    ``load`` is the L3 part of serving one request (exists + get), over the requests whose
    exists found at least one block; ``put`` is over the requests that stored blocks.
    """
    blocks = sum(o.blocks for o in outcomes)
    local = sum(o.local for o in outcomes)
    l3 = sum(o.l3 for o in outcomes)
    read = sum(o.read for o in outcomes)
    put = sum(o.put for o in outcomes)
    put_failed = sum(o.put_failed for o in outcomes)
    loads = [o.t_exists + o.t_get for o in outcomes if o.probed]
    exists = [o.t_exists for o in outcomes if o.t_exists]
    puts = [o.t_put for o in outcomes if o.put]
    t_get = sum(o.t_get for o in outcomes)
    t_put = sum(puts)
    ms = lambda xs, q: pct(xs, q) * 1e3 if xs else 0.0  # noqa: E731
    bytes_read, bytes_written = read * block_bytes, (put - put_failed) * block_bytes
    return {
        "requests": len(outcomes), "blocks": blocks,
        "local_hits": local, "l3_hits": l3,
        "local_rate": local / blocks, "hit_rate": (local + l3) / blocks,
        "probed": sum(o.probed for o in outcomes), "read": read,
        "lost_after_exists": sum(o.probed for o in outcomes) - read,
        "wrong": sum(o.wrong for o in outcomes),
        "put": put, "put_failed": put_failed,
        "load_requests": len(loads),
        "load_p50_ms": ms(loads, 50), "load_p99_ms": ms(loads, 99),
        "exists_p50_ms": ms(exists, 50), "exists_p99_ms": ms(exists, 99),
        "put_p50_ms": ms(puts, 50), "put_p99_ms": ms(puts, 99),
        "bytes_read": bytes_read, "bytes_written": bytes_written,
        "get_gbps": bytes_read / t_get / 1e9 if t_get else 0.0,
        "put_gbps": bytes_written / t_put / 1e9 if t_put else 0.0,
        "wall_s": wall_s, "requests_per_s": len(outcomes) / wall_s if wall_s else 0.0,
    }


def plot(path: str, curves: dict, local_rate: float, ceiling_rate: float, title: str) -> str:
    """``curves``: label -> [(capacity fraction, hit rate)]. Writes a PNG; returns its path."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    markers = iter("osD^v")
    for label, pts in curves.items():
        pts = sorted(pts)
        style = dict(color="grey", linewidth=1, marker=".") if "simulated" in label else \
            dict(marker=next(markers, "o"))
        ax.plot([100 * c for c, _ in pts], [100 * h for _, h in pts], label=label, **style)
    ax.axhline(100 * ceiling_rate, color="grey", linestyle="--",
               label=f"unbounded (ceiling) {100 * ceiling_rate:.1f} %")
    ax.axhline(100 * local_rate, color="black", linestyle=":",
               label=f"local only {100 * local_rate:.1f} %")
    ax.set_xlabel("L3 capacity (% of the distinct blocks)")
    ax.set_ylabel("block hit rate (%)")
    ax.set_ylim(0, max(5.0, 100 * ceiling_rate * 1.15))
    ax.set_xlim(left=0)
    ax.grid(True, alpha=0.3)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8, loc="center right")   # the curves rise left, flatten top right
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
