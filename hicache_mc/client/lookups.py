"""StoreClient's lookups (a mixin: the client's master channel, circuits, fences and view).

The residency view (client/view.py) answers the keys it holds; the master the others, in the
same call: another client's commit reaches the view a publish after the master has it, so a
key committed before the call is never a miss (tests/integration/test_residency.py).
"""
from __future__ import annotations

from typing import Optional, Sequence

from .. import protocol as P
from ..keys import batch_page_keys
from .batch import check_keys


class LookupPath:
    """``batch_exists`` / ``batch_exists_pages`` / ``batch_contains`` / ``contains_cached``."""

    def batch_exists(self, keys: Sequence[str]) -> int:
        """How many keys, from the first, are stored (0 when the store is unreachable)."""
        keys = check_keys(keys)
        if not keys:
            return 0
        return self._guard(lambda: self._exists(keys), 0)

    def batch_exists_pages(self, namespace: str, page_hashes: Sequence[str], parts: tuple[str, ...]) -> int:
        """How many pages, from the first, have all their keys ``<namespace>/<hash>/<part>``
        stored: the residency view answers the pages it holds from the page hashes, without
        building the keys; the master the rest."""
        pages = None
        if self.view is not None and page_hashes and parts and not self._closed and self.circuit.allow():
            pages = self.view.exists_pages(namespace, page_hashes, parts)
            if pages == len(page_hashes):
                return pages
            if pages is not None:
                self.view.counters["view_misses_asked"] += 1
        start = pages or 0
        keys = check_keys(batch_page_keys(namespace, list(page_hashes[start:]), parts))
        return start + self._guard(lambda: self._exists(keys, pages is None), 0) // max(1, len(parts))

    def follow(self, namespace: str) -> None:
        """Keep the residency view of ``namespace`` from now on (a lookup in one starts it too)."""
        if self.view is not None:
            self.view.follow(namespace)

    def _exists(self, keys: list[str], use_view: bool = True) -> int:
        start = self.view.exists(keys) if self.view is not None and use_view else None
        if start == len(keys):
            return start
        if start is not None:
            self.view.counters["view_misses_asked"] += 1
        start = start or 0
        reply = self._master(P.ExistsRequest(keys[start:], self.fences.after(), self.host,
                                             self.node_circuits.open_ids()), self._deadline())
        self._learn(reply.nodes)
        self._where.keep(keys[start:], reply.located())
        return start + reply.count

    def batch_contains(self, keys: Sequence[str]) -> list[bool]:
        """Per key: is it stored? (``batch_exists`` answers the leading run only.) The view
        answers the keys it holds, the master the others."""
        keys = check_keys(keys)
        if not keys:
            return []
        def run():
            found = self.view.contains(keys) if self.view is not None else None
            ask = range(len(keys)) if found is None else [i for i, f in enumerate(found) if not f]
            if ask:
                if found is not None:
                    self.view.counters["view_misses_asked"] += 1
                found = found or [False] * len(keys)
                present = self._master(P.ContainsRequest([keys[i] for i in ask], self.fences.after()),
                                       self._deadline()).present
                for i, p in zip(ask, present):
                    found[i] = bool(p)
            return found
        return self._guard(run, [False] * len(keys))

    def contains_cached(self, keys: Sequence[str]) -> Optional[list[bool]]:
        """Per key, from the residency view alone: is it stored? None when the view cannot
        answer (off, or not in sync); never a round trip, so a caller may ask in passing."""
        keys = check_keys(keys)
        if self.view is None or not keys:
            return None if self.view is None else []
        return self.view.contains(keys)
