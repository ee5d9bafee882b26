"""The stream port against peers that have not authenticated, or misbehave once they have:
the handshake comes first, pending peers cost no thread and a fixed buffer, floods are shed
oldest first, slow peers are cut, and the server keeps serving everyone else throughout.

A real StreamServer over an anonymous mapping, no cluster: the limits are module constants,
patched smaller here so the tests wait fractions of a second.
"""
import mmap
import socket
import struct
import threading
import time
import tracemalloc

import msgpack
import numpy as np
import pytest
import xxhash
import zmq

from hicache_mc.auth import Guard, issue
from hicache_mc.errors import ProtocolError, StoreUnavailable
from hicache_mc.transport import stream
from hicache_mc.transport.grants import Grants
from hicache_mc.transport.stream import StreamServer
from hicache_mc.transport.stream_client import StreamClient
from rawsock import closed_within, recv_exact

SIZE, LOW, SEG, TOKEN = 64 << 20, 4096, "s1", "secret"


ADMIN = issue(TOKEN, "admin")       # what a client given the token itself is


@pytest.fixture
def server():
    mm = mmap.mmap(-1, SIZE)
    ctx = zmq.Context()
    guard = Guard(ctx, TOKEN)
    srv = StreamServer(mm, "127.0.0.1", 0, LOW, SEG, guard.stream_key, Grants())
    yield srv
    srv.close()
    guard.stop()
    ctx.term()
    mm.close()


def grant(srv: StreamServer, offsets, sizes, write: bool, who=ADMIN.principal) -> None:
    """What the node's loop does at a lease (read) or a reservation (write)."""
    for off, size in zip(offsets, sizes):
        srv.grants.grant(who, off, size, write, time.monotonic() + 30)


def connect(srv: StreamServer) -> socket.socket:
    host, port = srv.address.rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=5)


def handshake(s: socket.socket, token: str = TOKEN, hello: bytes = b"") -> bytes:
    """Answer the node's hello (read here unless given) as the wire format says, as the admin
    of ``token``'s cluster; the node's verdict byte."""
    hello = hello or recv_exact(s, 33)
    assert hello[0] == stream.STREAM_VERSION
    cred = issue(token, "admin")
    s.sendall(stream._answer(cred.claim, cred.seed, hello[1:]))
    return recv_exact(s, 1)


def refusal(s: socket.socket) -> str:
    n = struct.unpack("!I", recv_exact(s, 4))[0]
    return recv_exact(s, n).decode()


def round_trip(srv: StreamServer, client: StreamClient, n: int = 16, size: int = 1 << 20, seed: int = 0):
    src = np.random.default_rng(seed).integers(0, 256, n * size, dtype=np.uint8)
    dst = np.zeros_like(src)
    offsets, sizes = [LOW + i * size for i in range(n)], [size] * n
    deadline = time.monotonic() + 10
    grant(srv, offsets, sizes, True)
    sums = client.write(srv.address, SEG, offsets, [src.ctypes.data + i * size for i in range(n)],
                        sizes, deadline)
    grant(srv, offsets, sizes, False)       # committed, then leased
    assert sums == [xxhash.xxh3_64_intdigest(src[i * size:(i + 1) * size]) for i in range(n)]
    got = client.read(srv.address, SEG, offsets, [dst.ctypes.data + i * size for i in range(n)],
                      sizes, deadline, True)
    assert got == sums and np.array_equal(src, dst)


def test_round_trip_with_the_token(server):
    client = StreamClient(TOKEN)
    try:
        round_trip(server, client)
        round_trip(server, client, n=3, size=5000, seed=1)     # again, on the pooled connection
    finally:
        client.close()
    assert server.counters["stream_writes"] == 19 and server.counters["stream_reads"] == 19
    assert server.counters["stream_auth_failed"] == 0


def test_a_wrong_token_is_refused_and_the_server_keeps_serving(server):
    bad = StreamClient("wrong")
    src = np.ones(4096, dtype=np.uint8)
    start = time.monotonic()
    with pytest.raises((StoreUnavailable, ProtocolError)):
        bad.write(server.address, SEG, [LOW], [src.ctypes.data], [4096], time.monotonic() + 5)
    assert time.monotonic() - start < 2
    bad.close()
    with connect(server) as s:
        assert handshake(s, "wrong") == b"\1" and "credential" in refusal(s)
        assert closed_within(s, 2)
    assert server.counters["stream_auth_failed"] == 2
    client = StreamClient(TOKEN)
    try:
        round_trip(server, client)
    finally:
        client.close()


