"""Races the load found, reduced to a few requests.

- Writers of the same key: the load's clients put the same shared-prefix pages at the same
  time; one holds a reservation (Reserve, copy, Commit) while the other reserves the same keys.
  The node must answer both without stalling its loop: a stalled loop misses heartbeats, and
  the master then drops the node and every key it holds.
- A restarted node: a client thread may still hold the node's old record (its old segment
  file, now deleted) when it next calls; that must be a miss or a fallback, never an exception;
  and a client unmapping the old segment must not do it under another thread's copy.
"""
import os
import signal
import time

import pytest

from hicache_mc import protocol as P
from hicache_mc.client import StoreClient
from harness import restart, stress_cluster
from procs import request


@pytest.fixture
def ssd_node(tmp_path):
    c = stress_cluster(tmp_path)
    c.start_master()
    node = c.add_node(dram="32MiB", args=("--ssd", "64MiB", "--ssd-dir", str(tmp_path / "ssd"),
                                          "--durability", "sync"))
    c.wait_nodes(1)
    yield c, node
    c.stop()


def test_a_reserve_of_keys_another_writer_holds_does_not_stall_the_node(ssd_node):
    c, node = ssd_node
    keys = [f"race/{i}" for i in range(4)]
    reserved = request(node.address, P.ReserveRequest(keys[:3], [100] * 3))   # a writer, mid-copy
    assert isinstance(reserved, P.ReserveReply) and min(reserved.offsets) >= 0
    t0 = time.monotonic()
    second = request(node.address, P.ReserveRequest(keys, [100] * 4), timeout_s=30)
    waited = time.monotonic() - t0
    assert isinstance(second, P.ReserveReply), second
    assert max(second.offsets[:3]) < 0 and second.offsets[3] >= 0, second
    assert c.stats()["nodes_expired"] == 0, "the master dropped the node while it was busy"
    assert waited < 1.0, f"the node took {waited:.1f} s to answer a 4-key reserve"


def test_a_node_record_whose_segment_file_is_gone_is_not_an_exception(tmp_path):
    c = stress_cluster(tmp_path)
    try:
        c.start_master()
        node = c.add_node(dram="16MiB")
        c.wait_nodes(1)
        with StoreClient(c.master, transport="shm", timeout_s=1.0, circuit_open_s=0.1) as client:
            assert client.put("vanish/a", b"a" * 1000) and client.get("vanish/a") == b"a" * 1000
            old = P.NodeInfo.from_dict(c.stats()["nodes"][0])      # the record the client mapped
            node.kill(signal.SIGKILL)
            c.wait_nodes(0)
            restart(c, node)                                        # deletes the old segment file
            c.wait_nodes(1)
            time.sleep(1.2)                                         # the client's sweep is due
            client.transport_for(old)                               # a thread still holding the old record
    finally:
        c.stop()


def test_a_segment_is_not_unmapped_between_lookup_and_use(tmp_path):
    # Found as a race: _using looked the segment up, released the lock, and only then counted
    # itself a user, so a sweep on another thread could unmap it in between. Lookup and pin are
    # now one step under the lock; this checks a sweep while a copy is in flight leaves the
    # mapping alone until the copy is done, and unmaps it right after.
    c = stress_cluster(tmp_path)
    try:
        c.start_master()
        c.add_node(dram="16MiB")
        c.wait_nodes(1)
        with StoreClient(c.master, transport="shm", timeout_s=1.0) as client:
            assert client.put("gap/a", b"a" * 1000) and client.get("gap/a") == b"a" * 1000
            node = P.NodeInfo.from_dict(c.stats()["nodes"][0])
            shm = client.shm
            with shm._using(node) as seg:                 # what read() and write() copy through
                os.unlink(node.shm_path)                  # the node restarted: its file is gone
                time.sleep(1.1)                           # the next lookup finds the sweep due
                assert shm.segment(node) is None          # swept: not mappable any more
                assert not seg.mm.closed, "the mapping was closed under a copy in flight"
            assert seg.mm.closed                          # ... and unmapped once the copy is done
    finally:
        c.stop()
