"""A client that reaches the master's port but not its publish port (a forwarder that passes
the master port only, as on a host behind a firewall): the residency view says so in one line,
``hicache-mc wait`` names the port, and lookups still get answers from the master."""
from __future__ import annotations

import logging
import os
import subprocess
import sys
import time

import pytest

from hicache_mc.client import StoreClient
from procs import Cluster, free_port
from rawsock import Forwarder

NS = "fedcba9876543210"


@pytest.fixture(scope="module")
def behind(tmp_path_factory):
    """(cluster, address of a forwarder on 127.0.0.2 to its master port only)."""
    c = Cluster(tmp_path_factory.mktemp("publish"))
    c.start_master()
    c.add_node("32MiB")
    c.wait_nodes(1)
    port = free_port()
    fwd = Forwarder(("127.0.0.2", port), ("127.0.0.1", c.port))
    yield c, f"tcp://127.0.0.2:{port}"
    fwd.close()
    c.stop()


def test_a_view_that_cannot_reach_the_publish_port_says_so_and_the_master_answers(behind, caplog):
    c, master = behind
    caplog.set_level(logging.INFO)
    publish_port = c.stats()["publish_port"]
    with StoreClient(master, view="on", timeout_s=2.0) as s:
        assert s.put(f"{NS}/a/k", b"x" * 100)
        s.follow(NS)
        end = time.monotonic() + 20
        while not [r for r in caplog.records if "publish port" in r.getMessage()]:
            assert time.monotonic() < end, [r.getMessage() for r in caplog.records]
            time.sleep(0.05)
        line = next(r for r in caplog.records if "publish port" in r.getMessage())
        assert line.getMessage().startswith(
            f"cannot reach the master's publish port tcp://127.0.0.2:{publish_port} (residency "
            "view: publish_port; lookups ask the master meanwhile): connection refused")
        assert s.batch_exists([f"{NS}/a/k", f"{NS}/b/k"]) == 1      # answered by the master
        assert s.stats()["client"]["view_answers"] == 0


def test_wait_names_a_publish_port_this_host_cannot_reach(behind):
    c, master = behind
    env = {k: v for k, v in os.environ.items() if not k.startswith("HICACHE_MC_")}
    r = subprocess.run([sys.executable, "-m", "hicache_mc.cli", "wait", "--master", master,
                        "--timeout", "2"], env=env, capture_output=True, text=True, timeout=120)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1, r.stderr
    port = c.stats()["publish_port"]
    assert lines[0].startswith(f"hicache-mc: not ready after 2 s: the master's publish port "
                               f"tcp://127.0.0.2:{port}: connection refused"), lines
    r = subprocess.run([sys.executable, "-m", "hicache_mc.cli", "wait", "--master", c.master,
                        "--timeout", "30"], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr             # the master itself: everything reachable