def test_an_idle_flood_neither_starves_honest_clients_nor_costs_threads(server):
    before = threading.active_count()
    flood = [connect(server) for _ in range(1000)]
    try:
        client = StreamClient(TOKEN)
        start = time.monotonic()
        round_trip(server, client)
        assert time.monotonic() - start < 2
        client.close()
        assert threading.active_count() - before < 20
        assert closed_within(flood[0], 2)          # shed, oldest first
        assert server.counters["stream_shed"] >= 1000 - stream.PENDING_MAX
    finally:
        for s in flood:
            s.close()


def test_the_oldest_pending_peer_is_shed(server, monkeypatch):
    monkeypatch.setattr(stream, "PENDING_MAX", 4)
    peers = [connect(server) for _ in range(5)]
    try:
        hellos = [recv_exact(s, 33) for s in peers]     # all accepted: each got its hello
        assert closed_within(peers[0], 2)
        assert handshake(peers[4], hello=hellos[4]) == b"\0"
        assert server.counters["stream_shed"] == 1
    finally:
        for s in peers:
            s.close()


def test_a_huge_length_before_the_handshake_allocates_nothing(server, monkeypatch):
    monkeypatch.setattr(stream, "AUTH_TIMEOUT_S", 0.5)
    tracemalloc.start()
    try:
        with connect(server) as s:
            s.sendall(struct.pack("!I", 16 << 20))
            assert closed_within(s, 3)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20, peak
    assert server.counters["stream_auth_timeout"] == 1


def test_a_huge_length_after_the_handshake_is_refused_before_it_is_read(server):
    tracemalloc.start()
    try:
        with connect(server) as s:
            assert handshake(s) == b"\0"
            s.sendall(struct.pack("!I", 16 << 20))
            assert recv_exact(s, 1) == b"\1" and "limit" in refusal(s)
            assert closed_within(s, 2)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20, peak


def test_a_silent_peer_is_closed_after_the_auth_timeout(server, monkeypatch):
    monkeypatch.setattr(stream, "AUTH_TIMEOUT_S", 0.3)
    with connect(server) as s:
        recv_exact(s, 33)
        assert closed_within(s, 2)
    assert server.counters["stream_auth_timeout"] == 1


