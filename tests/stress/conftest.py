"""Stress suite: a short profile always runs; the long one runs with HICACHE_MC_STRESS_LONG=1.

    HICACHE_MC_STRESS_LONG=1 [HICACHE_MC_STRESS_SECONDS=120] .venv/bin/pytest tests/stress -m slow

An environment variable rather than a command-line option: pytest only reads options from the
root conftest and plugins, and this folder owns nothing above itself.
"""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from harness import LONG, LONG_PROFILE, SHORT, stress_cluster  # noqa: E402

PROFILES = [
    pytest.param(SHORT, id="short"),
    pytest.param(LONG_PROFILE, id="long", marks=[
        pytest.mark.slow,
        pytest.mark.skipif(not LONG, reason="long stress run: set HICACHE_MC_STRESS_LONG=1"),
    ]),
]


@pytest.fixture(params=PROFILES)
def profile(request):
    """The run's size: SHORT in CI, LONG_PROFILE on request."""
    return request.param


@pytest.fixture
def scluster(tmp_path):
    """An empty Cluster with the suite's heartbeat settings; always stopped afterwards."""
    c = stress_cluster(tmp_path)
    yield c
    c.stop()
