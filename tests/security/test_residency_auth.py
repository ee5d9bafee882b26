"""Residency with a token: the publisher passes a subscription (to a namespace's updates or to
its keys) on only for the subscriber's own tenant (or the admin), and a snapshot of another
tenant's namespace is refused."""
import time

import zmq

from hicache_mc import protocol as P
from hicache_mc import residency as R
from hicache_mc.auth import issue, secure_client
from hicache_mc.client import StoreClient
from peers import TOKEN
from procs import request

NS_A = "0123456789abcdef@teamA"
NS_B = "0123456789abcdef@teamB"


def _sub(port: int, cred, namespaces) -> zmq.Socket:
    sock = secure_client(zmq.Context.instance().socket(zmq.SUB), cred, P.MAX_HEADER_BYTES)
    for ns in namespaces:                  # the view's topic and the event bridge's (keys)
        sock.setsockopt(zmq.SUBSCRIBE, R.topic(ns))
        sock.setsockopt(zmq.SUBSCRIBE, R.key_topic(ns))
    sock.connect(f"tcp://127.0.0.1:{port}")
    return sock


def _topics(sock: zmq.Socket, seconds: float) -> dict:
    got: dict = {}
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if sock.poll(50):
            topic, body = sock.recv_multipart()
            assert (R.decode_keys(body) if topic.endswith(b"#") else R.decode(body)) is not None
            got[topic] = got.get(topic, 0) + 1
    return got


def test_a_tenant_follows_only_its_own_namespaces(guarded):
    cluster, _ = guarded
    a = issue(TOKEN, "client", "teamA")
    snap = request(cluster.master, P.SnapshotRequest(NS_B), 2.0, TOKEN)    # as the admin
    assert isinstance(snap, P.SnapshotReply)
    refused = request(cluster.master, P.SnapshotRequest(NS_B), 2.0, a.text())
    assert isinstance(refused, P.ErrorReply) and refused.code == "forbidden"
    assert isinstance(request(cluster.master, P.SnapshotRequest(NS_A), 2.0, a.text()), P.SnapshotReply)
    before = cluster.stats()["residency_refused"]
    admin = _sub(snap.port, issue(TOKEN, "admin"), [NS_A, NS_B])    # both get beats from now on
    tenant = _sub(snap.port, a, [NS_A, NS_B])
    try:
        seen_admin, seen_tenant = _topics(admin, 2.0), _topics(tenant, 0.5)
    finally:
        admin.close(0)
        tenant.close(0)
    assert set(seen_admin) == {R.topic(NS_A), R.topic(NS_B), R.key_topic(NS_A), R.key_topic(NS_B)}
    assert set(seen_tenant) == {R.topic(NS_A), R.key_topic(NS_A)}
    assert cluster.stats()["residency_refused"] >= before + 1


def test_a_tenant_client_keeps_a_view_of_its_namespace_over_curve(guarded):
    cluster, _ = guarded
    a = issue(TOKEN, "client", "teamA").text()
    with StoreClient(cluster.master, token=a) as w, StoreClient(cluster.master, token=a, view="on") as r:
        assert w.put(f"{NS_A}/v/k", b"x")
        r.follow(NS_A)
        end = time.monotonic() + 10
        while not (r.view.spaces.get(NS_A) and r.view.spaces[NS_A].synced):
            assert time.monotonic() < end, "view of teamA's namespace never in sync"
            time.sleep(0.02)
        answers = r.view.counters["view_answers"]
        assert r.batch_exists([f"{NS_A}/v/k", f"{NS_A}/w/k"]) == 1
        assert r.view.counters["view_answers"] == answers + 1


def test_a_key_never_proved_on_the_masters_port_follows_nothing(guarded):
    """The publisher authorizes by a lookup of keys that proved a principal on the master's
    ROUTER: a subscriber that never asked there derives nothing and gets nothing; once it has
    (a view asks for its snapshot first), the same subscription is passed on."""
    cluster, _ = guarded
    ns_c = "0123456789abcdef@teamC"
    c = issue(TOKEN, "client", "teamC")
    port = request(cluster.master, P.SnapshotRequest(NS_A), 2.0, TOKEN).port    # as the admin
    before = cluster.stats()["residency_refused"]
    sub = _sub(port, c, [ns_c])
    try:
        assert _topics(sub, 1.5) == {}
        assert cluster.stats()["residency_refused"] >= before + 2
        assert isinstance(request(cluster.master, P.SnapshotRequest(ns_c), 2.0, c.text()),
                          P.SnapshotReply)
        sub.setsockopt(zmq.SUBSCRIBE, R.topic(ns_c))        # as a view does after its snapshot
        assert R.topic(ns_c) in _topics(sub, 2.0)
    finally:
        sub.close(0)


def test_a_snapshot_of_a_namespace_no_topic_can_name_is_refused(guarded):
    cluster, _ = guarded
    reply = request(cluster.master, P.SnapshotRequest("x" * 200 + "@teamA"), 2.0, TOKEN)
    assert isinstance(reply, P.ErrorReply) and reply.code == "bad_request"
