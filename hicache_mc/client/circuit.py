"""The client's circuit breakers: after repeated failures, calls answer misses at once. One
guards the master; one per node guards that node alone, so one dead node does not stop a
client's reads and writes on the others."""
from __future__ import annotations

import logging
import threading
import time

from ..errors import Misconfigured

log = logging.getLogger(__name__)


class Circuit:
    """Consecutive-failure breaker shared by all threads of one client: after ``failures``
    failures in a row, ``allow`` is False for ``open_s``; the next call after that is a probe,
    and a success closes the circuit."""

    def __init__(self, failures: int, open_s: float, what: str = "the store"):
        self.limit, self.open_s, self.what = failures, open_s, what
        self.failures, self.open_until, self.opens = 0, 0.0, 0
        self.lock = threading.Lock()

    def allow(self) -> bool:
        return time.monotonic() >= self.open_until

    def ok(self) -> None:
        with self.lock:
            if self.failures >= self.limit:
                log.info("%s reachable again; circuit closed", self.what)
            self.failures = 0

    def fail(self, exc: Exception) -> None:
        with self.lock:
            self.failures += 1
            if self.failures == 1:     # a token problem will not mend: an error, not a warning
                log.log(logging.ERROR if isinstance(exc, Misconfigured) else logging.WARNING,
                        "store call failed: %s", exc)
            if self.failures >= self.limit:
                if self.failures == self.limit:
                    log.warning("%s: %d failures in a row: answering misses for %.1fs", self.what,
                                self.limit, self.open_s)
                    self.opens += 1
                self.open_until = time.monotonic() + self.open_s


class NodeCircuits:
    """A ``Circuit`` per node id, made on first use."""

    def __init__(self, failures: int, open_s: float):
        self.failures, self.open_s = failures, open_s
        self._by_node: dict[str, Circuit] = {}
        self.lock = threading.Lock()

    def of(self, node_id: str) -> Circuit:
        c = self._by_node.get(node_id)
        if c is None:
            with self.lock:
                c = self._by_node.setdefault(node_id, Circuit(self.failures, self.open_s,
                                                              f"node {node_id}"))
        return c

    def open_ids(self) -> list[str]:
        """The nodes whose circuit is open now: calls leave them out."""
        return [n for n, c in list(self._by_node.items()) if not c.allow()]

    @property
    def opens(self) -> int:
        return sum(c.opens for c in list(self._by_node.values()))
