"""Two tenants' client credentials against a tokened node: a slot lives as long as anything
references it (a lease, a reservation, an open stream transfer), every chunk of a transfer
checks that its grant is still live, and a request names each range once. Tenant A tries to
read on, or write on, through the stream port after it gave its slot back, while tenant B
stores into the node: A must never see a byte of B's, nor B's object a byte of A's."""
from __future__ import annotations

import socket
import struct

import numpy as np
import zmq

from hicache_mc import protocol as P
from hicache_mc.auth import issue
from hicache_mc.client import StoreClient
from hicache_mc.rpc import Channel
from peers import TOKEN
from procs import request
from rawsock import recv_exact, recv_until_closed, stream_header, stream_login

A = issue(TOKEN, "client", "teamA")
B = issue(TOKEN, "client", "teamB")
MiB = 1 << 20
SIZE = 24 * MiB     # far more than the socket buffers hold: a reader that stops stalls the node


def node_of(cluster) -> P.NodeInfo:
    reply = request(cluster.master, P.StatsRequest(), token=TOKEN)
    return P.NodeInfo.from_dict({k: v for k, v in reply.stats["nodes"][0].items()
                                 if k in P.NodeInfo.__dataclass_fields__})


def node_stats(node: P.NodeInfo) -> dict:
    return request(node.address, P.NodeStatsRequest(), token=TOKEN).stats


def blob(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, SIZE, dtype=np.uint8)


def reason(s: socket.socket) -> str:
    """The reason of a refusal whose status byte was read."""
    return recv_exact(s, struct.unpack("!I", recv_exact(s, 4))[0]).decode()


class Tenant:
    """A tenant's raw channel to the node (Lease, Release, Reserve, Clear as its client would)."""

    def __init__(self, node: P.NodeInfo, cred):
        self.ctx = zmq.Context()
        self.ch = Channel(self.ctx, node.address, cred.text())

    def call(self, msg):
        return self.ch.call(msg, 5.0)

    def close(self):
        self.ch.close()
        self.ctx.term()


def test_a_request_names_each_range_once(guarded):
    cluster, _ = guarded
    node = node_of(cluster)
    data = blob(1)
    with StoreClient(cluster.master, token=A.text(), transport="tcp") as a:
        assert a.put("ns@teamA/once", data)
    t = Tenant(node, A)
    try:
        off = t.call(P.LeaseRequest(["ns@teamA/once"])).offsets[0]
        assert off >= 0
        refused = node_stats(node)["stream_refused"]
        with stream_login(node.data_address, A) as s:
            s.sendall(stream_header("read", P.segment_of(node), [[off, SIZE]] * 64))
            assert recv_exact(s, 1) == b"\1"
            assert "once" in reason(s)
        assert node_stats(node)["stream_refused"] == refused + 1
        t.call(P.ReleaseRequest(["ns@teamA/once"], [off]))
        assert t.call(P.ClearRequest("ns@teamA/once")).removed == 1
    finally:
        t.close()


def test_a_slow_reader_never_receives_another_tenants_bytes(guarded):
    """A leases its object, starts reading it and stops; releases and clears it; B stores an
    object as big. A then reads on: only A's bytes come, and the node cuts the transfer."""
    cluster, _ = guarded
    node = node_of(cluster)
    mine, theirs = blob(2), blob(3)
    with StoreClient(cluster.master, token=A.text(), transport="tcp") as a:
        assert a.put("ns@teamA/slow", mine)
    t = Tenant(node, A)
    try:
        off = t.call(P.LeaseRequest(["ns@teamA/slow"])).offsets[0]
        s = stream_login(node.data_address, A, rcvbuf=64 << 10)
        s.sendall(stream_header("read", P.segment_of(node), [[off, SIZE]]))
        assert recv_exact(s, 1) == b"\0"
        got = recv_exact(s, MiB)                # the transfer runs; then A stops reading
        t.call(P.ReleaseRequest(["ns@teamA/slow"], [off]))
        assert t.call(P.ClearRequest("ns@teamA/slow")).removed == 1
        with StoreClient(cluster.master, token=B.text(), transport="tcp") as b:
            assert b.put("ns@teamB/slow", theirs)
            got += recv_until_closed(s, SIZE - len(got))
            s.close()
            assert got == mine.tobytes()[:len(got)], "tenant A received bytes that are not its own"
            assert len(got) < SIZE              # cut once its grant ended
            assert b.get("ns@teamB/slow") == theirs.tobytes()
            assert b.clear("ns@teamB/slow") == 1
        assert node_stats(node)["stream_cut"] >= 1
    finally:
        t.close()


def test_a_late_writer_never_lands_in_another_tenants_object(guarded):
    """A reserves a slot, writes half of its body and stops; gives the slot back; B stores an
    object as big. A's late half must not land in B's object."""
    cluster, _ = guarded
    node = node_of(cluster)
    junk, theirs = np.full(SIZE, 0xAA, np.uint8), blob(4)
    t = Tenant(node, A)
    try:
        off = t.call(P.ReserveRequest(["ns@teamA/late"], [SIZE])).offsets[0]
        assert off >= 0
        s = stream_login(node.data_address, A)
        s.sendall(stream_header("write", P.segment_of(node), [[off, SIZE]]))
        s.sendall(junk[: SIZE // 2].tobytes())
        t.call(P.ReleaseRequest(["ns@teamA/late"], [off]))     # gives the slot back
        with StoreClient(cluster.master, token=B.text(), transport="tcp") as b:
            assert b.put("ns@teamB/late", theirs)
            try:
                s.sendall(junk[SIZE // 2:].tobytes())
                recv_until_closed(s, 1 << 16)
            except OSError:
                pass                # cut by the node: what the test wants
            s.close()
            assert b.get("ns@teamB/late") == theirs.tobytes(), "tenant A's bytes landed in B's object"
            assert b.clear("ns@teamB/late") == 1
        assert node_stats(node)["stream_cut"] >= 1
    finally:
        t.close()
