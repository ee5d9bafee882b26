"""The cost model's compute terms, fitted online: prefill time, decode time per token, fetches.

- **Prefill** of ``n`` new tokens after ``k`` cached ones:
  ``a + b * n + c * (n * k + n^2 / 2)``. The linear term is the weights' work per token; the
  last is attention, every new token attending to the cached ones and to the new ones before
  it, so a cached prefix still costs compute that grows with cached x new.
- **Decode**, seconds per output token with ``batch`` requests holding ``kv`` tokens:
  ``d0 + d1 * batch + d2 * kv`` (a step reads the weights once, and every request's KV).
- **Fetch** of cached pages into the GPU: pages x page bytes / the bandwidth of each path
  (``WorkerSpec.host_bw`` for L2 -> L1, ``l3_bw`` for L3 -> L2; an L3 page then also crosses
  L2 -> L1). SGLang starts the L3 -> L2 prefetch when the request joins the queue, so that part
  runs under the queue wait; the L2 -> L1 load comes at admission, before the compute or, with
  layer-wise loading (``Overlap.HOST``), under it.

Both fits are least squares with exponential forgetting (``FORGET``: the last ~200 requests
count) and a weak prior that keeps the system well-posed before data arrive and while a feature
is not excited (no long prompts yet). The prior is a generic mid-size model on one accelerator,
not any particular deployment: the fit replaces it within tens of requests
(tests/conductor/test_model_fit.py). Samples weigh by 1 / time^2, so the fit minimises
relative error: a 50 ms prefill matters as much as a 5 s one.

Fallbacks: before any sample, the prior; a worker spec with a bandwidth or page size of 0
(unknown) uses ``DEFAULT_HOST_BW`` / ``DEFAULT_L3_BW`` / ``DEFAULT_KV_BYTES_PER_TOKEN``.
"""
from __future__ import annotations

import enum
from typing import NamedTuple, Sequence

from .api import WorkerSpec

FORGET = 0.995                # per sample: a sample's weight halves after ~140 newer ones
# Generic priors. Prefill: 20 ms fixed, 10k new tokens/s, attention 5 ms per million token
# pairs (a 32k-token cold prompt: 3.2 s linear + 2.6 s attention). Decode: 10 ms a step plus
# 0.1 ms per request and 50 us per 1k KV tokens (weights and KV read from ~3 TB/s memory).
PREFILL_PRIOR = (0.02, 0.1, 0.005)       # a, b per 1k tokens, c per 1M token pairs
DECODE_PRIOR = (0.010, 0.0001, 0.00005)  # d0, d1 per request, d2 per 1k KV tokens
PRIOR_SAMPLES = 2.0           # the prior weighs about as much as 2 samples on each coefficient
DEFAULT_HOST_BW = 10e9        # B/s, L2 -> L1: pinned host memory over PCIe 4.0 x16, achieved
DEFAULT_L3_BW = 2.5e9         # B/s, L3 -> L2 over TCP on 25 GbE
DEFAULT_KV_BYTES_PER_TOKEN = 128 << 10   # an 8B-class GQA model in bf16


class OnlineFit:
    """Weighted least squares with forgetting, pulled toward a prior; non-negative."""

    def __init__(self, prior: Sequence[float], prior_samples: float = PRIOR_SAMPLES,
                 forget: float = FORGET):
        k = len(prior)
        self.prior, self.forget, self.k = list(prior), forget, k
        # A sample weighs 1 / y^2; a term that makes up y then weighs ~1 / theta^2 per sample
        # in the normal equations, so prior_samples / prior^2 is worth that many samples.
        self._reg = [prior_samples / (p * p) if p else prior_samples for p in prior]
        self._a = [[0.0] * k for _ in range(k)]
        self._b = [0.0] * k
        self.theta = list(prior)
        self.samples = 0

    def predict(self, x: Sequence[float]) -> float:
        return sum(t * v for t, v in zip(self.theta, x))

    def update(self, x: Sequence[float], y: float, weight: float = 1.0) -> None:
        f, a, b, k = self.forget, self._a, self._b, self.k
        for i in range(k):
            wxi = weight * x[i]
            row = a[i]
            for j in range(k):
                row[j] = f * row[j] + wxi * x[j]
            b[i] = f * b[i] + wxi * y
        self.samples += 1
        self.theta = self._solve()

    def _solve(self) -> list[float]:
        # (A + R) theta = b + R prior, R = diag(reg): ridge toward the prior.
        k = self.k
        m = [[self._a[i][j] + (self._reg[i] if i == j else 0.0) for j in range(k)]
             + [self._b[i] + self._reg[i] * self.prior[i]] for i in range(k)]
        for c in range(k):
            p = max(range(c, k), key=lambda r: abs(m[r][c]))
            m[c], m[p] = m[p], m[c]
            for r in range(k):
                if r != c and m[c][c]:
                    f = m[r][c] / m[c][c]
                    m[r] = [u - f * v for u, v in zip(m[r], m[c])]
        return [max(0.0, m[i][k] / m[i][i]) if m[i][i] else self.prior[i] for i in range(k)]


