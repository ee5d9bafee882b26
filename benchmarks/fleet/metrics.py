"""What one simulated run measured, from its requests.

- TTFT: first token out minus arrival (queueing, L3 prefetch, prefill); TBT: a request's mean
  time per output token after the first (its decode time over ``output - 1`` tokens; 0 for
  one-token outputs). Percentiles over the requests served.
- SLO attainment: the share of *all* arrivals served within their TTFT SLO (``ttft_ok``),
  their TBT SLO (``tbt_ok``), both (``slo_ok``); a rejected request meets neither.
- Goodput: requests served within both SLOs per second of the trace's (scaled) arrival span.
- Hit rates per tier: prompt tokens of served requests served from the GPU pool, the host
  pool, the L3, over all prompt tokens served (the rest was computed).
- Abandoned: requests whose client gave up while they were still queued (not served).
- The cascade: P(rejected | the conversation's previous turn was rejected) beside
  P(rejected | it was admitted) (``workload.previous_turns``); None without such turns.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import NamedTuple, Optional, Sequence

import numpy as np


@dataclass(frozen=True)
class RunResult:
    requests: int
    served: int
    rejected: int
    abandoned: int
    span_s: float
    ttft_mean: float
    ttft_p50: float
    ttft_p90: float
    ttft_p99: float
    tbt_mean: float
    tbt_p90: float
    tbt_p99: float
    ttft_ok: float
    tbt_ok: float
    slo_ok: float
    goodput: float
    throughput: float
    hit_gpu: float
    hit_host: float
    hit_l3: float
    l3_read_gb: float
    l3_written_gb: float
    rejected_after_rejected: Optional[float]
    rejected_after_admitted: Optional[float]

    def as_dict(self) -> dict:
        return asdict(self)


class Cascade(NamedTuple):
    after_rejected: Optional[float]      # P(rejected | previous turn rejected)
    after_admitted: Optional[float]      # P(rejected | previous turn admitted)


def cascade(rejected: Sequence[int], previous: Sequence[int]) -> Cascade:
    gone = set(rejected)
    turns = {True: 0, False: 0}                       # previous rejected? -> turns
    hits = {True: 0, False: 0}                        # ... of which rejected
    for r, q in enumerate(previous):
        if q >= 0:
            turns[q in gone] += 1
            hits[q in gone] += r in gone
    share = {k: round(hits[k] / turns[k], 4) if turns[k] else None for k in turns}
    return Cascade(share[True], share[False])


def summarize(served, rejected, abandoned: int, slo: dict, requests: int, span_s: float, l3,
              previous: Sequence[int]) -> RunResult:
    n = len(served)
    ttft = np.fromiter((j.first_token - j.arrival for j in served), float, n)
    tbt = np.fromiter(((j.finish - j.first_token) / (j.output - 1) if j.output > 1 else 0.0
                       for j in served), float, n)
    ttft_slo = np.fromiter((slo[j.rid][0] for j in served), float, n)
    tbt_slo = np.fromiter((slo[j.rid][1] for j in served), float, n)
    t_ok, b_ok = ttft <= ttft_slo, tbt <= tbt_slo
    both = int(np.count_nonzero(t_ok & b_ok))
    prompt = sum(j.prompt for j in served) or 1
    pct = (lambda a, q: float(np.percentile(a, q))) if n else (lambda a, q: 0.0)
    total = max(1, requests)
    casc = cascade(rejected, previous)
    return RunResult(
        requests=requests, served=n, rejected=len(rejected), abandoned=abandoned, span_s=span_s,
        ttft_mean=float(ttft.mean()) if n else 0.0, ttft_p50=pct(ttft, 50),
        ttft_p90=pct(ttft, 90), ttft_p99=pct(ttft, 99),
        tbt_mean=float(tbt.mean()) if n else 0.0, tbt_p90=pct(tbt, 90), tbt_p99=pct(tbt, 99),
        ttft_ok=int(np.count_nonzero(t_ok)) / total, tbt_ok=int(np.count_nonzero(b_ok)) / total,
        slo_ok=both / total, goodput=both / span_s, throughput=n / span_s,
        hit_gpu=sum(j.gpu for j in served) / prompt, hit_host=sum(j.host for j in served) / prompt,
        hit_l3=sum(j.l3 for j in served) / prompt,
        l3_read_gb=l3.read_bytes / 1e9, l3_written_gb=l3.written_bytes / 1e9,
        rejected_after_rejected=casc.after_rejected,
        rejected_after_admitted=casc.after_admitted)
