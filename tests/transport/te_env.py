"""TE-enabled clusters for the Mooncake transport tests.

A plain module rather than conftest.py: test files import it by name, and every folder's
conftest is a module called ``conftest``, so importing one by that name picks whichever was
loaded last when the whole suite runs.
"""
from __future__ import annotations

from procs import Cluster  # tests/procs.py, on sys.path via tests/conftest.py

TE_ENV = {"HICACHE_MC_TE_PROTOCOL": "tcp"}


def te_cluster(tmp_path, **kw) -> Cluster:
    """A Cluster whose node processes start a TE over TCP (``te_protocol=tcp``)."""
    c = Cluster(tmp_path, **kw)
    c.env.update(TE_ENV)
    return c
