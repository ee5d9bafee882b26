"""Deletion is durable: no clear, quota eviction or replacement leaves an SSD record that a
restart brings back. Real node processes with an SSD tier, killed with SIGKILL right after
each step a client or the master can see (the step's reply, the master's index dropping the
keys) and started again on the same folder; plus, in-process, a tombstone that compaction
must carry forward while an older segment still holds the record it buries."""
from __future__ import annotations

import time

import pytest

from hicache_mc import protocol as P
from hicache_mc.client import StoreClient
from hicache_mc.node.dram import DramTier
from hicache_mc.node.ssd import SsdTier
from hicache_mc.node.store import TieredStore, charge
from procs import free_port, request
from test_ssd_tier import blob, ssd_node, wait_for

MiB = 1 << 20
# one SSD segment holds every record: a removed record's segment stays (a segment whose
# records are all dead is deleted whole), so only its tombstone keeps it from coming back
SEGMENT = "64MiB"


def restart(cluster, node, ssd_dir, port):
    """SIGKILL the node and start it again on the same folder and port."""
    node.kill()
    since = len(node.log())                 # the new process appends to the same log
    cluster.nodes.remove(node)
    cluster.wait_nodes(0)                   # the master forgot the old node and its keys
    node = ssd_node(cluster, ssd_dir, dram="16MiB", durability="sync", port=port, segment=SEGMENT)
    node.log_from = since
    cluster.wait_nodes(1)
    return node


def recovered(node) -> int:
    """How many objects a node ``restart`` started read back from its SSD tier."""
    lines = [ln for ln in node.log()[node.log_from:].splitlines() if "recovered" in ln]
    return int(lines[-1].split("recovered ")[1].split()[0]) if lines else 0


def held(c: StoreClient, keys: list[str]) -> set[str]:
    return {k for k, ok in zip(keys, c.batch_contains(keys)) if ok}


@pytest.mark.parametrize("kill_at", ["reply", "master"])
def test_a_quota_eviction_stays_evicted(cluster, tmp_path, kill_at):
    """Tenant "cut" holds 12 objects on SSD; its quota is cut to 6 MiB; its next put evicts its
    oldest. Killed after that put's reply, or once the master dropped the evicted keys, the
    node comes back with the tenant within its quota and the evicted keys gone."""
    cluster.start_master()
    port, ssd_dir = free_port(), tmp_path / "ssd"
    node = ssd_node(cluster, ssd_dir, dram="16MiB", durability="sync", port=port, segment=SEGMENT)
    cluster.wait_nodes(1)
    keys = [f"ns@cut/{i:02d}/k" for i in range(12)]
    new = "ns@cut/new/k"
    with StoreClient(cluster.master) as c:
        for k in keys:
            assert c.put(k, blob(k))
        assert isinstance(request(cluster.master, P.QuotaRequest("cut", 6 * MiB)), P.OkReply)
        big = "ns@cut/probe/k"                  # over the quota by itself: refused, evicts nothing
        end = time.monotonic() + 20
        while c.put(big, blob(big, 7 * MiB)):  # stored: the node has not learnt the quota yet
            assert time.monotonic() < end, "the node never applied the quota"
            assert c.clear(big) == 1
            time.sleep(cluster.heartbeat_s)
        assert c.put(new, blob(new))            # evicts the tenant's oldest objects
        if kill_at == "master":
            wait_for(lambda: len(held(c, keys)) * charge(MiB) <= 6 * MiB - charge(MiB),
                     what="the master drops the evicted keys")
    node = restart(cluster, node, ssd_dir, port)
    with StoreClient(cluster.master) as c:
        wait_for(lambda: c.exists(new), what="re-registration")
        kept = held(c, keys)
        assert (len(kept) + 1) * charge(MiB) <= 6 * MiB, sorted(kept)
        # what the disk gave back: no record the quota evicted (not one the node, learning the
        # quota again, evicts a second time)
        assert recovered(node) == len(kept) + 1
        assert kept == set(keys[len(keys) - len(kept):])     # the newest stayed
        for k in kept | {new}:
            assert c.get(k) == blob(k)
        stats = cluster.stats()
        assert stats["tenants"]["cut"]["used"] <= 6 * MiB


