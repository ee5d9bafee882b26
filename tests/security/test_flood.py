"""Unauthenticated peers against every port of a master and a node started with a token.

Each attack runs against every TCP port the two processes listen on (their ZeroMQ ports, the
node's stream port, the metrics ports), found from the processes. After it: the processes'
resident memory grew by at most 64 MiB, no node was expired, and an honest client that has
the token puts and gets 16 x 1 MiB (over the stream port and over shared memory) within 2 s.
"""
from __future__ import annotations

import socket
import struct
import threading
import time

import msgpack
import numpy as np
import pytest

from hicache_mc import protocol as P
from hicache_mc.client import StoreClient
from peers import TOKEN, MiB, close_all, listening_ports, open_idle, rss, settle, threads

RSS_LIMIT = 64 * MiB
THREADS_LIMIT = 48          # a process's threads while 1,000 idle peers sit on each of its ports


def honest_round_trip(cluster, transport: str) -> float:
    """Seconds for an honest client to put and get back 16 x 1 MiB, every byte checked."""
    rng = np.random.default_rng(int(time.monotonic_ns() % 1000))
    src = [rng.integers(0, 256, MiB, dtype=np.uint8) for _ in range(16)]
    out = [np.zeros(MiB, np.uint8) for _ in range(16)]
    keys = [f"honest/{transport}/{time.monotonic_ns()}/{i}" for i in range(16)]
    t0 = time.monotonic()
    with StoreClient(cluster.master, token=TOKEN, transport=transport, timeout_s=2.0) as c:
        assert all(c.batch_put_from(keys, [a.ctypes.data for a in src], [MiB] * 16))
        assert all(c.batch_get_into(keys, [o.ctypes.data for o in out], [MiB] * 16))
    took = time.monotonic() - t0
    assert all(np.array_equal(a, b) for a, b in zip(src, out))
    return took


def ports_of(procs) -> dict[str, list[int]]:
    ports = {name: listening_ports(p.p.pid) for name, p in procs.items()}
    # the master: ZeroMQ + metrics; the node: ZeroMQ + stream + metrics
    assert len(ports["master"]) >= 2 and len(ports["node"]) >= 3, ports
    return ports


def check_after(cluster, procs, base: dict, expired: int, what: str) -> None:
    """The bounds every attack must keep; the figures go to the test's output (``-s``)."""
    grew = {name: rss(p.p.pid) - base[name] for name, p in procs.items()}
    took = {transport: honest_round_trip(cluster, transport) for transport in ("tcp", "shm")}
    print(f"\n[{what}] RSS growth " + ", ".join(f"{n} {g / MiB:+.1f} MiB" for n, g in grew.items())
          + "; honest 16 x 1 MiB put+get " + ", ".join(f"{t} {s * 1000:.0f} ms" for t, s in took.items()))
    for name, g in grew.items():
        assert g <= RSS_LIMIT, f"{name}: resident memory grew {g / MiB:.0f} MiB"
    for transport, s in took.items():
        assert s < 2.0, f"honest {transport} round trip took {s:.2f} s"
    st = cluster.stats()
    assert st["nodes_expired"] == expired and len(st["nodes"]) == 1, "the node was expired"


def test_idle_connections_on_every_port(guarded):
    cluster, procs = guarded
    ports = ports_of(procs)
    expired = cluster.stats()["nodes_expired"]
    base = {name: rss(p.p.pid) for name, p in procs.items()}
    held = []
    try:
        for plist in ports.values():
            for port in plist:
                got = open_idle(port, 1000)
                held += got
                assert len(got) >= 900, f"port {port} took only {len(got)} of 1,000 connections"
        for transport in ("tcp", "shm"):
            took = honest_round_trip(cluster, transport)
            assert took < 2.0, f"honest {transport} round trip took {took:.2f} s among idle peers"
        for name, p in procs.items():
            assert threads(p.p.pid) < THREADS_LIMIT, f"{name} runs {threads(p.p.pid)} threads"
        settle(2.0)                 # longer than the node's liveness window (6 x 0.25 s)
        check_after(cluster, procs, base, expired, f"{len(held)} idle connections")
    finally:
        close_all(held)


