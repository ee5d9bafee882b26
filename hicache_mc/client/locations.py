"""Locations an Exists returned, kept for the get that usually follows (SGLang: the prefetch
probe, then the I/O thread's read), saving one master round trip."""
from __future__ import annotations

import time
from itertools import repeat
from typing import Optional

# Brief, because an object may be evicted or moved meanwhile: then the node answers "missing"
# and the read is a miss, as it would be.
LOCATION_TTL_S = 1.0
LOCATION_CACHE_MAX = 1 << 16


class Locations:
    """key -> (node id, size) from recent Exists replies (threads share it without a lock)."""

    def __init__(self):
        self._where: dict[str, tuple[float, Optional[tuple]]] = {}   # key -> (expiry, entry)

    def keep(self, keys: list[str], entries: list) -> None:
        if len(self._where) > LOCATION_CACHE_MAX:
            self._where.clear()
        self._where.update(zip(keys, zip(repeat(time.monotonic() + LOCATION_TTL_S), entries)))

    def take(self, keys: list[str], down: list[str]) -> Optional[list]:
        """The entries for all of ``keys`` (each used once), or None when one is missing,
        old, or on a node in ``down`` (then a Locate finds another copy)."""
        now, where = time.monotonic(), self._where
        entries = []
        for key in keys:
            hit = where.pop(key, None)
            if hit is None or hit[0] < now or (hit[1] and hit[1][0] in down):
                return None
            entries.append(hit[1])
        return entries
