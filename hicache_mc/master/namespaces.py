"""Lookup hits and misses per key namespace, for the master's metrics, with bounded labels:
the first ``MAX_LABELS`` namespaces get counters of their own, the rest are summed as
``(other)``."""
from __future__ import annotations

MAX_LABELS = 1000           # rows (label values) in all
OTHER = "(other)"


class NamespaceCounts:
    """namespace label -> [hits, misses]."""

    def __init__(self):
        self.rows: dict[str, list[int]] = {}

    def count(self, keys: list[str], hits: list[bool]) -> None:
        """Hits and misses of a lookup's ``keys`` (``hits[i]`` for ``keys[i]``; keys past the
        end of ``hits`` are misses), per namespace (the part of a key before its first '/')."""
        if not keys:
            return
        first = keys[0].partition("/")
        prefix = first[0] + "/"
        # every key between the least and the greatest shares a prefix both have
        if first[1] and min(keys).startswith(prefix) and max(keys).startswith(prefix):
            found = sum(hits)   # the usual batch: one namespace
            self.add(first[0], found, len(keys) - found)
            return
        hits = list(hits) + [False] * (len(keys) - len(hits))
        for key, hit in zip(keys, hits):
            self.add(key.partition("/")[0] if "/" in key else "", int(hit), int(not hit))

    def add(self, ns: str, hits: int, misses: int) -> None:
        row = self.rows.get(ns)
        if row is None:
            if len(self.rows) >= MAX_LABELS:
                ns = OTHER
            row = self.rows.setdefault(ns, [0, 0])
        row[0] += hits
        row[1] += misses