def _weight(y: float, floor: float) -> float:
    return 1.0 / max(y, floor) ** 2


class PrefillModel:
    """Prefill seconds of ``new`` tokens after ``cached`` ones, fitted from finished requests."""

    def __init__(self, prior: Sequence[float] = PREFILL_PRIOR, forget: float = FORGET):
        self.fit = OnlineFit(prior, forget=forget)

    @staticmethod
    def features(new: int, cached: int) -> tuple[float, float, float]:
        return 1.0, new * 1e-3, new * (cached + 0.5 * new) * 1e-6

    def predict(self, new: int, cached: int) -> float:
        if new <= 0:
            return 0.0
        a, b, c = self.fit.theta
        return a + b * new * 1e-3 + c * new * (cached + 0.5 * new) * 1e-6

    def observe(self, new: int, cached: int, seconds: float) -> None:
        if new > 0 and seconds > 0:
            self.fit.update(self.features(new, cached), seconds, _weight(seconds, 0.01))


class DecodeModel:
    """Seconds per output token for a decode batch, fitted from finished requests."""

    def __init__(self, prior: Sequence[float] = DECODE_PRIOR, forget: float = FORGET):
        self.fit = OnlineFit(prior, forget=forget)

    @staticmethod
    def features(batch: float, kv_tokens: float) -> tuple[float, float, float]:
        return 1.0, batch, kv_tokens * 1e-3

    def predict(self, batch: float, kv_tokens: float) -> float:
        d0, d1, d2 = self.fit.theta
        return d0 + d1 * batch + d2 * kv_tokens * 1e-3

    def observe(self, batch: float, kv_tokens: float, seconds_per_token: float) -> None:
        if seconds_per_token > 0:
            self.fit.update(self.features(batch, kv_tokens), seconds_per_token,
                            _weight(seconds_per_token, 0.001))


class Overlap(enum.Enum):
    """Whether the L2 -> L1 copy overlaps the prefill's compute."""
    NONE = "none"             # load, then compute
    HOST = "host"             # layer by layer under the compute (SGLang's layer-wise load)


class Fetch(NamedTuple):
    """Where a fetch's time goes."""
    l3_s: float               # L3 -> L2: SGLang prefetches while the request waits in queue
    load_s: float             # L2 -> L1 on the critical path, at the request's admission


class Paths(NamedTuple):
    """One worker's fetch paths: seconds per page from each tier."""
    host_s: float             # L2 -> L1
    l3_s: float               # L3 -> L2 (an L3 page then also pays host_s)

    @classmethod
    def of(cls, spec: WorkerSpec) -> "Paths":
        page = spec.page_bytes or spec.page_tokens * DEFAULT_KV_BYTES_PER_TOKEN
        return cls(page / (spec.host_bw or DEFAULT_HOST_BW), page / (spec.l3_bw or DEFAULT_L3_BW))

    def fetch(self, host_pages: int, l3_pages: int, prefill_s: float,
              overlap: Overlap = Overlap.NONE) -> Fetch:
        load = (host_pages + l3_pages) * self.host_s
        if overlap is Overlap.HOST:
            load = max(0.0, load - prefill_s)
        return Fetch(l3_pages * self.l3_s, load)
