"""The tcp transport's stream port: bytes straight into and out of the node's DRAM segment,
refusals of bad requests (the node keeps serving), lease release, a node killed mid-transfer.
(tests/transport/test_stream_guard.py: the handshake and the limits, against one StreamServer.)"""
import socket
import struct
import threading
import time

import msgpack
import numpy as np
import pytest

from hicache_mc import protocol as P
from hicache_mc.client import StoreClient
from hicache_mc.auth import issue
from hicache_mc.transport.stream import HEADER_MAX, STREAM_VERSION, _answer
from procs import Cluster, request
from rawsock import recv_exact


def node_record(cluster_or_store) -> dict:
    stats = cluster_or_store.stats() if isinstance(cluster_or_store, Cluster) else cluster_or_store.cluster.stats()
    return stats["nodes"][0]


def node_stats(address: str, token: str = "") -> dict:
    reply = request(address, P.NodeStatsRequest(), token=token)
    assert isinstance(reply, P.StatsReply), reply
    return reply.stats


def data(seed: int, size: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


def test_tcp_moves_object_bytes_through_the_stream_port(shared_store):
    node = node_record(shared_store)
    assert node["data_address"].startswith("127.0.0.1:")
    sizes = [0, 1, 4096, (256 << 10) + 3, 3 << 20]
    srcs = [data(i, s) for i, s in enumerate(sizes)]
    keys = [f"st/{i}" for i in range(len(sizes))]
    before = node_stats(node["address"])
    with StoreClient(shared_store.master, transport="tcp") as c:
        assert c.batch_put_from(keys, [a.ctypes.data for a in srcs], sizes) == [True] * len(sizes)
        dsts = [np.zeros(s, dtype=np.uint8) for s in sizes]
        assert c.batch_get_into(keys, [a.ctypes.data for a in dsts], sizes) == [True] * len(sizes)
        assert all(np.array_equal(a, b) for a, b in zip(srcs, dsts))
    st = node_stats(node["address"])
    assert st["stream_writes"] >= before["stream_writes"] + len(sizes)
    assert st["stream_reads"] >= before["stream_reads"] + len(sizes)


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_finished_readers_release_their_leases(shared_store, transport):
    """A removed object's slot is reusable as soon as its readers are done, not when the
    lease would have run out (the release travels before the clear on the same channel)."""
    node = node_record(shared_store)
    with StoreClient(shared_store.master, transport=transport) as c:
        keys = [f"rel-{transport}/{i}" for i in range(8)]
        src = data(7, 1 << 20)
        assert all(c.batch_put_from(keys, [src.ctypes.data] * 8, [1 << 20] * 8))
        dst = np.zeros(1 << 20, dtype=np.uint8)
        assert all(c.batch_get_into(keys, [dst.ctypes.data] * 8, [1 << 20] * 8))
        assert c.clear(f"rel-{transport}/") == 8
    assert node_stats(node["address"])["quarantined"] == 0


def read_reply(s: socket.socket) -> tuple[bytes, str]:
    """(status byte, reason) of a verdict or a reply."""
    status = recv_exact(s, 1)
    if status != b"\1":
        return status, ""
    n = struct.unpack("!I", recv_exact(s, 4))[0]
    return status, recv_exact(s, n).decode()


def connect(address: str, token: str = "") -> tuple[socket.socket, tuple[bytes, str]]:
    """A raw connection to a stream port that has answered its hello; the node's verdict."""
    host, port = address.rsplit(":", 1)
    s = socket.create_connection((host, int(port)), timeout=5)
    hello = recv_exact(s, 33)
    cred = issue(token, "admin") if token else None     # what a client given the token is
    s.sendall(_answer(b"admin:", cred.seed if cred else b"", hello[1:]))
    return s, read_reply(s)


def authenticated(address: str, token: str = "") -> socket.socket:
    s, verdict = connect(address, token)
    assert verdict == (b"\0", ""), verdict
    return s


def stream_request(address: str, header, trailer: bytes = b"", token: str = "") -> tuple[bytes, str]:
    """Send one raw request to a stream port; (status byte, reason) of the reply."""
    with authenticated(address, token) as s:
        body = header if isinstance(header, bytes) else msgpack.packb(header)
        s.sendall(struct.pack("!I", len(body)) + body + trailer)
        return read_reply(s)


def segment(node: dict) -> str:
    return node["shm_path"].rsplit("-", 1)[-1]


def good(**over):
    head = {"v": STREAM_VERSION, "op": "read", "ranges": [[4096, 16]]}
    head.update(over)
    return head


BAD = [
    ("not msgpack", b"\xc1\xc1\xc1", "undecodable"),
    ("not a map", msgpack.packb([1, 2]), "map"),
    ("wrong version", good(v=99), "version"),
    ("unknown op", good(op="erase"), "op must be"),
    ("ranges not a list", good(ranges="all"), "ranges"),
    ("negative size", good(ranges=[[4096, -1]]), "bad range"),
    ("into the header", good(ranges=[[0, 16]]), "bad range"),
    ("past the end", good(ranges=[[4096, 1 << 40]]), "bad range"),
    ("float offset", good(ranges=[[4096.0, 16]]), "bad range"),
]


@pytest.mark.parametrize("name,header,words", BAD, ids=[b[0] for b in BAD])
def test_bad_stream_requests_are_refused_and_the_node_keeps_serving(shared_store, name, header,
                                                                    words):
    node = node_record(shared_store)
    refused = node_stats(node["address"])["stream_refused"]
    status, reason = stream_request(node["data_address"], header)
    assert status == b"\1" and words in reason, reason
    with StoreClient(shared_store.master, transport="tcp") as c:
        assert c.put(f"after/{name}", b"ok" * 1000)
        assert c.get(f"after/{name}") == b"ok" * 1000
    assert node_stats(node["address"])["stream_refused"] >= refused + 1


def test_offsets_of_another_segment_are_refused(shared_store):
    """A client still holding the record of a node that restarted at the same address must
    not write its offsets into the new node's segment (over its objects)."""
    node = node_record(shared_store)
    status, reason = stream_request(node["data_address"], good(segment="0ld5e9"))
    assert status == b"\1" and "restarted" in reason, reason
    head = good(op="write", segment="0ld5e9")
    status, reason = stream_request(node["data_address"], head, trailer=b"x" * 16)
    assert status == b"\1" and "restarted" in reason, reason
    # the right segment passes that check, and then this range is not leased to the peer
    status, reason = stream_request(node["data_address"], good(segment=segment(node)))
    assert status == b"\1" and "not leased" in reason, reason


def test_oversized_header_is_refused_before_it_is_read(shared_store):
    with authenticated(node_record(shared_store)["data_address"]) as s:
        s.sendall(struct.pack("!I", HEADER_MAX + 1))
        status, reason = read_reply(s)
        assert status == b"\1" and "limit" in reason, reason


def test_stream_port_checks_the_token(tmp_path):
    cluster = Cluster(tmp_path, token="s3cret")
    try:
        cluster.start_serve()
        node = node_record(cluster)
        for wrong in ("", "wrong"):
            s, (status, reason) = connect(node["data_address"], wrong)
            s.close()
            assert status == b"\1" and "credential" in reason, reason
        status, reason = stream_request(node["data_address"], good(segment=segment(node)), token="s3cret")
        assert status == b"\1" and "not leased" in reason, reason      # past the handshake
        with StoreClient(cluster.master, transport="tcp", token="s3cret") as c:
            assert c.put("tok/a", b"x" * 5000) and c.get("tok/a") == b"x" * 5000
    finally:
        cluster.stop()


def test_node_killed_mid_transfer_gives_misses_not_a_hang(store):
    size, n = 4 << 20, 24
    src = data(3, size)
    with StoreClient(store.master, transport="tcp", timeout_s=3.0) as c:
        keys = [f"kill/{i}" for i in range(n)]
        assert all(c.batch_put_from(keys, [src.ctypes.data] * n, [size] * n))
        dst = np.zeros(size * n, dtype=np.uint8)
        ptrs = [dst.ctypes.data + i * size for i in range(n)]
        results, errors = [], []

        def reader():
            try:
                for _ in range(50):
                    results.append(c.batch_get_into(keys, ptrs, [size] * n))
            except Exception as exc:     # the client must not raise: recorded to fail below
                errors.append(exc)

        t = threading.Thread(target=reader)
        t.start()
        while not results:
            time.sleep(0.01)
        store.kill()
        t.join(timeout=30)
        assert not t.is_alive(), "a read hung after the node died"
        assert not errors
        assert results[-1] == [False] * n
