"""The Conductor: KVCache-centric scheduling (Mooncake FAST'25, Algorithm 1) as an api.Router.

Per request, for every prefill-capable worker ``w`` (one pass over the chain for all of them,
index.py):

    TTFT(w) = queue(w) + fetch(w) + prefill(w)

- ``queue``: load.py (the last load report plus what this router sent since);
- the prefix ``w`` can use: its L1 pages, then its L2 pages, then the pages the shared L3
  holds beyond those (the residency view: one lookup per request, shared by all workers);
- pull or recompute, per worker and tier: the TTFT with the prefix cut after L1, after L2
  and after L3, the lowest kept (with prefill concave in the cached length and fetch linear
  in it, one of these cuts is the optimum);
- ``fetch`` and ``prefill``: model.py (bandwidths of the worker's paths; the online fits).

The request goes to the lowest ``score = TTFT + work_weight x work``, where ``work`` is the
GPU time it costs there (its prefill compute and the fetch on the critical path):
``work_weight = 0`` is Algorithm 1 as written. Ties go to the smaller decode batch, then in
turn.

Admission (``Admission``): ``OFF`` never rejects; ``EARLY`` rejects when the predicted TTFT
or TBT exceeds its SLO by more than ``slo_tolerance`` (the TBT of the decode batch the request
joins now); ``PREDICTIVE`` judges the TBT against the decode batch predicted for when its
prefill ends. A candidate that misses an SLO makes way for the next best (up to
``ADMISSION_CANDIDATES``) before the request is rejected.

PD mode: ``Role.PREFILL`` workers are candidates for the prefill; the decode worker is the
``Role.DECODE`` worker with the lowest predicted TBT; a rejection checks both.

With ``l3_aware=False`` the core ignores the shared L3 (the paper's local cache-aware variant).
"""
from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, replace
from typing import NamedTuple, Optional, Sequence, Union

from .api import (Decision, Event, Finished, L3Lookup, LoadReport, Prediction, RejectReason,
                  Rejection, Request, Role, Started, Tier, WorkerSpec)
from .chain import block_hash
from .index import MAX_BLOCKS, BlockIndex, Prefix
from .load import REPORT_STALE_S, SPT_EMA, InFlight, WorkerLoad
from .model import DECODE_PRIOR, PREFILL_PRIOR, DecodeModel, Overlap, Paths, PrefillModel

ADMISSION_CANDIDATES = 4      # workers tried, best score first, before a request is rejected
OUT_TOKENS_EMA = 0.05         # weight of the newest finished request in the expected output
UNQUEUED_FRACTION = 0.05      # a TTFT is a prefill sample when its predicted queue was below this share


class Admission(enum.Enum):
    OFF = "off"
    EARLY = "early"               # Algorithm 1: predicted TTFT and the current decode batch's TBT
    PREDICTIVE = "predictive"     # the TBT of the decode batch predicted at the prefill's end


@dataclass(frozen=True)
class ConductorConfig:
    ttft_slo_s: float = 2.0               # for requests that carry no SLO of their own
    tbt_slo_s: float = 0.1
    admission: Admission = Admission.OFF
    slo_tolerance: float = 0.1            # reject above SLO x (1 + tolerance), never at it
    l3_aware: bool = True                 # False: the paper's local cache-aware variant
    overlap: Overlap = Overlap.NONE
    work_weight: float = 0.0              # 0: Algorithm 1 as written
    max_blocks: int = MAX_BLOCKS
    report_stale_s: float = REPORT_STALE_S
    out_tokens: float = 256.0             # expected output tokens before any request finished
    prefill_prior: tuple = PREFILL_PRIOR  # model.py: generic priors the online fits start from
    decode_prior: tuple = DECODE_PRIOR


class _Worker:
    __slots__ = ("spec", "paths", "load", "pos")

    def __init__(self, spec: WorkerSpec, stale_s: float, pos: int):
        self.spec, self.paths, self.load, self.pos = spec, Paths.of(spec), WorkerLoad(stale_s), pos


class _Sent(NamedTuple):
    prefill: str
    decode: Optional[str]
    prediction: Prediction


class _Scored(NamedTuple):
    score: float
    batch: float                  # ties: the smaller decode batch, then in turn
    turn: int
    worker: str
    queue_s: float
    cost: "_Cost"


