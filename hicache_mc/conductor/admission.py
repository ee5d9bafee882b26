"""Admission: whether a request's best placement meets its SLOs, else an early rejection.

- ``Admission.OFF`` admits everything; ``EARLY`` (Algorithm 1) rejects a request whose
  predicted TTFT, or whose TBT in the decode batch it joins now, exceeds its SLO by more than
  ``tolerance`` (a share of the SLO; negative: a margin below it); ``PREDICTIVE`` judges the
  TBT in the decode batch predicted for when the prefill ends.
- **The cascade.** A rejected request computes nothing, so the next turn of its conversation
  finds its pages in no cache, costs more and is rejected in turn. The gate remembers the last
  page of each rejected prompt that no cache held (a page only that conversation has: a page
  shared by other requests was cached somewhere), and a request whose chain holds one of those
  pages is judged with ``cascade_tolerance`` instead: a conversation already refused once gets
  the room. The memory is bounded (``REJECTED_MEMORY`` pages, oldest first) and a page leaves
  it when its conversation's next turn is admitted.
"""
from __future__ import annotations

import enum
from collections import OrderedDict, deque
from typing import NamedTuple, Optional, Sequence

from .api import Prediction, RejectReason, Rejection, Request

REJECTED_MEMORY = 65_536      # pages of rejected prompts remembered (8 B of key + ~100 B each)
ERRORS_KEPT = 512             # recent (actual + c) / (predicted + c) TTFT ratios
ERROR_FLOOR_S = 0.1           # c: a 10 ms prediction that took 50 ms is not a 5x error
ERRORS_REFRESH = 64           # re-read the quantile every this many samples


class Admission(enum.Enum):
    OFF = "off"
    EARLY = "early"               # Algorithm 1: predicted TTFT and the current decode batch's TBT
    PREDICTIVE = "predictive"     # the TBT of the decode batch predicted at the prefill's end


class Limits(NamedTuple):
    ttft_s: float
    tbt_s: float
    error: float = 1.0            # the predicted TTFT is judged as (ttft + c) x error - c

    def met(self, p: Prediction) -> bool:
        return not self.late(p.ttft_s) and p.tbt_s <= self.tbt_s

    def late(self, ttft_s: float) -> bool:
        """A predicted TTFT, judged at the recent errors, exceeds the TTFT SLO."""
        return (ttft_s + ERROR_FLOOR_S) * self.error - ERROR_FLOOR_S > self.ttft_s

    def queued_late(self, fastest_s: float, idle_s: float, share: float) -> bool:
        """Triage (admission off): the queues make a request late on every worker. Its
        fastest TTFT is judged late and is over ``share`` of the SLO as predicted, while on
        an idle worker (``idle_s``: its fetch and prefill) it would be on time."""
        return idle_s <= self.ttft_s and fastest_s > share * self.ttft_s and self.late(fastest_s)


class Gate:
    """See the module docstring."""

    def __init__(self, mode: Admission, tolerance: float, cascade_tolerance: float,
                 ttft_slo_s: float, tbt_slo_s: float, memory: int = REJECTED_MEMORY,
                 quantile: float = 0.0):
        self.mode, self.tolerance, self.cascade_tolerance = mode, tolerance, cascade_tolerance
        self.ttft_slo_s, self.tbt_slo_s, self.memory = ttft_slo_s, tbt_slo_s, memory
        self.quantile = quantile
        self._rejected: OrderedDict[int, None] = OrderedDict()
        self._errors: deque = deque(maxlen=ERRORS_KEPT)
        self._new_errors = 0
        self.error = 1.0
        self.cascades_admitted = 0

    def observe(self, predicted_ttft_s: float, actual_ttft_s: float) -> None:
        """An admitted request's TTFT, against its prediction."""
        if not self.quantile:
            return
        self._errors.append((actual_ttft_s + ERROR_FLOOR_S) / (predicted_ttft_s + ERROR_FLOOR_S))
        self._new_errors += 1
        if self._new_errors >= ERRORS_REFRESH:
            self._new_errors = 0
            ranked = sorted(self._errors)
            self.error = ranked[min(len(ranked) - 1, int(self.quantile * len(ranked)))]

    @property
    def open(self) -> bool:
        return self.mode is Admission.OFF

    def limits(self, req: Request, tolerance: Optional[float] = None) -> Limits:
        k = 1 + (self.tolerance if tolerance is None else tolerance)
        return Limits((req.ttft_slo_s or self.ttft_slo_s) * k,
                      (req.tbt_slo_s or self.tbt_slo_s) * k, self.error)

    def continued(self, blocks: Sequence[int]) -> Optional[int]:
        """The remembered page of a rejected prompt that ``blocks`` continues, if any."""
        if not self._rejected:
            return None
        hit = next(filter(self._rejected.__contains__, reversed(blocks)), None)
        return hit

    def admitted_cascade(self, page: int) -> None:
        self._rejected.pop(page, None)
        self.cascades_admitted += 1

    def remember(self, page: int) -> None:
        """A rejected prompt's last page, held by no cache."""
        self._rejected[page] = None
        self._rejected.move_to_end(page)
        while len(self._rejected) > self.memory:
            self._rejected.popitem(last=False)

    def reject(self, p: Prediction, limits: Limits, out_tokens: float) -> Rejection:
        if p.ttft_s > limits.ttft_s:
            return Rejection(RejectReason.TTFT_SLO, max(0.1, p.ttft_s - limits.ttft_s), p,
                             f"predicted TTFT {p.ttft_s:.3f}s > {limits.ttft_s:.3f}s")
        # retry once about one request of the batch has finished its decode
        return Rejection(RejectReason.TBT_SLO, max(0.1, p.tbt_s * out_tokens), p,
                         f"predicted TBT {p.tbt_s * 1e3:.1f}ms > {limits.tbt_s * 1e3:.1f}ms")
