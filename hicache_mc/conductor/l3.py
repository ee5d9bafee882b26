"""The shared L3's residency, as the router asks for it: the leading pages of a chain that
hicache-mc holds, answered from a ``StoreClient``'s residency view (client/view.py) in the
conductor's own process, without the KV-event bridge.

A lookup never blocks the event loop: it reads the view only (a lock-free array lookup,
~12-30 µs for 128 pages); while the view is not in sync (at start, after a gap or a master
restart, until its new snapshot lands) it answers 0 pages and counts it, and the router
routes as if the L3 held nothing, which costs hits, never a wrong page.
"""
from __future__ import annotations

from typing import Sequence

from ..client import StoreClient
from ..keys import batch_page_keys


class L3View:
    """``L3View(master, namespace)(page_hashes)`` -> pages held, from the start."""

    def __init__(self, master: str, namespace: str, token: str = "", parts: tuple = ("k", "v")):
        self.client = StoreClient(master, token=token, view="on")
        self.ns, self.parts = namespace, tuple(parts)
        self.client.follow(namespace)
        self.answers = self.unsynced = 0

    def __call__(self, page_hashes: Sequence[str]) -> int:
        if not page_hashes:
            return 0
        found = self.client.view.exists(batch_page_keys(self.ns, list(page_hashes), self.parts))
        if found is None:
            self.unsynced += 1
            return 0
        self.answers += 1
        return found // len(self.parts)

    def close(self) -> None:
        self.client.close()
