"""Tenant quotas: a tenant over quota evicts its own LRU objects, never another tenant's."""
import json
import subprocess
import sys
import time

import numpy as np

from hicache_mc import protocol as P
from hicache_mc.client import StoreClient
from hicache_mc.keys import KVNamespace, batch_page_keys, tenant_of
from hicache_mc.node.store import charge
from procs import request

MiB = 1 << 20


def ns(tenant: str) -> str:
    return KVNamespace("m", "torch.bfloat16", "page_first", 64, tenant=tenant).digest()


def blob(i: int) -> bytes:
    return np.full(MiB, i % 251, dtype=np.uint8).tobytes()


def cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hicache_mc.cli", *args], capture_output=True,
                          text=True, timeout=30)


def wait_for_quota(c: StoreClient, tenant: str, quota: int, heartbeat_s: float) -> None:
    """Return once the node refuses a put larger than ``tenant``'s ``quota``: it has learnt its
    share from a heartbeat reply. Until then the probe is stored, and cleared again."""
    probe = batch_page_keys(ns(tenant), ["probe"], ("k",))[0]
    end = time.monotonic() + 30
    while c.put(probe, b"x" * (quota + MiB)):
        assert time.monotonic() < end, "the node never applied the quota"
        c.clear(probe)
        time.sleep(heartbeat_s)


def test_tenant_of_key():
    assert tenant_of(ns("teamA") + "/abc/k") == "teamA"
    assert tenant_of(ns("") + "/abc/k") == ""
    assert ns("teamA") != ns("teamB") != ns("")


def test_over_quota_tenant_evicts_its_own_objects_only(cluster):
    cluster.env["HICACHE_MC_TENANT_QUOTAS"] = "greedy=6MiB"
    cluster.start_master()
    cluster.add_node(dram="64MiB")
    cluster.wait_nodes(1)
    polite = batch_page_keys(ns("polite"), [f"p{i}" for i in range(8)], ("k",))
    greedy = batch_page_keys(ns("greedy"), [f"g{i}" for i in range(20)], ("k",))
    with StoreClient(cluster.master) as c:
        wait_for_quota(c, "greedy", 6 * MiB, cluster.heartbeat_s)
        for i, k in enumerate(polite):
            assert c.put(k, blob(i))
        for i, k in enumerate(greedy):
            assert c.put(k, blob(100 + i))           # each fits by evicting greedy's oldest
        for i, k in enumerate(polite):               # nobody else was pushed out
            assert c.get(k) == blob(i)
        held = [k for k in greedy if c.exists(k)]
        assert 0 < len(held) <= 6
        assert held == greedy[-len(held):]           # the newest stayed, the LRU went
        for k in held:
            assert c.get(k) == blob(100 + greedy.index(k))
        end = time.monotonic() + 10
        while time.monotonic() < end:
            tenants = cluster.stats()["tenants"]
            if tenants.get("greedy", {}).get("used") == len(held) * charge(MiB):
                break
            time.sleep(0.1)
        assert tenants["greedy"] == {"used": len(held) * charge(MiB), "quota": 6 * MiB,
                                     "keys": len(held), "key_limit": None}
        assert tenants["polite"]["used"] == 8 * charge(MiB) and tenants["polite"]["quota"] is None


def test_quota_set_at_runtime_and_shown_in_stats(cluster):
    cluster.start_master()
    cluster.add_node(dram="64MiB")
    cluster.wait_nodes(1)
    r = cli("quota", "--master", cluster.master, "teamq", "3MiB")
    assert r.returncode == 0, r.stderr
    keys = batch_page_keys(ns("teamq"), [f"q{i}" for i in range(5)], ("k",))
    with StoreClient(cluster.master) as c:
        wait_for_quota(c, "teamq", 3 * MiB, cluster.heartbeat_s)
        for i, k in enumerate(keys):
            assert c.put(k, blob(i))
        assert sum(c.exists(k) for k in keys) == 2        # 3 x charge(1 MiB) > 3 MiB
        assert not c.put(batch_page_keys(ns("teamq"), ["huge"], ("k",))[0], b"x" * (3 * MiB))
    r = cli("stats", "--master", cluster.master)
    assert r.returncode == 0 and "teamq" in r.stdout and "tenant" in r.stdout
    r = cli("stats", "--master", cluster.master, "--json")
    assert json.loads(r.stdout)["tenants"]["teamq"]["quota"] == 3 * MiB
    assert cli("quota", "--master", cluster.master, "bad/name", "1MiB").returncode == 1
    assert cli("quota", "--master", cluster.master, "teamq", "none").returncode == 0


def test_clear_namespace_removes_only_that_namespace(store):
    a, b = ns("a"), ns("b")
    with StoreClient(store.master) as c:
        for k in batch_page_keys(a, ["1", "2"], ("k", "v")) + batch_page_keys(b, ["1"], ("k", "v")):
            assert c.put(k, b"page")
    r = cli("clear", "--master", store.master, "--namespace", a + "/")
    assert r.returncode == 0 and "removed 4" in r.stdout
    with StoreClient(store.master) as c:
        assert c.batch_exists(batch_page_keys(a, ["1", "2"], ("k", "v"))) == 0
        assert c.batch_exists(batch_page_keys(b, ["1"], ("k", "v"))) == 2


