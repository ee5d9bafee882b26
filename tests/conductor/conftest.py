"""Fixtures of the conductor's tests: a tokenizer trained here, stand-in worker fleets and the
conductor as real processes (conductor_procs.py)."""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from conductor_procs import StandinFleet  # noqa: E402
from procs import Store  # noqa: E402
from tokenizer import train  # noqa: E402

L3_NAMESPACE = "c0ffee00c0ffee00"     # the routing tests' stand-ins keep their L3 pages here


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> str:
    """A byte-level BPE tokenizer with a Qwen2-style chat template (tokenizer.py)."""
    return train(str(tmp_path_factory.mktemp("tokenizer")))


@pytest.fixture(scope="session")
def l3_store(tmp_path_factory):
    """A real store, the L3 of the routing tests' stand-ins."""
    store = Store(tmp_path_factory.mktemp("l3-store")).start()
    yield store
    store.stop()


@pytest.fixture(scope="session")
def standins(tmp_path_factory, tokenizer_dir, l3_store):
    """Every server module's stand-in workers in one process (importing sglang's modules costs
    seconds of CPU: paid once). Each module uses its own workers: w* (proxy), r* (routing,
    with the L3), p* and d0 (PD), f* (faults: f2 is killed), a* (admission)."""
    l3 = {"l3_master": l3_store.master, "l3_namespace": L3_NAMESPACE, "l3_bw": 10e9, "time_scale": 20.0}
    workers = ([{"name": "w0"}, {"name": "w1"}, {"name": "r0", **l3}, {"name": "r1", **l3},
                {"name": "p0", "role": "prefill", "bootstrap_port": 18998},
                {"name": "p1", "role": "prefill", "bootstrap_port": 18999}, {"name": "d0", "role": "decode"}]
               + [{"name": f"f{i}", "time_scale": 5.0} for i in range(4)]
               + [{"name": f"a{i}", "time_scale": 3.0} for i in range(2)])
    fleet = StandinFleet(tmp_path_factory.mktemp("standins"), tokenizer_dir, workers).start()
    yield fleet
    fleet.stop()
