"""The direct port: the master's and nodes' requests over plain TCP. Clients use it when the
service has one, fall back to ZeroMQ when it refuses connections, and bad input on it gets an
error reply (or, for a frame that declares more than the limits, the connection dropped)
while the service keeps serving."""
import socket
import struct
import time

import msgpack
import numpy as np
import pytest

from hicache_mc import protocol as P
from hicache_mc.client import StoreClient
from hicache_mc.rpc import pack_frames, parse_frames
from test_bad_input import BAD


def direct_of(store, which: str) -> str:
    if which == "master":
        with StoreClient(store.master) as c:
            c._hello()
            return c._direct[store.master]
    return store.cluster.stats()["nodes"][0]["direct_address"]


def exchange(direct: str, frames: list, timeout_s: float = 2.0):
    """Send one framed message; the decoded reply, or None when the connection is dropped."""
    host, port = direct.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=timeout_s) as s:
        s.sendall(b"".join(bytes(f) for f in pack_frames(frames)))
        buf = bytearray()
        while True:
            got = parse_frames(buf, 1 << 30)
            if got is not None:
                return P.decode(got[1])[0]
            try:
                data = s.recv(1 << 16)
            except (ConnectionResetError, socket.timeout):
                return None
            if not data:
                return None
            buf += data


def test_client_requests_go_through_the_direct_ports(store):
    src = np.random.default_rng(3).integers(0, 256, 300_000, dtype=np.uint8)
    dst = np.zeros_like(src)
    with StoreClient(store.master) as c:
        keys = [f"direct/{i}" for i in range(4)]
        assert all(c.batch_put_from(keys, [src.ctypes.data] * 4, [src.nbytes] * 4))
        assert c.batch_exists(keys) == 4
        assert c.batch_get_into(keys[-1:], [dst.ctypes.data], [dst.nbytes]) == [True]
        assert np.array_equal(src, dst)
        used = [ch for ch in c._channels if ch.conn is not None]
        assert {ch.address for ch in used} >= {store.master, store.cluster.stats()["nodes"][0]["address"]}


@pytest.mark.parametrize("which", ["master", "node"])
@pytest.mark.parametrize("name,frames,code", BAD, ids=[b[0] for b in BAD])
def test_bad_frames_on_the_direct_port_get_errors(store, which, name, frames, code):
    reply = exchange(direct_of(store, which), frames)
    assert isinstance(reply, P.ErrorReply) and reply.code == code, reply
    with StoreClient(store.master) as c:
        assert c.put(f"after-direct/{which}/{name}", b"ok")
        assert c.get(f"after-direct/{which}/{name}") == b"ok"


@pytest.mark.parametrize("which", ["master", "node"])
def test_oversized_or_torn_frames_drop_only_that_connection(store, which):
    direct = direct_of(store, which)
    host, port = direct.rsplit(":", 1)
    # a header bigger than the limit: refused before it is buffered
    huge = struct.pack("<II", P.MAX_HEADER_BYTES + 1, 0)
    with socket.create_connection((host, int(port)), timeout=2) as s:
        s.sendall(huge)
        assert s.recv(16) == b""        # dropped
    # half a message, then the peer goes away
    with socket.create_connection((host, int(port)), timeout=2) as s:
        s.sendall(b"".join(pack_frames([msgpack.packb([P.VERSION, "StatsRequest", 1, "", []])]))[:7])
    ask = P.StatsRequest() if which == "master" else P.NodeStatsRequest()
    assert isinstance(exchange(direct, P.encode(ask, 5)), P.StatsReply)


def test_a_direct_port_that_refuses_connections_falls_back_to_zeromq(store):
    with socket.socket() as s:          # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    with StoreClient(store.master) as c:
        assert c.put("fallback/a", b"x")
        c._next_hello = time.monotonic() + 3600         # keep the master from correcting it
        c._set_direct(store.master, dead)
        for ch in c._channels:
            ch.reset()
        assert c.exists("fallback/a") and c.get("fallback/a") == b"x"
        ch = c._channel(store.master)
        assert ch.conn is None and ch.sock is not None  # went through ZeroMQ


