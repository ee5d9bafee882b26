"""The online fits start from a generic prior and converge to whatever the workers measure."""
from __future__ import annotations

import random

import pytest

from hicache_mc.conductor.api import WorkerSpec
from hicache_mc.conductor.model import DecodeModel, Overlap, Paths, PrefillModel

# A "true" worker unlike the prior: 3x faster per token, a quarter of the attention cost,
# a smaller fixed cost. Probe points include cached prefixes and a prompt longer than any sample.
def truth(n, k):
    return 0.015 + 0.035e-3 * n + 0.0012e-6 * n * (k + 0.5 * n)


PROBES = [(500, 0), (2000, 0), (8000, 0), (32000, 0), (1000, 30000), (4000, 60000), (60000, 0)]


def worst_error(model, probes=PROBES):
    return max(abs(model.predict(n, k) / truth(n, k) - 1) for n, k in probes)


def test_prefill_fit_converges_from_the_prior():
    rng = random.Random(7)
    m = PrefillModel()
    errors, typical = {0: worst_error(m)}, {}
    for i in range(1, 301):
        n = min(40_000, int(rng.lognormvariate(8, 1.2)))
        k = rng.choice([0, 0, int(rng.lognormvariate(9, 1))])
        m.observe(n, k, truth(n, k) * rng.uniform(0.95, 1.05))       # 5 % measurement noise
        errors[i], typical[i] = worst_error(m), worst_error(m, PROBES[:3])
    assert errors[0] > 1.0                   # the prior is far off this worker
    # prompts like the samples are right within 10 samples; long cached prefixes, which the
    # samples rarely reach (the attention term), take longer
    assert typical[10] < 0.1
    assert errors[50] < 0.25 and errors[300] < 0.1
    assert m.fit.theta[1] == pytest.approx(0.035, rel=0.1)


def test_the_fit_follows_a_worker_that_changes():
    """Forgetting: after the worker slows down 2x, the fit follows within a few hundred."""
    m = PrefillModel()
    rng = random.Random(3)
    for slow in (1.0, 2.0):
        for _ in range(600):
            n = int(rng.lognormvariate(8, 1))
            m.observe(n, 0, slow * truth(n, 0))
    assert m.predict(4000, 0) == pytest.approx(2 * truth(4000, 0), rel=0.1)


def test_decode_fit_converges():
    rng = random.Random(5)

    def tbt(b, kv):
        return 0.006 + 0.00008 * b + 0.00003 * kv / 1e3

    d = DecodeModel()
    assert abs(d.predict(64, 64 * 4000) / tbt(64, 64 * 4000) - 1) > 0.5
    for _ in range(200):
        b = rng.randint(1, 128)
        kv = b * rng.randint(500, 20000)
        d.observe(b, kv, tbt(b, kv) * rng.uniform(0.97, 1.03))
    for b, per in [(1, 1000), (16, 4000), (64, 4000), (128, 16000)]:
        assert d.predict(b, b * per) == pytest.approx(tbt(b, b * per), rel=0.05)


def test_fetch_paths_and_their_fallbacks():
    p = Paths.of(WorkerSpec("w", page_tokens=64, page_bytes=8 << 20, host_bw=16e9, l3_bw=4e9))
    page = 8 << 20
    f = p.fetch(2, 3, 1.0)
    assert f.l3_s == pytest.approx(3 * page / 4e9) and f.load_s == pytest.approx(5 * page / 16e9)
    # layer-wise loading hides the L2 -> L1 copy under a longer prefill, not under a short one
    assert p.fetch(2, 3, 1.0, Overlap.HOST).load_s == 0.0
    assert p.fetch(2, 3, 0.001, Overlap.HOST).load_s == pytest.approx(f.load_s - 0.001)
    unknown = Paths.of(WorkerSpec("w", page_tokens=64))
    assert unknown.host_s > 0 and unknown.l3_s > unknown.host_s
