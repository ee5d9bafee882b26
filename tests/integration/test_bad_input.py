"""Malformed frames, unknown types and wrong versions get error replies; a peer without the
token gets nothing at all (its handshake fails); the servers keep serving."""
import msgpack
import numpy as np
import pytest

from hicache_mc import protocol as P
from hicache_mc.client import StoreClient
from procs import raw_request, request


def node_address(store) -> str:
    return store.cluster.stats()["nodes"][0]["address"]


BAD = [
    ("garbage", [b"\xc1\xff not msgpack"], "bad_request"),
    ("not a list", [msgpack.packb({"a": 1})], "bad_request"),
    ("unknown type", [msgpack.packb([P.VERSION, 7, ["FrobnicateRequest"]])], "unknown_type"),
    ("wrong version", [msgpack.packb([99, 7, ["ExistsRequest", ["a"], {}]])], "bad_version"),
    ("wrong field count", [msgpack.packb([P.VERSION, 7, ["ExistsRequest"]])], "bad_request"),
    ("wrong field type", [msgpack.packb([P.VERSION, 7, ["ExistsRequest", "notalist"]])], "bad_request"),
    ("reply type as request", [msgpack.packb([P.VERSION, 7, ["OkReply"]])], "unknown_type"),
    ("a second frame", [P.encode(P.ExistsRequest(["a"]), 7), b"payload"], "bad_request"),
    ("empty", [b""], "bad_request"),
]


@pytest.mark.parametrize("which", ["master", "node"])
@pytest.mark.parametrize("name,frames,code", BAD, ids=[b[0] for b in BAD])
def test_bad_frames_get_error_and_server_keeps_serving(shared_store, which, name, frames, code):
    address = shared_store.master if which == "master" else node_address(shared_store)
    reply = raw_request(address, frames)
    assert isinstance(reply, P.ErrorReply), reply
    assert reply.code == code
    with StoreClient(shared_store.master) as c:
        assert c.put(f"after/{which}/{name}", b"ok")
        assert c.get(f"after/{which}/{name}") == b"ok"


def test_oversized_reserve_is_refused(shared_store):
    node = node_address(shared_store)
    reply = request(node, P.ReserveRequest(["huge"], [1 << 40]))
    assert isinstance(reply, P.ReserveReply) and reply.offsets == [-1]


def test_token_required_when_configured(tmp_path):
    from procs import Cluster
    cl = Cluster(tmp_path, token="s3cret")
    cl.start_master()
    cl.add_node()
    try:
        cl.wait_nodes(1)
        # without the token, or with another, the handshake fails: no request gets through
        assert request(cl.master, P.StatsRequest(), timeout_s=1.0) is None
        assert request(cl.master, P.StatsRequest(), timeout_s=1.0, token="guess") is None
        with StoreClient(cl.master, timeout_s=1.0) as anon:
            assert not anon.put("t/a", b"x")
        with StoreClient(cl.master, token="s3cret") as c:
            assert c.put("t/a", b"x") and c.get("t/a") == b"x"
            node = cl.stats()["nodes"][0]["address"]
        assert request(node, P.LeaseRequest(["t/a"]), timeout_s=1.0) is None
        assert isinstance(request(node, P.LeaseRequest(["t/a"]), token="s3cret"), P.LeaseReply)
    finally:
        cl.stop()


def test_filling_dram_evicts_and_never_corrupts(tmp_path):
    from procs import Store
    store = Store(tmp_path, dram="32MiB").start()
    try:
        with StoreClient(store.master) as c:
            size = 1 << 20
            written = []
            for i in range(120):                   # ~4x the DRAM tier
                k = f"fill/{i}"
                data = np.full(size, i % 251, dtype=np.uint8)
                if c.put(k, data):
                    written.append(k)
            assert len(written) > 32               # eviction made room for later puts
            readable = 0
            for k in written:
                got = c.get(k)
                if got is not None:
                    i = int(k.split("/")[1])
                    assert got == bytes([i % 251]) * size
                    readable += 1
            assert 0 < readable <= 32
            assert c.get(written[-1]) is not None  # the newest survive
            st = store.cluster.stats()
            assert st["evicted"] > 0 and st["keys"] == readable
    finally:
        store.stop()
