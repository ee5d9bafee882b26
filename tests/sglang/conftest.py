"""Fixtures for the SGLang backend tests: real sglang host pools on CPU, a real store."""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from sglang_env import apply_torchvision_stub  # noqa: E402

apply_torchvision_stub()
# The factory wraps backends in a failure injector when these are set; never in these tests.
os.environ.pop("SGLANG_TEST_HICACHE_BACKEND_RANDOM_DELAY", None)
os.environ.pop("SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE", None)

from procs import Cluster  # noqa: E402  (tests/procs.py, on sys.path via tests/conftest.py)


class SharedStore:
    """One ``hicache-mc serve`` for a whole test module (starting one costs about a second)."""

    def __init__(self, tmp_path, dram: str = "256MiB"):
        self.cluster = Cluster(tmp_path)
        self.dram = dram
        self.master = self.cluster.master

    def start(self) -> "SharedStore":
        self.cluster.start_serve(self.dram)
        return self

    def stop(self) -> None:
        self.cluster.stop()


@pytest.fixture(scope="module")
def shared_store(tmp_path_factory):
    """A running store shared by the tests of one module; tests keep apart by namespace."""
    s = SharedStore(tmp_path_factory.mktemp("store")).start()
    yield s
    s.stop()
