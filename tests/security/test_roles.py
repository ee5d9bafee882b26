"""Roles and tenants, tried as an attacker holding an ordinary client's credential would, against
the guarded cluster (a master and a node as processes, with a token): a client cannot act as a
node or an administrator, a tenant cannot reach another tenant's objects whatever key text it
writes, and the stream port moves only the ranges the node granted to that peer."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import numpy as np
import pytest
import zmq

from hicache_mc import protocol as P
from hicache_mc.auth import issue, secure_client
from hicache_mc.client import StoreClient
from hicache_mc.errors import ProtocolError, StoreUnavailable
from hicache_mc.rpc import Channel
from hicache_mc.transport.stream_client import StreamClient
from peers import TOKEN
from procs import request

A = issue(TOKEN, "client", "teamA").text()
B = issue(TOKEN, "client", "teamB").text()
MiB = 1 << 20


def node_info(cluster) -> P.NodeInfo:
    reply = request(cluster.master, P.StatsRequest(), token=TOKEN)
    return P.NodeInfo.from_dict({k: v for k, v in reply.stats["nodes"][0].items()
                                 if k in P.NodeInfo.__dataclass_fields__})


def refused(reply) -> bool:
    return isinstance(reply, P.ErrorReply) and reply.code == "forbidden"


def test_a_client_cannot_act_as_a_node_or_an_administrator(guarded):
    cluster, _ = guarded
    real = node_info(cluster)
    with StoreClient(cluster.master, token=B) as b:
        assert b.put("ns@teamB/kept", b"b" * 1000)
    rogue = P.NodeInfo("rogue", "tcp://127.0.0.1:1", "h", "/dev/null", 1 << 30)
    for msg in (P.RegisterRequest(rogue.to_dict()),
                P.RegisterRequest(real.to_dict()),         # would wipe the real node's keys
                P.HeartbeatRequest(real.node_id, {"used": "not a number"}),
                P.CommittedRequest(real.node_id, ["ns@teamA/x"], [1], [0], 0),
                P.EvictedRequest(real.node_id, ["ns@teamB/kept"]),
                P.QuotaRequest("teamB", 1)):
        assert refused(request(cluster.master, msg, token=A)), msg
    assert refused(request(real.address, P.NodeStatsRequest(), token=A))
    stats = request(cluster.master, P.StatsRequest(), token=TOKEN).stats
    assert [n["node_id"] for n in stats["nodes"]] == [real.node_id]
    assert "teamB" not in {t for t, row in stats["tenants"].items() if row["quota"] is not None}
    with StoreClient(cluster.master, token=B) as b:
        assert b.get("ns@teamB/kept") == b"b" * 1000


def test_a_tenant_cannot_reach_another_tenants_objects(guarded):
    cluster, _ = guarded
    with StoreClient(cluster.master, token=B) as b, StoreClient(cluster.master, token=A) as a:
        assert b.put("ns@teamB/secret", b"s" * 4096)
        assert a.put("ns@teamA/own", b"a" * 4096)
        # whatever key text A writes, B's objects are out of reach
        assert not a.exists("ns@teamB/secret") and a.get("ns@teamB/secret") is None
        assert not a.put("ns@teamB/secret2", b"x")
        assert not a.put("plain/key", b"x")             # the default tenant is not A's either
        assert a.clear("") == 1                         # its own object only
        assert b.get("ns@teamB/secret") == b"s" * 4096
        # and raw requests naming B's keys are refused, at the master and at the node
        node = node_info(cluster)
        for address, msg in ((cluster.master, P.LocateRequest(["ns@teamB/secret"])),
                             (cluster.master, P.PlaceRequest(["ns@teamB/x"], [1], "h")),
                             (node.address, P.LeaseRequest(["ns@teamB/secret"])),
                             (node.address, P.ReserveRequest(["ns@teamB/secret"], [4096]))):
            assert refused(request(address, msg, token=A)), msg
        stats = a.stats()["cluster"]
        assert set(stats["tenants"]) <= {"teamA"} and all("tenants" not in n for n in stats["nodes"])


def test_the_stream_port_moves_only_granted_ranges(guarded):
    cluster, _ = guarded
    src = np.random.default_rng(7).integers(0, 256, MiB, dtype=np.uint8)
    with StoreClient(cluster.master, token=B, transport="tcp") as b:
        assert b.put("ns@teamB/big", src)
    node = node_info(cluster)
    ctx = zmq.Context()
    admin = Channel(ctx, node.address, TOKEN)
    try:   # where it lies, as a lease tells its holder
        lease = admin.call(P.LeaseRequest(["ns@teamB/big"]), 2.0)
        offset = lease.offsets[0]
        assert offset >= 0
        admin.call(P.ReleaseRequest(["ns@teamB/big"], [offset]), 2.0)
    finally:
        admin.close()
        ctx.term()
    seg, dst = P.segment_of(node), np.zeros(MiB, np.uint8)
    junk = np.full(16, 0xEE, np.uint8)
    for cred in (A, B, TOKEN):      # no lease, no reservation: refused, whoever asks
        streams = StreamClient(cred)
        try:
            with pytest.raises((ProtocolError, StoreUnavailable), match="leased|refused"):
                streams.read(node.data_address, seg, [offset], [dst.ctypes.data], [MiB],
                             time.monotonic() + 5, True)
            with pytest.raises((ProtocolError, StoreUnavailable), match="reserved|refused"):
                streams.write(node.data_address, seg, [offset], [junk.ctypes.data], [16],
                              time.monotonic() + 5)
        finally:
            streams.close()
    assert not dst.any()
    with StoreClient(cluster.master, token=B, transport="tcp") as b:
        got = np.zeros(MiB, np.uint8)
        assert b.batch_get_into(["ns@teamB/big"], [got.ctypes.data], [MiB]) == [True]
        assert np.array_equal(got, src)


def test_a_claim_that_its_key_does_not_prove_is_refused(guarded):
    cluster, _ = guarded
    ctx = zmq.Context()
    sock = secure_client(ctx.socket(zmq.DEALER), issue(TOKEN, "client", "teamA"))
    sock.setsockopt(zmq.ROUTING_ID, b"admin::forged")       # teamA's key, an admin's claim
    sock.connect(cluster.master)
    try:
        sock.send(P.encode(P.QuotaRequest("teamB", 1), 1))
        assert sock.poll(3000)
        reply = P.decode(sock.recv(), request=False).msg
        assert isinstance(reply, P.ErrorReply) and reply.code == "unauthenticated", reply
    finally:
        sock.close()
        ctx.term()
    stats = request(cluster.master, P.StatsRequest(), token=TOKEN).stats
    assert stats["tenants"].get("teamB", {}).get("quota") is None


def test_the_credential_command_reads_the_token_from_a_file(tmp_path):
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    env = {k: v for k, v in os.environ.items() if k != "HICACHE_MC_TOKEN"}
    out = subprocess.run([sys.executable, "-m", "hicache_mc.cli", "credential", "--tenant", "teamA",
                          "--token-file", str(path)], capture_output=True, text=True, env=env,
                         check=True).stdout.strip()
    assert out == A and TOKEN not in out
