"""What one client credential can make the master do: every request's work, the replies it
leaves unread and the state it leaves behind are bounded, and the nodes' liveness never waits
behind a lookup. Against a master and a node started with a token, as processes, each attack
made with an ordinary client credential of tenant A."""
from __future__ import annotations

import re
import time
import urllib.request

import numpy as np
import pytest
import zmq

from hicache_mc import protocol as P
from hicache_mc.auth import credential, issue, secure_client
from hicache_mc.client import StoreClient
from hicache_mc.errors import StoreUnavailable
from hicache_mc.rpc import Channel
from peers import TOKEN, MiB, rss
from procs import Cluster, free_port

A = issue(TOKEN, "client", "teamA").text()
B = issue(TOKEN, "client", "teamB").text()


def start(tmp_path) -> Cluster:
    """A master and a node with a token; the node is dropped after 2 s without a heartbeat."""
    c = Cluster(tmp_path, heartbeat_s=0.25, liveness=8, token=TOKEN)
    c.metrics_port = free_port()
    c.start_master(("--metrics-port", str(c.metrics_port)))
    c.add_node(dram="128MiB")
    c.wait_nodes(1)
    return c


@pytest.fixture(scope="module")
def bounded(tmp_path_factory):
    c = start(tmp_path_factory.mktemp("bounded"))
    yield c
    c.stop()


@pytest.fixture
def fresh(tmp_path):
    """A cluster of its own, for a test that measures the master's peak memory."""
    c = start(tmp_path)
    yield c
    c.stop()


def dealer(cluster, cred: str, rcvhwm: int = 1000) -> zmq.Socket:
    """A raw DEALER to the master speaking as ``cred`` (what a hostile client would hold)."""
    sock = secure_client(zmq.Context.instance().socket(zmq.DEALER), credential(cred),
                         P.MAX_HEADER_BYTES)
    sock.setsockopt(zmq.RCVHWM, rcvhwm)
    sock.connect(cluster.master)
    return sock


def put_tiny(cluster, cred: str, keys: list[str]) -> None:
    buf = np.zeros(64, np.uint8)
    with StoreClient(cluster.master, token=cred) as c:
        for i in range(0, len(keys), 4096):
            part = keys[i:i + 4096]
            assert all(c.batch_put_from(part, [buf.ctypes.data] * len(part), [64] * len(part)))


def admin_stats(cluster) -> dict:
    return cluster.stats(5.0)


def busy(cluster) -> int:
    """Requests the master refused as busy so far."""
    return admin_stats(cluster).get("rejected", {}).get("busy", 0)


def test_wide_lookups_never_silence_the_master_to_its_nodes(bounded):
    """Four Exists of 131,072 keys in as many namespaces (each ~1 s of the master's work) in
    flight at once: the node's heartbeats are read and applied between their slices, so the
    node is never expired and its keys stay; every lookup is still answered in full."""
    held = [f"held@teamA/{i:064x}/k" for i in range(2000)]
    put_tiny(bounded, A, held)
    before = admin_stats(bounded)
    wide = [f"w{i:05x}@teamA/{i:064x}/k" for i in range(P.MAX_KEYS - len(held))] + held
    sock = dealer(bounded, A)
    try:
        for rid in range(1, 5):
            sock.send(P.encode(P.ExistsRequest(wide), rid))
        for _ in range(4):
            assert sock.poll(120_000), "a wide lookup was never answered"
            reply = P.decode(sock.recv(), request=False).msg
            assert isinstance(reply, P.ExistsReply) and reply.count == 0, reply
        sock.send(P.encode(P.ExistsRequest(held), 9))
        assert sock.poll(10_000)
        assert P.decode(sock.recv(), request=False).msg.count == len(held)
    finally:
        sock.close(0)
    after = admin_stats(bounded)
    assert after["nodes_expired"] == before["nodes_expired"], "the node was expired"
    assert after["keys"] == before["keys"] and len(after["nodes"]) == 1


def test_replies_a_client_never_reads_are_refused_not_buffered(fresh):
    """2,000 snapshots of a 16k-key namespace (256 KiB each) asked for on a connection that
    never reads: the master queues a fresh amount for that tenant and refuses the rest as
    busy, so its memory stays put; another tenant is served meanwhile."""
    put_tiny(fresh, A, [f"snap@teamA/{i:064x}/k" for i in range(16384)])
    master = fresh.master_proc.p.pid
    base = rss(master)
    busy_before = busy(fresh)
    sock = dealer(fresh, A, rcvhwm=1)
    sock.setsockopt(zmq.RCVBUF, 4096)
    try:
        for rid in range(2000):
            sock.send(P.encode(P.SnapshotRequest("snap@teamA"), rid))
        with StoreClient(fresh.master, token=B) as b:    # served meanwhile
            assert b.put("other@teamB/k", b"b" * 100) and b.exists("other@teamB/k")
        end = time.monotonic() + 60
        while busy(fresh) - busy_before < 1000:
            assert time.monotonic() < end, "the master never refused the unread snapshots"
            time.sleep(0.1)
        grew = rss(master) - base
    finally:
        sock.close(0)
    print(f"\n[unread snapshots] master RSS {grew / MiB:+.1f} MiB")
    assert grew < 96 * MiB, f"the master's memory grew {grew / MiB:.0f} MiB"


