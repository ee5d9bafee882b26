"""Lookup hits and misses per key namespace, for the master's metrics, with bounded labels.

Every namespace a lookup names could become a metric label, and a client chooses its keys: so
at most ``MAX_TENANT_LABELS`` namespaces of one tenant get their own counters, the tenant's
others are summed as ``(other)@<tenant>``, and past ``MAX_LABELS`` rows in all, new
namespaces of any tenant are summed as ``(other)``. A tenant that looks up thousands of
namespaces thus takes a bounded share of the labels, and the other tenants keep theirs.
"""
from __future__ import annotations

from ..keys import TENANT_SEP, tenant_of

MAX_LABELS = 1000           # rows (label values) in all
MAX_TENANT_LABELS = 32      # namespaces of one tenant with rows of their own
OTHER = "(other)"


class NamespaceCounts:
    """namespace label -> [hits, misses]."""

    def __init__(self):
        self.rows: dict[str, list[int]] = {}
        self._labels: dict[str, str] = {}       # namespace -> the row it counts in
        self._per_tenant: dict[str, int] = {}   # tenant -> namespaces with rows of their own

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
        label = self._labels.get(ns)
        if label is None:
            label = self._label(ns)
        row = self.rows.get(label)
        if row is None:
            row = self.rows[label] = [0, 0]
        row[0] += hits
        row[1] += misses

    def _label(self, ns: str) -> str:
        """The row a namespace without one counts in (remembered while the rows have room)."""
        tenant = tenant_of(ns + "/")
        room = len(self.rows) < MAX_LABELS
        if room and self._per_tenant.get(tenant, 0) < MAX_TENANT_LABELS:
            self._per_tenant[tenant] = self._per_tenant.get(tenant, 0) + 1
            self._labels[ns] = ns
            return ns
        other = f"{OTHER}{TENANT_SEP}{tenant}" if tenant else OTHER
        return other if room or other in self.rows else OTHER
