"""Acknowledged puts that must not be lost: reports the master gets late or refuses, and
objects whose bytes do not match their checksum (issue 19)."""
from hicache_mc import protocol as P
from hicache_mc.client import StoreClient
from procs import request


def test_a_late_eviction_report_leaves_a_key_committed_after_it(store):
    """An eviction report that reaches the master after a later commit of the same key is not
    the node's next report: refused, it must not remove the key the node holds. (Here an
    unnumbered one, as the node sent them before they were numbered.)"""
    with StoreClient(store.master) as c:
        assert c.put("late/k", b"v1")
        node_id = next(iter(c._fences))
        reply = request(store.master, P.EvictedRequest(node_id, ["late/k"]))
        assert isinstance(reply, P.ErrorReply) and reply.code == "report_gap", reply
        assert c.exists("late/k")
        assert c.put("late/k", b"v1") and c.get("late/k") == b"v1"
        assert c.clear("late/") == 1 and not c.exists("late/k")   # the node's own report

