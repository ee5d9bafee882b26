"""Commits answered before the master acknowledges them, with read-your-writes kept by fences;
gets that lease from the likely node before asking the master.

A node answers a writer's Commit once it has sent ``Committed`` to the master, with its commit
sequence number; the writer's next lookups name that number (``after``), and the master holds
such a lookup until it has applied that commit."""
import time


from hicache_mc import protocol as P
from hicache_mc.client import StoreClient
from hicache_mc.config import MasterConfig
from hicache_mc.master.service import MasterService
from procs import request


def _send(address: str, msg: P.Message, req_id: int):
    import zmq
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    sock.send(P.encode(msg, req_id))
    return sock


def test_a_lookup_waits_for_the_commit_its_fence_names(shared_store):
    """A Locate fenced one commit ahead of the master is answered only after that commit: it
    reports a key that was written after the Locate was sent."""
    with StoreClient(shared_store.master) as c:
        assert c.put("fence/a", b"first")
        node_id, (segment, seq) = next(iter(c.fences.after().items()))
        before = c.stats()["cluster"]["fence_waits"]
        sock = _send(shared_store.master, P.LocateRequest(["fence/b"], {node_id: [segment, seq + 1]}), 7)
        try:
            assert not sock.poll(300)                   # held: the master has not seen seq + 1
            assert c.put("fence/b", b"second")          # the node's next commit is seq + 1
            assert sock.poll(5000)
            reply = P.decode(sock.recv(), request=False).msg
        finally:
            sock.close()
        assert isinstance(reply, P.LocateReply) and reply.located() == [(node_id, 6)]
        assert c.fences.after()[node_id] == [segment, seq + 1]
        assert c.stats()["cluster"]["fence_waits"] == before + 1


def test_a_fence_the_master_cannot_meet_is_dropped_after_a_while(shared_store):
    with StoreClient(shared_store.master) as c:
        assert c.put("fence/c", b"x")
        node_id, (segment, seq) = next(iter(c.fences.after().items()))
    reply = request(shared_store.master, P.LocateRequest(["fence/c"], {node_id: [segment, seq + 10**6]}), 5.0)
    assert isinstance(reply, P.LocateReply) and reply.located() == [(node_id, 1)]


def test_fences_on_another_segment_or_unknown_nodes_do_not_wait(shared_store):
    with StoreClient(shared_store.master) as c:
        assert c.put("fence/d", b"x")
        node_id = next(iter(c.fences.after()))
        before = c.stats()["cluster"]["fence_waits"]
        for after in ({node_id: ["0ld5e9", 10**9]}, {"no-such-node": ["abc", 10**9]}):
            reply = request(shared_store.master, P.ExistsRequest(["fence/d"], after), 2.0)
            assert isinstance(reply, P.ExistsReply) and reply.count == 1
        assert c.stats()["cluster"]["fence_waits"] == before


def test_malformed_fences_get_errors_and_the_master_keeps_serving(shared_store):
    with StoreClient(shared_store.master) as c:
        assert c.put("fence/e", b"x")
        node_id, (segment, seq) = next(iter(c.fences.after().items()))
    ahead = [segment, seq + 10**6]      # a fence that would wait, then a bad one
    for after in ({"n": "notalist"}, {"n": [1, 2]}, {"n": ["seg"]}, {"n": ["seg", True]},
                  {node_id: ahead, "n": "notalist"}):
        reply = request(shared_store.master, P.LocateRequest(["k"], after), 2.0)
        assert isinstance(reply, P.ErrorReply) and reply.code == "bad_request", (after, reply)
        assert "after" in reply.message
    with StoreClient(shared_store.master) as c:
        assert c.put("fence/after-bad", b"ok") and c.get("fence/after-bad") == b"ok"


def test_fences_hold_across_a_master_restart(cluster):
    """The restarted master learns each node's commit sequence with its inventory: the
    writer's fenced lookups are answered, and right."""
    master = cluster.start_master()
    node = cluster.add_node()
    cluster.wait_nodes(1)
    with StoreClient(cluster.master, timeout_s=2.0) as c:
        assert c.put("mr/a", b"before")
        assert node.log().count("registering with the master") == 1
        master.stop()
        cluster.start_master()
        cluster.wait_keys(1)                    # the node registered again with its inventory
        assert node.log().count("registering with the master") == 2
        for _ in range(100):                    # the client's circuit may be open for a moment
            if c.exists("mr/a"):
                break
            time.sleep(0.05)
        assert c.get("mr/a") == b"before"
        assert c.put("mr/b", b"after") and c.exists("mr/b") and c.get("mr/b") == b"after"


def test_another_client_sees_a_put_once_it_returns(shared_store):
    """The node sends its report before the writer hears back, and the master applies the
    reports it reads in a loop turn before the lookups: a lookup the answer led to, from any
    client, finds the key."""
    with StoreClient(shared_store.master) as a, StoreClient(shared_store.master, transport="tcp") as b:
        for i in range(200):
            assert a.put(f"seen/{i}", b"v" * 100)
            assert b.exists(f"seen/{i}"), i


def test_a_report_after_a_lost_one_is_refused(tmp_path):
    """Reports of a node are numbered: one that does not follow the last applied (a report in
    between was lost with a dropped connection) is refused as a gap, which makes the node
    register again with its inventory, holding the lost report's keys. A real MasterService,
    its handlers called as its loop would for the node's connection."""
    master = MasterService(MasterConfig(port=0, metrics_port=-1, publish_port=0))
    try:
        info = P.NodeInfo("n1", "tcp://127.0.0.1:1", "h", "/dev/null", 1 << 20)
        assert isinstance(master.on_RegisterRequest(P.RegisterRequest(info.to_dict()), b"n1-conn", 1),
                          P.RegisterReply)
        ok = master.on_CommittedRequest(P.CommittedRequest("n1", ["gap/a"], [1], [0], 1), b"n1-conn", 2)
        assert isinstance(ok, P.OkReply)
        lost = P.CommittedRequest("n1", ["gap/lost"], [1], [0], 3)      # 2 never came
        reply = master.on_CommittedRequest(lost, b"n1-conn", 3)
        assert isinstance(reply, P.ErrorReply) and reply.code == "report_gap", reply
        assert master.index.holders("gap/lost") == [] and master.index.holders("gap/a") != []
        # an eviction is numbered in the same sequence: a late one (seq 1 again) leaves the key
        late = master.on_EvictedRequest(P.EvictedRequest("n1", ["gap/a"], 1), b"n1-conn", 5)
        assert isinstance(late, P.ErrorReply) and late.code == "report_gap", late
        assert master.index.holders("gap/a") != []
        # the same report from any other connection is not the node's
        reply = master.on_CommittedRequest(P.CommittedRequest("n1", ["gap/x"], [1], [0], 2), b"other", 4)
        assert isinstance(reply, P.ErrorReply) and reply.code == "unknown_node", reply
    finally:
        master.close()


def test_a_report_from_another_connection_is_refused(shared_store):
    """Only the connection a node registered on speaks for it."""
    with StoreClient(shared_store.master) as c:
        assert c.put("gap/a", b"x")
        node_id, (segment, seq) = next(iter(c.fences.after().items()))
        forged = P.CommittedRequest(node_id, ["gap/forged"], [1], [0], seq + 1)
        reply = request(shared_store.master, forged)
        assert isinstance(reply, P.ErrorReply) and reply.code == "unknown_node", reply
        assert not c.exists("gap/forged")
        assert c.put("gap/b", b"y")     # the node's own next report (seq + 1) is applied
        assert c.exists("gap/b") and c.get("gap/b") == b"y"