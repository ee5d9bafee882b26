"""Argument checks of the client's batch calls (caller input, never trusted)."""
from __future__ import annotations

from typing import Sequence

import numpy as np


def check_keys(keys: Sequence[str]) -> list[str]:
    """The keys as a list; ValueError unless each is a non-empty str."""
    keys = list(keys)
    if set(map(type, keys)) <= {str} and all(keys):   # the usual case, checked in C
        return keys
    for k in keys:
        if not isinstance(k, str) or not k:
            raise ValueError(f"keys must be non-empty strings, got {k!r}")
    return keys


def check_batch(keys, ptrs, sizes) -> tuple[list[str], list[int], list[int]]:
    """(keys, pointers, sizes) as lists of str / int; ValueError on lengths that differ, a
    negative size or a null pointer with a size."""
    keys, ptrs, sizes = check_keys(keys), list(ptrs), list(sizes)
    if not len(keys) == len(ptrs) == len(sizes):
        raise ValueError(f"{len(keys)} keys, {len(ptrs)} pointers and {len(sizes)} sizes: lengths differ")
    if (set(map(type, ptrs)) | set(map(type, sizes))) <= {int} and (not sizes or min(sizes) >= 0) \
            and (not ptrs or min(ptrs) > 0):
        return keys, ptrs, sizes        # the usual batch, checked in C
    for p, s in zip(ptrs, sizes):
        if not isinstance(p, (int, np.integer)) or not isinstance(s, (int, np.integer)) or s < 0 or (p == 0 and s > 0):
            raise ValueError(f"bad pointer/size pair ({p!r}, {s!r})")
    return keys, [int(p) for p in ptrs], [int(s) for s in sizes]
