"""Fixtures for the Mooncake transport tests: stores whose nodes run a Transfer Engine (TCP)."""
from __future__ import annotations

import pytest

from te_env import TE_ENV, te_cluster  # noqa: F401  (plain module: see te_env.py)

@pytest.fixture(scope="module")
def te_store(tmp_path_factory):
    """One ``hicache-mc serve`` with a TE-enabled node, shared by a test module."""
    pytest.importorskip("mooncake.engine", reason="the Mooncake transfer engine is not installed")
    c = te_cluster(tmp_path_factory.mktemp("te-store"))
    c.start_serve("256MiB")
    yield c
    c.stop()
