"""A DRAM segment's owner is the lock its node holds on the segment file, never the pid in the
file's name: a node started in another PID namespace (``unshare --pid``, as a container would
be) on the same shm_dir leaves a live node's segment alone and removes one nobody holds."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile

import pytest

from hicache_mc.client import StoreClient
from procs import free_port


@pytest.fixture
def shm_dir():
    d = tempfile.mkdtemp(prefix="hicache-mc-test-", dir="/dev/shm")
    yield d
    shutil.rmtree(d, ignore_errors=True)


def in_pid_namespace(cluster, log_path: str, *args: str) -> subprocess.Popen:
    """``hicache-mc *args`` as pid 1 of a PID namespace of its own (killed with this process)."""
    if shutil.which("unshare") is None or subprocess.run(
            ["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True).returncode:
        pytest.skip("cannot make a PID namespace here (needs root and unshare)")
    env = dict(os.environ, PYTHONUNBUFFERED="1", **cluster.env)
    with open(log_path, "ab") as log:
        return subprocess.Popen(["unshare", "--pid", "--fork", "--mount-proc", "--kill-child",
                                 sys.executable, "-m", "hicache_mc.cli", *args],
                                stdout=log, stderr=subprocess.STDOUT, env=env)


def test_a_node_in_another_pid_namespace_keeps_a_live_nodes_segment(cluster, shm_dir, tmp_path):
    cluster.env["HICACHE_MC_SHM_DIR"] = shm_dir
    cluster.start_master()
    cluster.add_node(dram="16MiB")
    cluster.wait_nodes(1)
    with StoreClient(cluster.master, transport="shm") as c:
        assert c.put("owner/a", b"a" * 4096)
    [live] = os.listdir(shm_dir)
    dead = os.path.join(shm_dir, "hicache-mc-4194304-deadbeef")    # no pid so high is alive
    open(dead, "wb").close()                                        # and no lock on it
    other = in_pid_namespace(cluster, str(tmp_path / "other.log"), "node", "--master",
                             cluster.master, "--node-port", str(free_port()), "--dram", "16MiB")
    try:
        cluster.wait_nodes(2)
        assert live in os.listdir(shm_dir), "a live node's segment was taken for a dead one's"
        assert not os.path.exists(dead)
        assert len(os.listdir(shm_dir)) == 2            # the live one and the new node's
        with StoreClient(cluster.master, transport="shm") as c:
            assert c.get("owner/a") == b"a" * 4096
            assert c.counters.get("errors", 0) == 0
    finally:
        other.send_signal(signal.SIGKILL)       # and --kill-child ends the node with it
        other.wait(30)