def test_direct_ports_off(cluster):
    """``direct_port = -1`` on both: everything goes through ZeroMQ."""
    cluster.start_master(args=("--direct-port", "-1"))
    node = cluster.add_node(args=("--node-direct-port", "-1"))
    cluster.wait_nodes(1)
    with StoreClient(cluster.master) as c:
        assert c.put("off/a", b"x") and c.get("off/a") == b"x"
        assert "through its direct port" not in node.log()      # reports went through ZeroMQ
        assert all(ch.conn is None for ch in c._channels)
        assert c._direct.get(cluster.master, "") == ""


def test_more_frames_than_one_sendmsg_takes(store):
    """Over 1024 payload frames in one message (tiny objects through the ZeroMQ-frames path):
    both directions are sent in pieces of at most IOV_MAX buffers."""
    from hicache_mc.rpc import Channel
    import zmq
    node = store.cluster.stats()["nodes"][0]
    ctx = zmq.Context()
    ch = Channel(ctx, node["address"], direct=node["direct_address"])
    try:
        n = 1500
        keys = [f"iov/{i}" for i in range(n)]
        blobs = [bytes([i % 256]) * 64 for i in range(n)]
        from hicache_mc.transport.base import checksum
        reply, _ = ch.call(P.WriteRequest(keys, [checksum(b) for b in blobs]), 10, payload=blobs)
        assert ch.conn is not None and all(reply.ok)
        reply, frames = ch.call(P.ReadRequest(keys), 10)
        assert [bytes(f.buffer) for f in frames] == blobs
    finally:
        ch.close()
        ctx.term()


def test_messages_bigger_than_one_read_arrive_whole(store):
    """A 3 MiB request and reply over the direct port take several reads on each side (the
    service reads up to 1 MiB at a time, a Channel 256 KiB): every byte arrives, in order,
    and the next message on the same connection is parsed from where this one ended."""
    from hicache_mc.rpc import CHANNEL_RECV_BYTES, RECV_BYTES, Channel
    import zmq
    from hicache_mc.transport.base import checksum
    node = store.cluster.stats()["nodes"][0]
    ctx = zmq.Context()
    ch = Channel(ctx, node["address"], direct=node["direct_address"])
    try:
        rng = np.random.default_rng(11)
        blobs = [rng.integers(0, 256, (3 * RECV_BYTES) // 2, dtype=np.uint8).tobytes() for _ in range(2)]
        assert sum(map(len, blobs)) > 2 * RECV_BYTES >= 8 * CHANNEL_RECV_BYTES
        keys = ["big-frames/a", "big-frames/b"]
        reply, _ = ch.call(P.WriteRequest(keys, [checksum(b) for b in blobs]), 10, payload=blobs)
        assert ch.conn is not None and reply.ok == [True, True]
        # two requests in flight: the second reply follows the first in the same stream
        first, second = ch.send(P.ReadRequest(keys)), ch.send(P.ReadRequest(keys[::-1]))
        _, frames2 = ch.recv(second, time.monotonic() + 10)
        _, frames1 = ch.recv(first, time.monotonic() + 10)
        assert [bytes(f.buffer) for f in frames1] == blobs
        assert [bytes(f.buffer) for f in frames2] == blobs[::-1]
    finally:
        ch.close()
        ctx.term()


def test_a_late_reply_left_unread_does_not_hide_a_closed_connection(cluster):
    """A Release is sent and not waited for, so its reply sits unread in the idle direct
    connection; the node then dies. The channel must see the end of the stream behind that
    reply (and so connect anew) instead of taking the unread bytes for a live peer."""
    from hicache_mc.rpc import Channel
    import zmq
    cluster.start_master()
    node = cluster.add_node()
    cluster.wait_nodes(1)
    info = cluster.stats()["nodes"][0]
    ctx = zmq.Context()
    ch = Channel(ctx, info["address"], direct=info["direct_address"])
    try:
        ch.forget([ch.send(P.ReleaseRequest([], []))])
        assert ch.conn is not None
        time.sleep(0.3)                     # its OkReply is in the socket now, unread
        assert ch.alive()
        node.kill()
        end = time.monotonic() + 5
        while ch.alive() and time.monotonic() < end:
            time.sleep(0.05)
        assert not ch.alive() and ch.conn is None
    finally:
        ch.close()
        ctx.term()
