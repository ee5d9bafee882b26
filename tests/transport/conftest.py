"""Fixtures for the Mooncake transport tests: stores whose nodes run a Transfer Engine (TCP)."""
from __future__ import annotations

import pytest

from procs import Cluster  # noqa: E402  (tests/procs.py, on sys.path via tests/conftest.py)

TE_ENV = {"HICACHE_MC_TE_PROTOCOL": "tcp"}


def te_cluster(tmp_path, **kw) -> Cluster:
    """A Cluster whose node processes start a TE over TCP (``te_protocol=tcp``)."""
    c = Cluster(tmp_path, **kw)
    c.env.update(TE_ENV)
    return c


@pytest.fixture(scope="module")
def te_store(tmp_path_factory):
    """One ``hicache-mc serve`` with a TE-enabled node, shared by a test module."""
    pytest.importorskip("mooncake.engine", reason="the Mooncake transfer engine is not installed")
    c = te_cluster(tmp_path_factory.mktemp("te-store"))
    c.start_serve("256MiB")
    yield c
    c.stop()