def trickle_until_closed(s: socket.socket, seconds: float) -> bool:
    """Send a byte every 0.1 s; whether the node closed ``s`` within ``seconds``."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            s.send(b"x")
        except OSError:
            return True
        if closed_within(s, 0.1):
            return True
    return False


def test_a_trickling_unauthenticated_peer_is_closed(server, monkeypatch):
    monkeypatch.setattr(stream, "AUTH_TIMEOUT_S", 0.5)
    with connect(server) as s:
        recv_exact(s, 33)
        s.sendall(struct.pack("!I", 100))
        assert trickle_until_closed(s, 2)


def test_a_trickled_header_is_cut(server, monkeypatch):
    monkeypatch.setattr(stream, "HEADER_S", 0.5)
    with connect(server) as s:
        assert handshake(s) == b"\0"
        s.sendall(struct.pack("!I", 100))
        assert trickle_until_closed(s, 2)


def test_a_stalled_write_body_is_cut(server, monkeypatch):
    monkeypatch.setattr(stream, "BODY_S", 0.5)
    head = msgpack.packb({"v": stream.STREAM_VERSION, "op": "write", "segment": SEG,
                          "ranges": [[LOW, 1 << 20]]})
    grant(server, [LOW], [1 << 20], True)
    with connect(server) as s:
        assert handshake(s) == b"\0"
        s.sendall(struct.pack("!I", len(head)) + head + b"x" * 1000)
        assert closed_within(s, 2)
    client = StreamClient(TOKEN)
    try:
        round_trip(server, client, n=2)
    finally:
        client.close()


def test_an_idle_connection_is_closed_and_the_client_reconnects(server, monkeypatch):
    monkeypatch.setattr(stream, "IDLE_S", 0.3)
    client = StreamClient(TOKEN)
    try:
        round_trip(server, client, n=2)
        time.sleep(0.8)
        round_trip(server, client, n=2, seed=2)
    finally:
        client.close()


BAD = [
    ("not msgpack", b"\xc1\xc1\xc1", "undecodable"),
    ("a long string", {"v": stream.STREAM_VERSION, "op": "read", "segment": "s" * 100_000, "ranges": []}, "undecodable"),
    ("a token in the header", {"v": stream.STREAM_VERSION, "token": TOKEN, "op": "read", "segment": SEG,
                               "ranges": [[LOW, 1]]}, "unexpected"),
    ("a big map", {str(i): i for i in range(100)}, "undecodable"),
    ("ranges of triples", {"v": stream.STREAM_VERSION, "op": "read", "segment": SEG, "ranges": [[LOW, 1, 2]]}, "bad range"),
    ("version 2", {"v": 2, "op": "read", "segment": SEG, "ranges": []}, "version"),
]


@pytest.mark.parametrize("name,header,words", BAD, ids=[b[0] for b in BAD])
def test_bad_headers_are_refused_with_a_reason(server, name, header, words):
    body = header if isinstance(header, bytes) else msgpack.packb(header)
    with connect(server) as s:
        assert handshake(s) == b"\0"
        s.sendall(struct.pack("!I", len(body)) + body)
        assert recv_exact(s, 1) == b"\1"
        reason = refusal(s)
        assert words in reason, reason
        assert closed_within(s, 2)
    assert server.counters["stream_refused"] == 1
    client = StreamClient(TOKEN)
    try:
        round_trip(server, client, n=2)
    finally:
        client.close()


def test_authenticated_connections_are_capped(server, monkeypatch):
    monkeypatch.setattr(stream, "MAX_CONNECTIONS", 2)
    peers = [connect(server) for _ in range(3)]
    try:
        assert [handshake(s) for s in peers[:2]] == [b"\0", b"\0"]
        assert handshake(peers[2]) == b"\1" and "connections" in refusal(peers[2])
        peers[0].close()
        time.sleep(0.2)
        with connect(server) as s:
            assert handshake(s) == b"\0"
    finally:
        for s in peers:
            s.close()


def refusal_of(grants, who, ranges, write, now) -> str:
    """Why ``grants`` refuses the transfer ("" when it opens one, closed again at once)."""
    try:
        grants.open(who, ranges, write, now).close()
    except ProtocolError as exc:
        return str(exc)
    return ""


def test_lapsed_grants_are_refused_and_purged():
    grants, who = Grants(), ADMIN.principal
    grants.grant(who, LOW, 100, False, expires=10.0)
    assert refusal_of(grants, who, [(LOW, 100)], False, now=5.0) == ""
    assert "not reserved" in refusal_of(grants, who, [(LOW, 100)], True, now=5.0)    # not a write
    assert "not leased" in refusal_of(grants, who, [(LOW, 101)], False, now=5.0)     # past its end
    assert "not leased" in refusal_of(grants, who, [(LOW, 100)], False, now=10.0)    # lapsed
    grants.purge(now=11.0)
    assert len(grants) == 0
    grants.grant(who, LOW, 100, False, expires=11.5)
    grants.purge(now=11.8)          # within a second of the last purge: kept until the next
    assert len(grants) == 1
    grants.purge(now=12.5)
    assert len(grants) == 0


def test_a_transfer_names_each_range_once_and_one_per_lease():
    grants, who = Grants(), ADMIN.principal
    end = time.monotonic() + 30
    grants.grant(who, LOW, 100, False, end)
    grants.grant(who, LOW + 256, 100, False, end)
    assert "more than once" in refusal_of(grants, who, [(LOW, 100), (LOW + 256, 100), (LOW, 100)],
                                          False, 0.0)
    first = grants.open(who, [(LOW, 100)], False, 0.0)
    assert "being moved" in refusal_of(grants, who, [(LOW, 100)], False, 0.0)    # one lease
    grants.grant(who, LOW, 100, False, end)                                       # a second one
    assert refusal_of(grants, who, [(LOW, 100)], False, 0.0) == ""
    first.close()


def test_an_open_transfer_pins_its_slot_and_is_cut_once_its_grant_ends():
    grants, who = Grants(), ADMIN.principal
    grants.grant(who, LOW, 100, True, time.monotonic() + 30)
    t = grants.open(who, [(LOW, 100)], True, 0.0)
    assert t.live(0)
    assert grants.revoke(who, LOW)                  # the writer gave the slot back ...
    assert not t.live(0)                            # ... its transfer stops at the next chunk
    assert grants.hold(LOW)                         # and the slot stays out of reuse until then
    assert not grants.hold(LOW + 256) and grants.take_unpinned() == []
    t.close()
    assert grants.take_unpinned() == [LOW] and not grants.hold(LOW)
