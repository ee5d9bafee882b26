"""A cluster started with a token that the attacks here never present: a master and a node as
separate processes, each with its metrics port on."""
from __future__ import annotations

import os
import resource
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from peers import TOKEN  # noqa: E402
from procs import Cluster, free_port  # noqa: E402

# Every flood test holds ~1,000 connections per port, several ports at once; the servers
# inherit this limit from the test process.
_soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
if _soft < min(_hard, 16384):
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(_hard, 16384), _hard))


@pytest.fixture(scope="module")
def guarded(tmp_path_factory):
    """(cluster, {"master": Proc, "node": Proc}) with a token, heartbeats every 0.25 s and a
    node dropped after 6 missed ones (1.5 s): a loop stalled that long expires the node (the
    decoding bombs these tests send stalled the old decoder 6-10 s; a 2-core host shared by
    two test workers has delayed a heartbeat past 1 s)."""
    c = Cluster(tmp_path_factory.mktemp("guarded"), heartbeat_s=0.25, liveness=6, token=TOKEN)
    c.start_master(("--metrics-port", str(free_port())))
    node = c.add_node(dram="128MiB", args=("--node-metrics-port", str(free_port())))
    c.wait_nodes(1)
    yield c, {"master": c.master_proc, "node": node}
    c.stop()
