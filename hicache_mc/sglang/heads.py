"""Head groups: MHA pages that instances of other TP sizes read (docs/sglang.md, "Mixed TP sizes").

A TP rank of an MHA model holds ``H / tp`` of the model's KV heads, and its pages are stored
under the namespace of that TP size and rank (``keys.py``). With ``tp_lcm_size`` = G (SGLang's
own extra-config key: a common multiple of the TP sizes that share the store, the least one
being the natural choice), a rank stores each page as ``G / tp`` head groups instead, group
``g`` being the heads that rank ``g`` of a TP-G instance holds, under that rank's namespace.
So group objects are byte for byte what a TP-G instance stores, and any instance whose TP size
divides G finds its heads as a run of whole groups: a TP-1 reader loads G groups per part, a
TP-G reader one. The keys of a rank that stores one group (G = tp, or no ``tp_lcm_size``) are
the same as without this module: equal TP sizes pay no extra keys or copies.

Only ``page_head`` makes this zero-copy: a part of a page is ``[heads][tokens][layers][dim]``,
so a group is one contiguous range of it (SGLang's ``get_split_heads_page_buffer_meta``). The
other layouts interleave the heads of every token and layer; splitting them would take a
gather per page, so they are refused with ``tp_lcm_size`` above the TP size, as is a head count
that G / tp does not divide. MLA pages are the same on every rank and never split.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError

SPLIT_LAYOUT = "page_head"


@dataclass(frozen=True)
class HeadGroups:
    """The groups one rank stores: ranks ``first .. first + count - 1`` of TP size ``size``."""
    size: int     # the TP size the groups are named after (G)
    first: int    # this rank's first group
    count: int    # groups per page and part (G / tp); 1 = the rank's own heads

    @property
    def ranks(self) -> range:
        return range(self.first, self.first + self.count)


def head_groups(storage_config, pool, layout: str, is_mla: bool) -> HeadGroups:
    """This rank's head groups; ConfigError when ``tp_lcm_size`` cannot be honoured."""
    tp, rank = int(storage_config.tp_size), int(storage_config.tp_rank)
    lcm = int(getattr(storage_config, "tp_lcm_size", None) or tp)
    if is_mla or lcm == tp:
        return HeadGroups(tp, rank, 1)
    if lcm < tp or lcm % tp:
        raise ConfigError(f"tp_lcm_size {lcm} is not a multiple of this instance's TP size {tp}")
    split = lcm // tp
    if layout != SPLIT_LAYOUT:
        raise ConfigError(f"tp_lcm_size {lcm} (head groups for other TP sizes) needs "
                          f"--hicache-mem-layout {SPLIT_LAYOUT}, not {layout!r}")
    heads = int(pool.head_num)
    if heads % split:
        raise ConfigError(f"tp_lcm_size {lcm}: this rank's {heads} KV heads do not split into "
                          f"{split} groups of whole heads")
    return HeadGroups(lcm, rank * split, split)
