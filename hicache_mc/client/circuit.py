"""The client's circuit breaker: after repeated failures, calls answer misses at once."""
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

    def __init__(self, failures: int, open_s: float):
        self.limit, self.open_s = failures, open_s
        self.failures, self.open_until, self.opens = 0, 0.0, 0
        self.lock = threading.Lock()

    def allow(self) -> bool:
        return time.monotonic() >= self.open_until

    def ok(self) -> None:
        with self.lock:
            if self.failures >= self.limit:
                log.info("store reachable again; circuit closed")
            self.failures = 0

    def fail(self, exc: Exception) -> None:
        with self.lock:
            self.failures += 1
            if self.failures == 1:     # a token problem will not mend: an error, not a warning
                log.log(logging.ERROR if isinstance(exc, Misconfigured) else logging.WARNING,
                        "store call failed: %s", exc)
            if self.failures >= self.limit:
                if self.failures == self.limit:
                    log.warning("%d failures in a row: answering misses for %.1fs", self.limit, self.open_s)
                    self.opens += 1
                self.open_until = time.monotonic() + self.open_s