class Conductor:
    """See the module docstring. Not thread-safe: one caller at a time."""

    def __init__(self, l3: Optional[L3Lookup] = None, config: ConductorConfig = ConductorConfig()):
        self.config = config
        self.l3 = l3 if config.l3_aware else None
        self.index = BlockIndex(config.max_blocks)
        self.prefill_model = PrefillModel(config.prefill_prior)
        self.decode_model = DecodeModel(config.decode_prior)
        self.out_tokens = config.out_tokens
        self._workers: dict[str, _Worker] = {}
        self._sent: dict[str, _Sent] = {}
        self._turn = itertools.count()
        self._spt = self.prefill_model.predict(1000, 0) / 1000   # fleet seconds per prompt token

    @staticmethod
    def variants() -> dict[str, ConductorConfig]:
        """Named configurations for comparisons (the fleet simulator's policy list)."""
        base = ConductorConfig()
        return {
            "conductor": base,
            "conductor-local": replace(base, l3_aware=False),
            "conductor-early": replace(base, admission=Admission.EARLY),
            "conductor-predictive": replace(base, admission=Admission.PREDICTIVE),
        }

    # ------------------------------------------------------------ the fleet

    def add_worker(self, spec: WorkerSpec) -> None:
        self.remove_worker(spec.name)
        self._workers[spec.name] = _Worker(spec, self.config.report_stale_s, len(self._workers))
        self.index.add_worker(spec.name)

    def remove_worker(self, name: str) -> None:
        if self._workers.pop(name, None) is not None:
            self.index.remove_worker(name)
            for pos, w in enumerate(self._workers.values()):
                w.pos = pos

    # ---------------------------------------------------------- observations

    def observe_events(self, events: Sequence[Event]) -> None:
        self.index.apply(events)

    def observe_load(self, report: LoadReport) -> None:
        w = self._workers.get(report.worker)
        if w is not None:
            w.load.report(report)

    def observe_started(self, started: Started) -> None:
        sent = self._sent.get(started.rid)
        if sent is None:
            return
        for name in (sent.prefill, sent.decode):
            w = self._workers.get(name) if name else None
            if w is not None:
                w.load.started(started.rid, started.at_s, w.load.decode(started.at_s))

    def observe_finished(self, finished: Finished) -> None:
        sent = self._sent.pop(finished.rid, None)
        if sent is None:
            return
        ended = {}
        for name in (sent.prefill, sent.decode):
            w = self._workers.get(name) if name else None
            if w is not None:
                ended[name] = w.load.finished(finished.rid)
        if finished.ok:
            self._learn(finished, sent, ended.get(sent.decode or sent.prefill))

    def _learn(self, f: Finished, sent: _Sent, decoded: Optional[InFlight]) -> None:
        cached = sum(f.cached_tokens.values())
        new = f.prompt_tokens - cached
        p = sent.prediction
        if f.prefill_s is not None:
            self.prefill_model.observe(new, cached, f.prefill_s)
        elif p.queue_s <= UNQUEUED_FRACTION * f.ttft_s:
            self.prefill_model.observe(new, cached, f.ttft_s - p.queue_s - p.fetch_s)
        if decoded is not None and decoded.started_s is not None and f.completion_tokens > 1:
            tbt = (f.at_s - decoded.started_s) / (f.completion_tokens - 1)
            self.decode_model.observe(decoded.batch_at_start + 1,
                                      decoded.kv_at_start + f.prompt_tokens, tbt)
        self.out_tokens += OUT_TOKENS_EMA * (f.completion_tokens - self.out_tokens)

    # -------------------------------------------------------------- routing

    def predict(self, req: Request, now_s: float) -> list[Prediction]:
        """Every prefill candidate's prediction for ``req``, best score first (no side effect)."""
        return [_prediction(s) for s in self._score(req, now_s, 0)]

    def route(self, req: Request, now_s: float) -> Union[Decision, Rejection]:
        scored = self._score(req, now_s, next(self._turn))
        if not scored:
            return Rejection(RejectReason.NO_WORKER, 1.0, reasons="no prefill worker")
        cfg = self.config
        ttft_slo = (req.ttft_slo_s or cfg.ttft_slo_s) * (1 + cfg.slo_tolerance)
        tbt_slo = (req.tbt_slo_s or cfg.tbt_slo_s) * (1 + cfg.slo_tolerance)
        out = self._expected_out(req)
        first = None
        for s in scored[:ADMISSION_CANDIDATES if cfg.admission is not Admission.OFF else 1]:
            p = _prediction(s)
            decode = self._decode_place(p, req, now_s, out)
            if decode is None:
                return Rejection(RejectReason.NO_WORKER, 1.0, p, "no decode worker")
            p = replace(p, tbt_s=decode[1])
            first = first or p
            if cfg.admission is Admission.OFF or (p.ttft_s <= ttft_slo and p.tbt_s <= tbt_slo):
                return self._send(req, now_s, s, p, decode[0], out)
        p = first
        if p.ttft_s > ttft_slo:
            return Rejection(RejectReason.TTFT_SLO, max(0.1, p.ttft_s - ttft_slo), p,
                             f"predicted TTFT {p.ttft_s:.3f}s > {ttft_slo:.3f}s")
        # retry once about one request of the batch has finished its decode
        return Rejection(RejectReason.TBT_SLO, max(0.1, p.tbt_s * out), p,
                         f"predicted TBT {p.tbt_s * 1e3:.1f}ms > {tbt_slo * 1e3:.1f}ms")

    def _expected_out(self, req: Request) -> float:
        return min(self.out_tokens, req.max_new_tokens) if req.max_new_tokens else self.out_tokens

    def _send(self, req: Request, now: float, s: _Scored, p: Prediction, decode: Optional[str],
              out: float) -> Decision:
        # the GPU's work: the load and the compute (the L3 prefetch runs beside the queue)
        work = s.cost.load_s + s.cost.prefill_s
        if req.prompt_tokens > 0:
            self._spt += SPT_EMA * (work / req.prompt_tokens - self._spt)
        self._workers[p.worker].load.dispatch(
            InFlight(req.rid, now, req.prompt_tokens, work, out), now)
        if decode is not None:
            self._workers[decode].load.dispatch(InFlight(req.rid, now, req.prompt_tokens, 0.0, out), now)
        self._sent[req.rid] = _Sent(p.worker, decode, p)
        return Decision(p.worker, p, decode)

    def _decode_place(self, p: Prediction, req: Request, now: float,
                      out: float) -> Optional[tuple[Optional[str], float]]:
        """(decode worker or None for the prefill worker itself, predicted TBT there)."""
        w = self._workers[p.worker]
        if w.spec.role is Role.BOTH:
            return None, self._tbt(w, req, now, p.ttft_s)
        best = None
        for d in self._workers.values():
            if d.spec.role is Role.DECODE:
                tbt = self._tbt(d, req, now, p.ttft_s)
                if best is None or tbt < best[1]:
                    best = (d.spec.name, tbt)
        return best

    def _tbt(self, w: _Worker, req: Request, now: float, ttft: float) -> float:
        if self.config.admission is Admission.PREDICTIVE:
            tbt_now = self.decode_model.predict(*w.load.decode(now))
            load = w.load.decode_at(now, now + ttft, tbt_now)
        else:
            load = w.load.decode(now)
        return self.decode_model.predict(load.batch + 1, load.kv_tokens + req.prompt_tokens)

    def _score(self, req: Request, now: float, turn: int) -> list[_Scored]:
        blocks = req.block_hashes if req.block_hashes is not None else \
            [block_hash(h) for h in req.page_hashes]
        prefixes = self.index.prefixes(blocks)
        l3_pages = self.l3(req.page_hashes) if self.l3 is not None and req.page_hashes else 0
        n, ww, spt = len(self._workers) or 1, self.config.work_weight, self._spt
        options: dict = {}                # workers with the same prefix and paths: same options
        out = []
        for w in self._workers.values():
            if w.spec.role is Role.DECODE:
                continue
            pre = prefixes.get(w.spec.name, _NONE)
            key = (pre, w.paths, w.spec.page_tokens)
            opts = options.get(key)
            if opts is None:
                opts = options[key] = self._options(w, req.prompt_tokens, pre, l3_pages)
            queue = w.load.queue_s(now, spt)
            best = min(opts, key=lambda c: max(queue, c.l3_s) + c.load_s + c.prefill_s)
            work = best.load_s + best.prefill_s
            ttft = max(queue, best.l3_s) + work
            out.append(_Scored(ttft + ww * work, len(w.load.running), (w.pos - turn) % n,
                               w.spec.name, queue, best))
        out.sort()
        return out

    def _options(self, w: _Worker, prompt: int, pre: Prefix, l3_pages: int) -> list["_Cost"]:
        """The prefix cut after L1, after L2 and after L3 on ``w``: pull or recompute."""
        pt = w.spec.page_tokens
        top = max(0, (prompt - 1) // pt)          # SGLang computes at least the last token
        g = min(pre.gpu, top)
        h = min(pre.gpu + pre.host, top) - g
        l3 = max(0, min(l3_pages, top) - g - h)
        predict, overlap, fetch = self.prefill_model.predict, self.config.overlap, w.paths.fetch
        out = []
        for hp, lp in ((0, 0), (h, 0), (h, l3)) if h or l3 else ((0, 0),):
            cached = (g + hp + lp) * pt
            pre_s = predict(prompt - cached, cached)
            f = fetch(hp, lp, pre_s, overlap)
            out.append(_Cost(f.l3_s, f.load_s, pre_s, g, hp, lp, (h - hp) + (l3 - lp)))
        return out


class _Cost(NamedTuple):
    l3_s: float                   # L3 -> L2, under the queue wait
    load_s: float                 # L2 -> L1 on the critical path
    prefill_s: float
    gpu: int                      # pages used from each tier
    host: int
    l3: int
    recompute: int                # pages held somewhere but recomputed


def _prediction(s: _Scored) -> Prediction:
    c = s.cost
    pages = {t: n for t, n in ((Tier.GPU, c.gpu), (Tier.HOST, c.host), (Tier.L3, c.l3)) if n}
    fetch = max(0.0, c.l3_s - s.queue_s) + c.load_s      # what the fetch adds to the queue
    return Prediction(s.worker, s.queue_s + fetch + c.prefill_s, s.queue_s, fetch,
                      c.prefill_s, pages, c.recompute)


_NONE = Prefix(0, 0)