def test_connections_past_the_cap_are_refused_but_never_a_nodes(tmp_path):
    """With a cap of 16 connections, tenant A's 17th connection fails its handshake, while a
    second node still registers and an administrator still gets in; a closed connection
    makes room for the next."""
    c = Cluster(tmp_path, heartbeat_s=0.25, liveness=8, token=TOKEN)
    c.env["HICACHE_MC_MASTER_MAX_CONNECTIONS"] = "16"
    c.start_master(("--metrics-port", str(free_port())))
    c.add_node(dram="64MiB")
    ctx = zmq.Context()
    held: list[Channel] = []
    try:
        c.wait_nodes(1)
        refused = 0
        for _ in range(24):
            ch = Channel(ctx, c.master, A)
            held.append(ch)
            try:
                ch.call(P.StatsRequest(), 5.0)
            except StoreUnavailable as exc:
                assert "max_connections" in str(exc), exc
                refused += 1
        # 16 in all: A's, and the node's once it is counted (3 s after it connected)
        assert 15 <= 24 - refused <= 16, refused
        c.add_node(dram="64MiB")
        assert len(c.wait_nodes(2)["nodes"]) == 2
        assert c.stats()["connections_refused"] >= refused
        for ch in held:
            ch.close()
        held.clear()
        end = time.monotonic() + 10
        while True:         # the closed connections are noticed, and there is room again
            ch = Channel(ctx, c.master, A)
            held.append(ch)
            try:
                assert isinstance(ch.call(P.StatsRequest(), 5.0), P.StatsReply)
                break
            except StoreUnavailable:
                assert time.monotonic() < end, "no room after the connections closed"
                time.sleep(0.1)
    finally:
        for ch in held:
            ch.close()
        ctx.term()
        c.stop()


def test_namespaces_emptied_leave_no_state_behind(bounded):
    """Tenant A stores a key in each of 3,000 namespaces and clears them: the publisher keeps
    no numbering for a namespace with no keys and no subscriber, so what it keeps is back to
    what it was (the master keeps nothing per namespace ever used)."""
    before = admin_stats(bounded)
    put_tiny(bounded, A, [f"gone{i:04d}@teamA/{i:064x}/k" for i in range(3000)])
    assert admin_stats(bounded)["residency_namespaces"] >= before["residency_namespaces"] + 3000
    with StoreClient(bounded.master, token=A) as a:
        assert a.clear("") >= 3000
    end = time.monotonic() + 20
    while True:
        st = admin_stats(bounded)
        if st["keys"] <= before["keys"] and \
                st["residency_namespaces"] <= before["residency_namespaces"]:
            break
        assert time.monotonic() < end, f"{st['residency_namespaces']} namespaces kept, " \
            f"{before['residency_namespaces']} before"
        time.sleep(0.1)


def test_one_tenant_takes_a_bounded_share_of_the_namespace_labels(bounded):
    """Tenant A looks up keys in 2,000 namespaces: at most 32 of its namespaces have labels
    of their own (the rest sum as "(other)@teamA"), and tenant B's namespace still gets one."""
    sock = dealer(bounded, A)
    try:
        sock.send(P.encode(P.LocateRequest([f"lbl{i:04d}@teamA/{i:064x}/k" for i in range(2000)]), 1))
        assert sock.poll(30_000)
        assert isinstance(P.decode(sock.recv(), request=False).msg, P.LocateReply)
    finally:
        sock.close(0)
    with StoreClient(bounded.master, token=B, view="off") as b:
        assert not b.exists("mine@teamB/0/k")
    url = f"http://127.0.0.1:{bounded.metrics_port}/metrics"
    end = time.monotonic() + 20
    while True:
        text = urllib.request.urlopen(url, timeout=5).read().decode()
        labels = set(re.findall(r'hicache_mc_lookup_misses_total\{namespace="([^"]*)"\}', text))
        if "mine@teamB" in labels or time.monotonic() > end:
            break
        time.sleep(0.2)
    a_labels = {ns for ns in labels if ns.endswith("@teamA") and not ns.startswith("(other)")}
    assert "mine@teamB" in labels, sorted(labels)[:50]
    assert 0 < len(a_labels) <= 32 and "(other)@teamA" in labels


def test_a_tenant_holds_no_more_keys_in_the_master_than_its_limit(tmp_path):
    """tenant_keys = teamC=100: of 150 keys put at once, 100 are placed and stored and 50
    answer False (each key costs the master ~160 B); once 40 are cleared, 40 more fit."""
    c = Cluster(tmp_path, heartbeat_s=0.25, liveness=8, token=TOKEN)
    c.env["HICACHE_MC_MASTER_TENANT_KEYS"] = "teamC=100"
    c.start_master(("--metrics-port", str(free_port())))
    c.add_node(dram="64MiB")
    C = issue(TOKEN, "client", "teamC").text()
    buf = np.zeros(64, np.uint8)
    try:
        c.wait_nodes(1)
        with StoreClient(c.master, token=C) as cl:
            keys = [f"lim@teamC/{i:064x}/k" for i in range(150)]
            ok = cl.batch_put_from(keys, [buf.ctypes.data] * 150, [64] * 150)
            assert sum(ok) == 100 and ok[:100] == [True] * 100
            st = admin_stats(c)
            assert st["tenants"]["teamC"]["keys"] == 100 and st["tenants"]["teamC"]["key_limit"] == 100
            assert st["key_limited"] == 50
            for k in keys[:40]:
                assert cl.clear(k) == 1
            c.wait_keys(60)
            assert sum(cl.batch_put_from(keys[100:], [buf.ctypes.data] * 50, [64] * 50)) == 40
    finally:
        c.stop()