# ------------------------------------------------------------------ what an attacker sends

GREETING = (b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\x00")
            + b"\x00" + b"\x00" * 31)          # ZMTP 3.0, NULL mechanism, as a client


def command(name: bytes, body: bytes) -> bytes:
    data = bytes([len(name)]) + name + body
    return b"\x04" + bytes([len(data)]) + data


READY = command(b"READY", b"\x0bSocket-Type" + struct.pack(">I", 6) + b"DEALER")


def frame(size: int, more: bool) -> bytes:
    """A long ZMTP frame header declaring ``size`` bytes."""
    return bytes([0x02 | (0x01 if more else 0)]) + struct.pack(">Q", size)


def pour(port: int, head: bytes, stream, budget: int, seconds: float = 8.0) -> int:
    """Send ``head`` then what ``stream`` yields until ``budget`` bytes, ``seconds`` or the
    server closes the connection; the bytes the server took."""
    sent, end = 0, time.monotonic() + seconds
    with socket.create_connection(("127.0.0.1", port), timeout=2.0) as s:
        try:
            s.sendall(head)
            sent += len(head)
            for chunk in stream:
                if sent >= budget or time.monotonic() > end:
                    break
                s.sendall(chunk)
                sent += len(chunk)
        except OSError:
            pass                    # closed by the server: what we want
    return sent


def declared_64mib():
    """One frame declaring 64 MiB, then its body."""
    yield frame(64 * MiB, more=False)
    block = b"\x01" * MiB
    while True:
        yield block


def endless_multipart():
    """Frames of 1 MiB, each saying more follows, forever."""
    block = frame(MiB, more=True) + b"\x02" * MiB
    while True:
        yield block


def container_bomb():
    """A request header of ~16 million empty arrays where the keys go, 120 to a list: inside
    a per-container limit of 128k items, and under 16 MiB."""
    body = msgpack.packb([P.VERSION, 1, ["ExistsRequest", [[[]] * 120] * (1 << 17), {}]])
    yield frame(len(body), more=False) + body
    while True:
        yield b"\x00" * 4096      # keep the connection busy while the server would decode


ATTACKS = {"declared_64mib": declared_64mib, "endless_multipart": endless_multipart,
           "container_bomb": container_bomb}


@pytest.mark.parametrize("attack", list(ATTACKS))
def test_oversized_endless_and_bomb_messages(guarded, attack):
    cluster, procs = guarded
    ports = ports_of(procs)
    expired = cluster.stats()["nodes_expired"]
    base = {name: rss(p.p.pid) for name, p in procs.items()}
    taken: dict[int, int] = {}

    def run(port):
        taken[port] = pour(port, GREETING + READY, ATTACKS[attack](), budget=256 * MiB)

    workers = [threading.Thread(target=run, args=(port,)) for plist in ports.values() for port in plist]
    for w in workers:
        w.start()
    for w in workers:
        w.join(30)
    check_after(cluster, procs, base, expired, f"{attack}: {sum(taken.values()) / MiB:.0f} MiB sent")


def test_stream_port_length_without_a_body(guarded):
    """A thousand peers that each send a request length and nothing more."""
    cluster, procs = guarded
    expired = cluster.stats()["nodes_expired"]
    base = {name: rss(p.p.pid) for name, p in procs.items()}
    stream_port = int(cluster.stats()["nodes"][0]["data_address"].rsplit(":", 1)[1])
    assert stream_port in listening_ports(procs["node"].p.pid)
    held = open_idle(stream_port, 1000)
    try:
        for s in held:
            try:
                s.send(struct.pack("!I", 16 * MiB))
            except OSError:
                pass
        settle(0.5)
        assert threads(procs["node"].p.pid) < THREADS_LIMIT
        check_after(cluster, procs, base, expired, f"{len(held)} stream-port lengths without a body")
    finally:
        close_all(held)
