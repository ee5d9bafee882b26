"""Acknowledged puts that must not be lost: reports the master gets late or refuses, and
objects whose bytes do not match their checksum (issue 19)."""
import mmap
import os
import time

import numpy as np
import pytest

from hicache_mc import protocol as P
from hicache_mc.client import StoreClient
from hicache_mc.transport.base import checksum
from procs import Cluster, request


def wait_for(pred, what: str, timeout_s: float = 20.0) -> None:
    end = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < end, what
        time.sleep(0.05)


def test_a_late_eviction_report_leaves_a_key_committed_after_it(shared_store):
    """An eviction report that reaches the master after a later commit of the same key is not
    the node's next report: refused, it must not remove the key the node holds. (Here an
    unnumbered one, and from another connection than the node's: refused for either reason;
    test_commit_fence.py checks the numbering on the node's own connection.)"""
    with StoreClient(shared_store.master) as c:
        assert c.put("late/k", b"v1")
        node_id = next(iter(c.fences.after()))
        reply = request(shared_store.master, P.EvictedRequest(node_id, ["late/k"]))
        assert isinstance(reply, P.ErrorReply) and reply.code in ("report_gap", "unknown_node"), reply
        assert c.exists("late/k")
        assert c.put("late/k", b"v1") and c.get("late/k") == b"v1"
        assert c.clear("late/") == 1 and not c.exists("late/k")   # the node's own report


def test_a_refused_report_makes_the_node_register_again(tmp_path):
    """A report the master refuses (here: the eviction report of a clear of more keys than a
    message may hold) makes the node register again: its inventory is the truth, and the
    cleared keys are gone from the master's index. (Heartbeats are far apart: neither the
    master nor the node, busy clearing, takes the other for gone and so resyncs instead.)"""
    n, batch = P.MAX_KEYS + 1, 1 << 16
    keys = [f"many/{i}" for i in range(n)]
    buf = np.zeros(n, np.uint8)
    cluster = Cluster(tmp_path, heartbeat_s=5.0).start_serve()
    try:
        _put_and_clear(cluster.master, keys, buf, batch)
    finally:
        cluster.stop()


def _put_and_clear(master, keys, buf, batch):
    n = len(keys)
    with StoreClient(master, timeout_s=60.0) as c:
        for i in range(0, n, batch):
            part = keys[i: i + batch]
            ptrs = [buf.ctypes.data + j for j in range(i, i + len(part))]
            assert all(c.batch_put_from(part, ptrs, [1] * len(part)))
        assert c.batch_contains([keys[0], keys[-1]]) == [True, True]
        c.clear("many/")
        wait_for(lambda: c.batch_contains([keys[0], keys[-1]]) == [False, False],
                 "the master still indexes the cleared keys")
        assert c.put("many/0", b"x") and c.get("many/0") == b"x"


def _segment(store):
    node = store.cluster.stats()["nodes"][0]
    fd = os.open(node["shm_path"], os.O_RDWR)
    try:
        return node, mmap.mmap(fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)


@pytest.mark.parametrize("how, transport", [("bad checksum", "shm"), ("overwritten", "tcp")])
def test_a_damaged_object_is_dropped_when_read_and_a_re_put_stores_it(shared_store, how,
                                                                       transport):
    """A commit whose checksum does not match the bytes, or bytes changed under a committed
    object: the first read is a miss and drops the object, so a re-put stores it again."""
    key, data = f"damaged/{transport}", b"d" * 4096
    node, seg = _segment(shared_store)
    with StoreClient(shared_store.master, transport=transport) as c:
        if how == "bad checksum":       # a writer whose commit names another checksum
            off = request(node["address"], P.ReserveRequest([key], [len(data)])).offsets[0]
            seg[off: off + len(data)] = data
            reply = request(node["address"], P.CommitRequest([key], [checksum(data) ^ 1], [off]))
            assert reply.ok == [True]
            wait_for(lambda: c.exists(key), "the commit was not reported")
        else:                           # bytes changed under a committed object
            assert c.put(key, data)
            off = request(node["address"], P.LeaseRequest([key])).offsets[0]
            request(node["address"], P.ReleaseRequest([key], [off]))
            seg[off] ^= 0xFF
        assert c.exists(key)
        assert c.get(key) is None               # the reader's copy does not match: a miss
        assert not c.exists(key)                # dropped at once
        assert c.put(key, data) and c.get(key) == data
    seg.close()