def test_a_clear_and_a_replacement_stay_as_acknowledged(cluster, tmp_path):
    """Killed after each step: the puts acknowledged are there, the cleared keys are not, and a
    key cleared and put again has its new value."""
    cluster.start_master()
    port, ssd_dir = free_port(), tmp_path / "ssd"
    node = ssd_node(cluster, ssd_dir, dram="16MiB", durability="sync", port=port, segment=SEGMENT)
    cluster.wait_nodes(1)
    keys = [f"clr/{i}" for i in range(6)]
    with StoreClient(cluster.master) as c:
        for k in keys:
            assert c.put(k, blob(k))
    node = restart(cluster, node, ssd_dir, port)            # step: put
    with StoreClient(cluster.master) as c:
        wait_for(lambda: c.batch_exists(keys) == len(keys), what="re-registration")
        assert c.clear("clr/") == len(keys)
    node = restart(cluster, node, ssd_dir, port)            # step: clear
    with StoreClient(cluster.master) as c:
        wait_for(lambda: len(cluster.stats()["nodes"]) == 1 and cluster.stats()["keys"] == 0,
                 what="registration")
        assert not held(c, keys) and recovered(node) == 0
        assert c.put(keys[0], blob("v2"))                   # the same key, new bytes
    node = restart(cluster, node, ssd_dir, port)            # step: the replacement's put
    with StoreClient(cluster.master) as c:
        wait_for(lambda: c.exists(keys[0]), what="re-registration")
        assert held(c, keys) == {keys[0]} and c.get(keys[0]) == blob("v2")
        assert recovered(node) == 1


def test_compaction_carries_a_tombstone_while_an_older_segment_holds_its_record(tmp_path):
    """v1 of "k" lies in a segment that stays (mostly live); its tombstone lies in one that
    compaction empties and deletes. The tombstone must move on, or a restart brings v1 back;
    tombstones of records no older segment holds are not carried."""
    dram = DramTier(str(tmp_path / "seg"), 8 * MiB, "abcd0001", 0.5, 0.9, 0.5)
    ssd_dir = str(tmp_path / "ssd")
    st = TieredStore(dram, SsdTier(ssd_dir, 64 * MiB, 64 << 10, 0.95, 0.85), "sync", 1.0)
    try:
        def put(key, fill):
            r = st.reserve_many([key], [10_000], 0.0, 5.0, MiB)[0]
            dram.view(dram.reservation(key))[:] = bytes([fill]) * 10_000
            assert st.commit_many([key], [0])[0] is not None
            st.write_through([key], waiter=key)
            end = time.monotonic() + 10
            while not st.poll_done(0.0).writes:
                assert time.monotonic() < end
                time.sleep(0.001)
            return r

        def settle():
            end = time.monotonic() + 10
            while not st.ssd.idle():
                assert time.monotonic() < end
                time.sleep(0.001)
                st.poll_done(0.0)

        for i, key in enumerate(["k", "a1", "a2", "a3", "a4", "a5"]):   # segment 1, full
            put(key, i)
        for i in range(5):                                              # segment 2
            put(f"b{i}", 10 + i)
        st.clear("k", 0.0)
        st.clear("b", 0.0)
        st.bury()
        settle()
        for i in range(6):                                              # segment 3 and on
            put(f"c{i}", 20 + i)
        for _ in range(5):
            st.maintain(time.monotonic())    # compacts segment 2: nothing live, tombstones
            settle()
        segs = st.ssd.segments()
        assert 2 not in segs and 1 in segs
    finally:
        st.close()
    again = TieredStore(DramTier(str(tmp_path / "seg2"), 8 * MiB, "abcd0002", 0.5, 0.9, 0.5),
                        SsdTier(ssd_dir, 64 * MiB, 64 << 10, 0.95, 0.85), "sync", 1.0)
    try:
        assert not again.contains("k")
        assert all(again.contains(f"a{i}") for i in range(1, 6))
        assert not any(again.contains(f"b{i}") for i in range(5))
    finally:
        again.close()


def test_an_evicted_ssd_record_is_reported_only_once_its_tombstone_is_written(tmp_path):
    """The master hears that a key left the node only when a restart can no longer bring it
    back: after the tombstone burying its SSD record is written."""
    dram = DramTier(str(tmp_path / "seg"), 8 * MiB, "abcd0003", 0.5, 0.9, 0.5)
    st = TieredStore(dram, SsdTier(str(tmp_path / "ssd"), 64 * MiB, MiB, 0.95, 0.85), "sync", 1.0)
    try:
        for key in ("ns@q/a", "ns@q/b"):
            st.reserve_many([key], [1000], 0.0, 5.0, MiB)
            assert st.commit_many([key], [0])[0] is not None
            st.write_through([key], waiter=key)
        end = time.monotonic() + 10
        while not (st.ssd.idle() and "ns@q/b" in st.ssd):
            assert time.monotonic() < end
            st.poll_done(0.0)
        st.set_quotas({"q": 2 * charge(1000) + 1})
        assert st.reserve_many(["ns@q/c"], [1000], 1.0, 5.0, MiB)[0].offset >= 0   # evicts a
        assert "ns@q/a" not in st.ssd and st.drain_dropped() == []    # not buried yet
        ticket = st.bury()
        buried = []
        while ticket not in buried:
            assert time.monotonic() < end
            buried += st.poll_done(0.0).buried
        assert st.drain_dropped() == ["ns@q/a"]
    finally:
        st.close()