def test_a_quota_holds_under_one_large_batch(cluster):
    """Reservations count against the quota: one 32 x 256 KiB batch under a 1 MiB quota stores
    what the quota holds (3 objects, at what each costs), and the next batch replaces the
    tenant's own objects."""
    cluster.start_master()
    cluster.add_node(dram="64MiB")
    cluster.wait_nodes(1)
    reply = request(cluster.master, P.QuotaRequest("batchy", MiB))
    assert isinstance(reply, P.OkReply), reply
    size = 256 << 10
    buf = np.arange(32 * size, dtype=np.uint32).view(np.uint8)[: 32 * size].copy()
    ptrs, sizes = [buf.ctypes.data + i * size for i in range(32)], [size] * 32
    polite = batch_page_keys(ns("polite"), [f"p{i}" for i in range(4)], ("k",))
    with StoreClient(cluster.master) as c:
        wait_for_quota(c, "batchy", MiB, cluster.heartbeat_s)
        assert c.batch_put_from(polite, ptrs[:4], sizes[:4]) == [True] * 4
        for batch in range(2):
            keys = batch_page_keys(ns("batchy"), [f"b{batch}-{i}" for i in range(32)], ("k",))
            ok = c.batch_put_from(keys, ptrs, sizes)
            held = c.batch_contains(keys)
            assert 0 < sum(held) * charge(size) <= MiB, (batch, sum(held))
            assert sum(ok) == sum(held)
            end = time.monotonic() + 10
            while cluster.stats()["tenants"]["batchy"]["used"] != sum(held) * charge(size):
                assert time.monotonic() < end, cluster.stats()["tenants"]
                time.sleep(0.1)
        assert c.batch_contains(polite) == [True] * 4         # never another tenant's


def test_quotas_beyond_what_a_heartbeat_reply_carries_are_refused(cluster):
    """A node learns its quota shares in its heartbeat replies, which carry at most MAX_TENANTS
    of them: a quota past that is refused, and the node keeps its registration and quotas."""
    cluster.start_master()
    cluster.add_node(dram="64MiB")
    cluster.wait_nodes(1)
    for i in range(P.MAX_TENANTS):
        assert isinstance(request(cluster.master, P.QuotaRequest(f"t{i}", MiB)), P.OkReply), i
    reply = request(cluster.master, P.QuotaRequest("one-more", MiB))
    assert isinstance(reply, P.ErrorReply) and reply.code == "too_many_quotas", reply
    assert isinstance(request(cluster.master, P.QuotaRequest("t0", 2 * MiB)), P.OkReply)  # a change
    time.sleep(4 * cluster.heartbeat_s)
    stats = cluster.stats()
    assert len(stats["nodes"]) == 1 and stats["nodes_expired"] == 0
    with StoreClient(cluster.master) as c:
        assert c.put(batch_page_keys(ns("t1"), ["a"], ("k",))[0], b"x" * (2 * MiB)) is False


def test_a_flood_of_empty_objects_is_charged_and_evicts_no_other_tenant(cluster):
    """A 1 MiB-quota tenant puts 20 x 4096 empty objects into a 64 MiB node holding another
    tenant's 40 x 1 MiB: each is charged what it costs (a slot and its records), so the tenant
    holds at most 1 MiB / charge(0) of them, its usage says so, and the other tenant keeps
    all of its objects."""
    cluster.start_master()
    cluster.add_node(dram="64MiB")
    cluster.wait_nodes(1)
    assert isinstance(request(cluster.master, P.QuotaRequest("tiny", MiB)), P.OkReply)
    polite = batch_page_keys(ns("polite"), [f"p{i}" for i in range(40)], ("k",))
    empty = np.zeros(1, np.uint8)
    with StoreClient(cluster.master, timeout_s=30.0) as c:     # 4,096-key batches, a loaded host
        for i, k in enumerate(polite):
            assert c.put(k, blob(i))
        wait_for_quota(c, "tiny", MiB, cluster.heartbeat_s)
        for batch in range(20):
            keys = batch_page_keys(ns("tiny"), [f"e{batch}-{i}" for i in range(4096)], ("k",))
            ok = c.batch_put_from(keys, [empty.ctypes.data] * len(keys), [0] * len(keys))
            assert sum(ok) > 0
        end = time.monotonic() + 30     # the master's index and the node's heartbeat agree
        while (st := cluster.stats())["keys"] != st["nodes"][0]["objects"]:
            assert time.monotonic() < end, (st["keys"], st["nodes"][0]["objects"])
            time.sleep(0.1)
        assert st["keys"] <= 40 + MiB // charge(0)
        assert 0 < st["tenants"]["tiny"]["used"] <= MiB
        assert st["tenants"]["tiny"]["used"] == (st["keys"] - 40) * charge(0)
        assert c.batch_exists(polite) == 40
        for i, k in enumerate(polite):
            assert c.get(k) == blob(i)
