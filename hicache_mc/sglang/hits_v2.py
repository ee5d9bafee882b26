"""``batch_exists_v2`` verdicts from per-page presence, under each pool's ``PoolHitPolicy``.

Pure: the backend asks the store once (per key, all pools together) and hands the answer here.
A *stop point* is a prefix length in pages, ``1..kv_pages``; the request may be restored up to a
stop point only if every gating pool can serve it:

- ``all_pages``: the pool has every page of the prefix, so its stop points are ``1..b`` where
  ``b`` is its leading run.
- ``trailing_pages``: the pool holds a state or window ending at the stop point (Mamba state:
  window 1; SWA: ``len(transfer.keys)`` pages), so only the window before each stop point must
  exist. Stop points therefore have holes (state saved at pages 4 and 8 but not 6), and the
  result is the *set* of restorable stop points, never one min or max: SGLang intersects the
  sets of all ranks, and a per-rank maximum could name a point another rank cannot serve.
- ``block_groups``: a compressed second form of the FULL pages; its keys come in groups of
  ``group_pages`` per block of ``block_pages`` FULL pages. It reports the FULL pages its leading
  complete groups cover as its own verdict and never gates the stop points.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

ALL_PAGES, TRAILING_PAGES, BLOCK_GROUPS = "all_pages", "trailing_pages", "block_groups"


@dataclass(frozen=True)
class PoolPresence:
    """What the store holds of one pool, page by page, for one ``batch_exists_v2`` call."""
    name: object              # the PoolTransfer's name, reported back as SGLang gave it
    policy: str               # a PoolHitPolicy value
    present: Sequence[bool]   # per key checked (the call's pages; block_groups: its own keys)
    window: int = 1           # trailing_pages: pages that must exist before a stop point
    block_pages: int = 0      # block_groups: FULL pages per block
    group_pages: int = 0      # block_groups: keys per group


@dataclass(frozen=True)
class HitVerdict:
    kv_hit_pages: int                 # the longest restorable prefix (0: none)
    pool_hit_pages: dict              # each pool's own boundary; KV's under "kv" when > 0
    restorable: list[int]             # every restorable stop point, ascending


def leading(flags: Sequence[bool]) -> int:
    """Length of the leading run of True."""
    for i, f in enumerate(flags):
        if not f:
            return i
    return len(flags)


def stop_points(p: PoolPresence, kv_pages: int) -> set[int]:
    """The stop points in ``1..kv_pages`` this pool can serve."""
    if p.policy == ALL_PAGES:
        return set(range(1, min(leading(p.present), kv_pages) + 1))
    if p.policy == TRAILING_PAGES:
        w = max(1, p.window)
        ok = list(p.present[:kv_pages]) + [False] * max(0, kv_pages - len(p.present))
        return {end for end in range(1, kv_pages + 1) if all(ok[max(0, end - w):end])}
    raise ValueError(f"policy {p.policy!r} does not gate stop points")


def group_pages_covered(p: PoolPresence, span_pages: int) -> int:
    """FULL pages covered by the leading complete key groups of a block_groups pool."""
    if p.block_pages <= 0 or p.group_pages <= 0:
        return 0
    groups = len(p.present) // p.group_pages
    whole = 0
    while whole < groups and all(p.present[whole * p.group_pages:(whole + 1) * p.group_pages]):
        whole += 1
    return min(whole * p.block_pages, span_pages)


def resolve(kv_pages: int, pools: Sequence[PoolPresence], span_pages: int,
            kv_name="kv") -> HitVerdict:
    """Combine the KV run with every pool's presence into SGLang's verdict."""
    hits: dict = {kv_name: kv_pages} if kv_pages else {}
    restorable = set(range(1, kv_pages + 1))
    for p in pools:
        if p.policy == BLOCK_GROUPS:
            covered = group_pages_covered(p, span_pages)
            if covered:
                hits[p.name] = covered
            continue
        points = stop_points(p, kv_pages)
        if points:
            hits[p.name] = max(points)
        restorable &= points
    ordered = sorted(restorable)
    return HitVerdict(ordered[-1] if ordered else 0, hits, ordered)
