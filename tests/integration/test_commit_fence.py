"""Commits answered before the master acknowledges them, with read-your-writes kept by fences;
nodes talking to the master through its direct port; gets whose Lease goes out with the Locate.

A node answers a writer's Commit once it has sent ``Committed`` to the master, with its commit
sequence number; the writer's next lookups name that number (``after``), and the master holds
such a lookup until it has applied that commit."""
import time

import numpy as np

from hicache_mc import protocol as P
from hicache_mc.client import StoreClient
from procs import request


def _send(address: str, msg: P.Message, req_id: int):
    import zmq
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    sock.send_multipart(P.encode(msg, req_id))
    return sock


def test_a_lookup_waits_for_the_commit_its_fence_names(store):
    """A Locate fenced one commit ahead of the master is answered only after that commit: it
    reports a key that was written after the Locate was sent."""
    with StoreClient(store.master) as c:
        assert c.put("fence/a", b"first")
        node_id, (_, (segment, seq)) = next(iter(c._fences.items()))
        before = c.stats()["cluster"]["fence_waits"]
        sock = _send(store.master, P.LocateRequest(["fence/b"], {node_id: [segment, seq + 1]}), 7)
        try:
            assert not sock.poll(300)                   # held: the master has not seen seq + 1
            assert c.put("fence/b", b"second")          # the node's next commit is seq + 1
            assert sock.poll(5000)
            reply = P.decode(sock.recv_multipart())[0]
        finally:
            sock.close()
        assert isinstance(reply, P.LocateReply) and reply.located() == [(node_id, 6)]
        assert c._fences[node_id][1] == [segment, seq + 1]
        assert c.stats()["cluster"]["fence_waits"] == before + 1


def test_a_fence_the_master_cannot_meet_is_dropped_after_a_while(store):
    with StoreClient(store.master) as c:
        assert c.put("fence/c", b"x")
        node_id, (_, (segment, seq)) = next(iter(c._fences.items()))
    reply = request(store.master, P.LocateRequest(["fence/c"], {node_id: [segment, seq + 10**6]}), 5.0)
    assert isinstance(reply, P.LocateReply) and reply.located() == [(node_id, 1)]


def test_fences_on_another_segment_or_unknown_nodes_do_not_wait(store):
    with StoreClient(store.master) as c:
        assert c.put("fence/d", b"x")
        node_id = next(iter(c._fences))
        before = c.stats()["cluster"]["fence_waits"]
        for after in ({node_id: ["0ld5e9", 10**9]}, {"no-such-node": ["abc", 10**9]}):
            reply = request(store.master, P.ExistsRequest(["fence/d"], after), 2.0)
            assert isinstance(reply, P.ExistsReply) and reply.count == 1
        assert c.stats()["cluster"]["fence_waits"] == before


def test_malformed_fences_get_errors_and_the_master_keeps_serving(store):
    for after in ({"n": "notalist"}, {"n": [1, 2]}, {"n": ["seg"]}, {"n": ["seg", True]}):
        reply = request(store.master, P.LocateRequest(["k"], after), 2.0)
        assert isinstance(reply, P.ErrorReply) and reply.code == "bad_request", (after, reply)
        assert "after" in reply.message
    with StoreClient(store.master) as c:
        assert c.put("fence/after-bad", b"ok") and c.get("fence/after-bad") == b"ok"


def test_the_node_reports_through_the_masters_direct_port_and_survives_a_master_restart(cluster):
    master = cluster.start_master()
    node = cluster.add_node()
    cluster.wait_nodes(1)
    with StoreClient(cluster.master, timeout_s=2.0) as c:
        assert c.put("nd/a", b"before")
        deadline = time.monotonic() + 10
        while "through its direct port" not in node.log() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "through its direct port" in node.log()
        master.stop()
        cluster.start_master()
        cluster.wait_keys(1)                    # the node registered again with its inventory
        deadline = time.monotonic() + 10
        while node.log().count("through its direct port") < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert node.log().count("through its direct port") == 2
        for _ in range(100):                    # the client's circuit may be open for a moment
            if c.get("nd/a") == b"before":
                break
            time.sleep(0.05)
        assert c.get("nd/a") == b"before"
        assert c.put("nd/b", b"after") and c.get("nd/b") == b"after"


def test_a_get_leases_from_the_likely_node_alongside_the_locate(store):
    rng = np.random.default_rng(5)
    blobs = [rng.integers(0, 256, 70_000, dtype=np.uint8) for _ in range(8)]
    keys = [f"early-lease/{i}" for i in range(8)]
    with StoreClient(store.master) as c:
        assert all(c.batch_put_from(keys, [b.ctypes.data for b in blobs], [70_000] * 8))
        out = [np.zeros_like(b) for b in blobs]
        assert c.batch_get_into(keys, [o.ctypes.data for o in out], [o.nbytes for o in out]) == [True] * 8
        assert all(np.array_equal(a, b) for a, b in zip(out, blobs))
        assert c.counters["lease_early"] == 1
        # some keys the node does not have: those are asked of the master, and are misses
        mixed = keys[:3] + ["early-lease/none"] + keys[3:4]
        out = [np.zeros(70_000, np.uint8) for _ in mixed]
        got = c.batch_get_into(mixed, [o.ctypes.data for o in out], [70_000] * len(mixed))
        assert got == [True, True, True, False, True]
        assert all(np.array_equal(out[i], blobs[i]) for i in range(3))
        assert c.counters["lease_early"] == 1
        # a size other than the stored one: a miss
        small = np.zeros(100, np.uint8)
        assert c.batch_get_into(keys[:1], [small.ctypes.data], [100]) == [False]
        assert c.checks.failures == 0
