"""One worker's load as the router knows it: its last load report plus what it sent since.

- **Prefill queue.** The router's own accounting is a virtual clock, ``busy_until``: each
  request it sends adds its predicted prefill work (compute plus the fetch on the critical path)
  after whatever is queued; each ``Started`` re-anchors it at that first token plus the work
  still unstarted. A load report at ``at_s`` gives a second estimate: its waiting prompt tokens
  at this worker's recent seconds per prompt token, drained since ``at_s``, plus the work sent
  after ``at_s``. The queue is the larger of the two: the report brings in load the router did
  not send (other routers, retries), the router's own count brings in what the report has not
  seen yet (and the request now in prefill, which no report lists as waiting).
- **Decode batch.** The requests started here and not finished, plus those of the last report
  this router did not send (its running count and KV tokens beyond the router's own at that
  moment). ``decode_at`` predicts the batch a request will meet when its prefill ends: the
  running requests whose expected end is later, the queued ones that start before it.
- **KV room.** A request starts its prefill only when the GPU pool has room for it: a worker
  with long prompts in its decode batch is bound by memory, not compute, and its queue waits
  for decodes to end. Each request in flight is counted at its prompt plus its expected output
  (SGLang reserves room for the output to come); ``room_wait_s`` is when the running requests'
  predicted ends (first token + expected output x TBT) free enough for the queue and the new
  request. The pool's size is ``WorkerSpec.l1_pages`` (0: unknown, no memory bound).
- **Fallbacks.** No report, or one older than ``stale_s``: the router's own count alone. A
  request whose ``Started`` and ``Finished`` never come is dropped after ``LOST_AFTER_S``.
"""
from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass
from itertools import accumulate
from typing import NamedTuple, Optional

from .api import LoadReport

LOST_AFTER_S = 600.0          # a request unheard of for this long is no longer counted
REPORT_STALE_S = 2.0          # a report older than this is ignored (the default poll is 0.5 s)
SPT_EMA = 0.1                 # weight of the newest request in seconds-per-prompt-token


@dataclass
class InFlight:
    """A request this router sent here, as it predicted it."""
    rid: str
    dispatched_s: float
    prompt_tokens: int
    work_s: float                     # load + prefill compute on the GPU (0: decode only)
    out_tokens: float                 # expected output tokens
    after_report: bool = True         # sent after the last report's at_s
    started_s: Optional[float] = None
    batch_at_start: float = 0.0       # the decode batch it met (for the decode fit)
    kv_at_start: float = 0.0


class DecodeLoad(NamedTuple):
    batch: float
    kv_tokens: float


