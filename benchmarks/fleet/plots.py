"""One figure per sweep: every metric against load (as a multiple of the knee), one colour per
policy, solid with the shared L3 and dashed without."""
from __future__ import annotations

PANELS = (
    ("ttft_mean", "TTFT mean (s)", True), ("ttft_p90", "TTFT p90 (s)", True),
    ("ttft_p99", "TTFT p99 (s)", True), ("tbt_p90", "TBT p90 (s)", True),
    ("slo_ok", "SLO attainment (both)", False), ("goodput", "goodput (req/s in SLO)", False),
    ("rejected", "rejected requests", False), ("hit_local", "hit rate GPU + host", False),
    ("hit_l3", "hit rate L3", False),
)


def plot(rows: list, path: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    policies = list(dict.fromkeys(r["policy"] for r in rows))
    colours = {p: plt.get_cmap("tab10")(i % 10) for i, p in enumerate(policies)}
    fig, axes = plt.subplots(3, 3, figsize=(15, 12))
    for ax, (key, label, log) in zip(axes.flat, PANELS):
        for p in policies:
            for l3, style in ((True, "-"), (False, "--")):
                pts = sorted((r["x"], _value(r, key)) for r in rows
                             if r["policy"] == p and r["l3"] == l3)
                if pts:
                    ax.plot(*zip(*pts), style, color=colours[p], marker=".",
                            label=f"{p}{'' if l3 else ' (no L3)'}")
        ax.set_title(label)
        ax.set_xlabel("load (x knee)")
        ax.axvline(1.0, color="grey", lw=0.5)
        if log:
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=7, ncol=2)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _value(row: dict, key: str) -> float:
    if key == "hit_local":
        return row["hit_gpu"] + row["hit_host"]
    return row[key]