class WorkerLoad:
    """See the module docstring."""

    def __init__(self, stale_s: float = REPORT_STALE_S, capacity_tokens: int = 0):
        self.stale_s = stale_s
        self.capacity = capacity_tokens              # the GPU pool, tokens (0: unknown)
        self._held = 0.0                             # prompt + expected output, in flight
        self._ends: Optional[tuple[list, list]] = None   # release schedule, until a change
        self.busy_until = 0.0
        self.unstarted: dict[str, InFlight] = {}     # in the order they were sent
        self.running: dict[str, InFlight] = {}
        self._unstarted_work = 0.0
        self._since_report_work = 0.0
        self._running_kv = 0.0
        self._report: Optional[LoadReport] = None
        self._external = DecodeLoad(0.0, 0.0)
        self.spt = 0.0                               # prefill seconds per prompt token

    # ------------------------------------------------------------ accounting

    def dispatch(self, r: InFlight, now: float) -> None:
        self.unstarted[r.rid] = r
        self._held += r.prompt_tokens + r.out_tokens
        self._unstarted_work += r.work_s
        self._since_report_work += r.work_s
        self.busy_until = max(self.busy_until, now) + r.work_s
        if r.work_s > 0 and r.prompt_tokens > 0:
            s = r.work_s / r.prompt_tokens
            self.spt = s if not self.spt else (1 - SPT_EMA) * self.spt + SPT_EMA * s

    def started(self, rid: str, at_s: float, decode: DecodeLoad) -> Optional[InFlight]:
        r = self.unstarted.pop(rid, None)
        if r is None:
            return None
        self._forget_unstarted(r)
        self.busy_until = at_s + self._unstarted_work
        r.started_s, r.batch_at_start, r.kv_at_start = at_s, decode.batch, decode.kv_tokens
        self.running[rid] = r
        self._running_kv += r.prompt_tokens + r.out_tokens / 2
        self._ends = None
        return r

    def finished(self, rid: str) -> Optional[InFlight]:
        r = self.running.pop(rid, None)
        if r is not None:
            self._running_kv -= r.prompt_tokens + r.out_tokens / 2
            self._ends = None
        else:
            r = self.unstarted.pop(rid, None)
            if r is not None:                        # ended before its first token
                self._forget_unstarted(r)
                self.busy_until -= r.work_s
        if r is not None:
            self._held -= r.prompt_tokens + r.out_tokens
        return r

    def _forget_unstarted(self, r: InFlight) -> None:
        self._unstarted_work -= r.work_s
        if r.after_report:
            self._since_report_work -= r.work_s

    def report(self, rep: LoadReport) -> None:
        if self._report is not None and rep.at_s < self._report.at_s:
            return                                   # an older report, arrived late
        self._report = rep
        self._since_report_work = 0.0
        for r in self.unstarted.values():
            r.after_report = r.dispatched_s > rep.at_s
            if r.after_report:
                self._since_report_work += r.work_s
        own_kv = self._running_kv
        self._external = DecodeLoad(max(0.0, rep.running_reqs - len(self.running)),
                                    max(0.0, rep.running_tokens - own_kv))
        self.expire(rep.at_s)

    def expire(self, now: float) -> None:
        """Drop requests unheard of for LOST_AFTER_S (their Started / Finished were lost)."""
        for book in (self.unstarted, self.running):
            old = [r for r in book.values() if now - r.dispatched_s > LOST_AFTER_S]
            for r in old:
                self.finished(r.rid)

    # ------------------------------------------------------------- estimates

    def _fresh(self, now: float) -> Optional[LoadReport]:
        rep = self._report
        return rep if rep is not None and now - rep.at_s <= self.stale_s else None

    def queue_s(self, now: float, fleet_spt: float) -> float:
        """Predicted wait before a request sent now starts its prefill here. ``fleet_spt``:
        seconds per prompt token for a worker this router has sent nothing yet."""
        own = self.busy_until - now
        rep = self._fresh(now)
        if rep is not None and rep.waiting_tokens:
            reported = rep.waiting_tokens * (self.spt or fleet_spt) - (now - rep.at_s)
            own = max(own, max(0.0, reported) + self._since_report_work)
        return max(0.0, own)

    def room_wait_s(self, now: float, need_tokens: float, tbt_s: float) -> float:
        """How long until the pool has room for the queue and ``need_tokens`` more: when the
        running requests expected to end first have freed enough."""
        deficit = self._held + need_tokens - self.capacity
        if not self.capacity or deficit <= 0 or not self.running:
            return 0.0
        if self._ends is None:
            ends = sorted((self._end(r, now, tbt_s), r.prompt_tokens + r.out_tokens)
                          for r in self.running.values())
            self._ends = ([e for e, _ in ends], list(accumulate(k for _, k in ends)))
        times, freed = self._ends
        i = bisect_left(freed, deficit)
        if i < len(times):
            return max(0.0, times[i] - now)
        # more than the whole batch: the queued requests must end too, at the batch's pace
        span = max(times[-1] - now, tbt_s)
        return span * deficit / freed[-1]

    @staticmethod
    def _end(r: InFlight, now: float, tbt_s: float) -> float:
        end = r.started_s + r.out_tokens * tbt_s
        # past its expected end it runs on: say half an expected output more
        return end if end > now else now + r.out_tokens * tbt_s / 2

    def decode(self, now: float) -> DecodeLoad:
        """The decode batch here now."""
        ext = self._external if self._fresh(now) is not None else DecodeLoad(0.0, 0.0)
        return DecodeLoad(len(self.running) + ext.batch, self._running_kv + ext.kv_tokens)

    def decode_at(self, now: float, at_s: float, tbt_s: float) -> DecodeLoad:
        """The decode batch here at ``at_s``: who still runs then, and who started by then."""
        batch, kv = 0.0, 0.0
        for r in self.running.values():
            done = (at_s - r.started_s) / tbt_s if tbt_s > 0 else 0.0
            if done < r.out_tokens:
                batch += 1
                kv += r.prompt_tokens + done
        for r in self.unstarted.values():            # queued ahead: decoding by then
            batch += 1
            kv += r.prompt_tokens
        ext = self._external if self._fresh(now) is not None else DecodeLoad(0.0, 0.0)
        return DecodeLoad(batch + ext.batch, kv + ext.kv_tokens)
