"""TieredStore policy in-process: back-pressure when DRAM is full of objects not yet on disk,
staging SSD-only objects back into DRAM, duplicate writers, tenant quotas."""
import time

import numpy as np
import pytest

from hicache_mc.node.dram import DramTier
from hicache_mc.node.ssd import SsdTier
from hicache_mc.node.store import Leased, Reserved, TieredStore, charge
from hicache_mc.transport.base import checksum

MiB = 1 << 20


@pytest.fixture
def store(tmp_path):
    dram = DramTier(str(tmp_path / "seg"), 8 * MiB, "abcd1234", lease_s=0.5,
                    high_watermark=0.9, low_watermark=0.5)
    ssd = SsdTier(str(tmp_path / "ssd"), 256 * MiB, 8 * MiB, 0.95, 0.85)
    st = TieredStore(dram, ssd, "async", 1.0)
    yield st
    st.close()


def put(st, key, data, now, persist=True):
    """Reserve, copy and commit, as a writer does."""
    r = st.reserve_many([key], [len(data)], now, 5.0, 16 * MiB)[0]
    assert r.outcome is Reserved.SLOT, (key, r)
    st.dram.view(st.dram.reservation(key))[:] = data
    assert st.commit_many([key], [checksum(data)])[0] is not None
    if persist:
        st.write_through([key])


def offs(reservations):
    """Each reservation's offset, or its outcome when it got no slot."""
    return [r.offset if r.outcome is Reserved.SLOT else r.outcome for r in reservations]


def one(st, key, size, now, hold_s=5.0):
    return offs([st.reserve(key, size, now, hold_s)])[0]


def read(st, key, now):
    """The object's bytes through a lease (released after the copy), or None."""
    lease = st.lease_many([key], now)[0]
    if lease.outcome is not Leased.OBJECT:
        return None
    data = bytes(st.dram.mm[lease.offset: lease.offset + lease.size])
    st.release(key, lease.offset)
    return data


def wait_on_ssd(st, keys, timeout_s=30.0):
    end = time.monotonic() + timeout_s
    while not all(k in st.ssd for k in keys):
        assert time.monotonic() < end, "objects never reached the SSD"
        time.sleep(0.01)
        st.poll_done(time.monotonic())


def test_writes_beyond_dram_wait_for_the_disk_instead_of_failing(store):
    # no maintain()/poll_done() between writes: only back-pressure can make room
    blobs = {f"k{i}": np.full(MiB, i, dtype=np.uint8).tobytes() for i in range(40)}
    for i, (k, b) in enumerate(blobs.items()):
        put(store, k, b, now=float(i))
    wait_on_ssd(store, blobs)
    assert store.drain_dropped() == []              # nothing acknowledged was dropped
    for k, b in blobs.items():                      # SSD-only ones are staged back into DRAM
        assert read(store, k, 100.0) == b, k
    assert store.stats()["ssd_promotions"] >= 40 - 8
    assert store.drain_dropped() == []
    assert store.stats()["tenants"] == {"": 40 * charge(MiB)}


def test_an_ssd_only_object_without_dram_room_to_stage_is_a_miss(store):
    cold = b"c" * MiB
    put(store, "cold", cold, now=0.0)
    wait_on_ssd(store, ["cold"])
    # 8 MiB of objects not on disk (never persisted): "cold", on disk, is evicted for them
    for i in range(8):
        put(store, f"hot{i}", bytes([i]) * MiB, now=1.0, persist=False)
    assert "cold" not in store.dram and "cold" in store.ssd
    assert store.lease_many(["cold"], 2.0)[0].outcome is Leased.LATER   # nothing in DRAM may go
    assert "cold" in store.ssd and store.drain_dropped() == []   # a miss, not a loss
    assert not store.dram.is_reserved("cold")       # the staging slot was not left behind
    store.remove(["hot0"], 3.0)
    assert read(store, "cold", 3.0) == cold         # room again: staged
    assert store.dram.get("cold").on_ssd


def test_a_second_writer_is_acknowledged_only_once_the_first_holds(tmp_path):
    dram = DramTier(str(tmp_path / "seg2"), 8 * MiB, "abcd5678", lease_s=0.5,
                    high_watermark=0.9, low_watermark=0.5)
    ssd = SsdTier(str(tmp_path / "ssd2"), 64 * MiB, 8 * MiB, 0.95, 0.85)
    st = TieredStore(dram, ssd, "sync", 1.0)
    try:
        data = b"z" * 1000
        assert one(st, "k", 1000, 0.0) >= 0                   # writer 1 is copying
        assert one(st, "k", 1000, 0.0) is Reserved.BUSY       # writer 2: not acknowledged
        dram.view(dram.reservation("k"))[:] = data
        assert st.commit_many(["k"], [checksum(data)])[0] is not None
        assert one(st, "k", 1000, 0.0) is Reserved.BUSY       # sync: in DRAM, not yet on disk
        st.write_through(["k"], waiter="w")
        done = []
        while not done:
            done = st.poll_done(1.0).writes
        assert done == [("w", [True])]
        assert one(st, "k", 1000, 0.0) is Reserved.STORED     # on disk: a duplicate is acknowledged
    finally:
        st.close()


def test_reserve_many_agrees_with_reserve_key_by_key(tmp_path):
    """Stored, being stored, repeated within the batch, out of range, under a quota: each gets
    what ``reserve`` would give it; the fresh rest share one range."""
    dram = DramTier(str(tmp_path / "seg3"), 8 * MiB, "abcd9999", lease_s=0.5,
                    high_watermark=0.9, low_watermark=0.5)
    st = TieredStore(dram, None, "none", 1.0)
    try:
        put(st, "stored", b"s" * 100, 0.0)
        assert one(st, "busy", 100, 0.0) >= 0
        st.set_quotas({"t": charge(100) * 3 // 2})
        assert one(st, "ns@t/r", 100, 0.0) >= 0    # t's reservation in flight: half an object left
        keys = ["n/1", "stored", "busy", "n/2", "n/1", "huge", "neg", "ns@t/q", "ns@u/r"]
        sizes = [100, 100, 100, 200, 100, 10 * MiB, -1, 100, 100]
        got = offs(st.reserve_many(keys, sizes, 0.0, 5.0, MiB))
        assert got[1:3] == [Reserved.STORED, Reserved.BUSY]     # stored, being stored
        assert got[4] is Reserved.BUSY                          # repeated in the batch
        assert got[5] is got[6] is Reserved.FULL                # too large, negative
        assert got[3] == got[0] + 256 and got[8] == got[3] + 256   # fresh: one range
        assert got[7] is Reserved.FULL                          # over tenant t's quota
        got = st.commit_many(["n/1", "n/2", "nothing"], [7, 8, 9])
        assert [o.size if o else None for o in got] == [100, 200, None]
        assert st.tenants.held("") == 2 * charge(100) + charge(200) and st.meta("n/2") == (200, 8)
        # with offsets: a commit naming another slot than the key's reservation commits nothing
        # (a writer whose reservation lapsed while another writer reserved the key elsewhere)
        a, b = offs(st.reserve_many(["o/a", "o/b"], [100, 100], 0.0, 5.0, MiB))
        got = st.commit_many(["o/a", "o/b"], [1, 2], [a, a])
        assert got[0] == (100, 1) and got[1] is None
        assert st.dram.reservation("o/b").offset == b           # still the other writer's
        assert st.commit_many(["o/b"], [2], [b])[0] == (100, 2)
    finally:
        st.close()


@pytest.fixture
def quota_store(tmp_path):
    """A DRAM-only TieredStore whose tenant "t" has a quota on it (tests set its size)."""
    dram = DramTier(str(tmp_path / "seg"), 8 * MiB, "abcd4444", lease_s=0.5,
                    high_watermark=0.9, low_watermark=0.5)
    st = TieredStore(dram, None, "none", 1.0)
    st.set_quotas({"t": 1 << 20})
    yield st
    st.close()


def test_a_tenant_over_its_quota_makes_room_from_its_own_objects_or_is_refused(quota_store):
    st = quota_store
    dram = st.dram
    st.set_quotas({"t": charge(800) * 3 // 2})      # one object of 800 bytes, not two
    put(st, "ns@t/a", b"a" * 800, 0.0)
    put(st, "other/x", b"x" * 800, 0.0)
    # "b" evicts "a", its tenant's own older object; "c" is bigger than the whole quota
    b, c = offs(st.reserve_many(["ns@t/b", "ns@t/c"], [800, 2000], 1.0, 5.0, MiB))
    assert b >= 0 and c is Reserved.FULL
    assert "ns@t/a" not in dram and "other/x" in dram
    assert st.drain_dropped() == ["ns@t/a"] and st.tenants.held("t") == 0
    assert st.commit_many(["ns@t/b"], [1])[0] is not None and st.tenants.held("t") == charge(800)


def test_stats_name_at_most_max_tenants_tenants():
    from hicache_mc.node.tenants import top_tenants
    usage = {f"t{i}": i for i in range(1, 3001)}
    top = top_tenants(usage, most=1024)
    assert len(top) == 1024 and top["t3000"] == 3000 and "t1" not in top
    assert sum(top.values()) == sum(usage.values())
    assert top_tenants({"a": 5, "b": 0}) == {"a": 5}


def test_reservations_count_against_the_quota_until_committed_or_given_back(quota_store):
    st = quota_store
    dram = st.dram
    st.set_quotas({"t": 2 * charge(400) + 100})     # two objects of 400 bytes
    # one batch: each reservation counts at once, so no batch overruns the quota
    a, b, c = offs(st.reserve_many(["ns@t/a", "ns@t/b", "ns@t/c"], [400] * 3, 0.0, 5.0, MiB))
    assert a >= 0 and b >= 0 and c is Reserved.FULL
    assert st.tenants.reserved("t") == 2 * charge(400) and st.tenants.held("t") == 0
    st.release("ns@t/a", a)                  # given back unfilled: credited back
    assert st.tenants.reserved("t") == charge(400)
    st.maintain(6.0)                         # "b" lapsed: credited back
    assert st.tenants.reserved("t") == 0 and not dram.is_reserved("ns@t/b")
    c, d = offs(st.reserve_many(["ns@t/c", "ns@t/d"], [400, 400], 6.0, 5.0, MiB))
    assert c >= 0 and d >= 0
    assert st.commit_many(["ns@t/c"], [1])[0] is not None      # moved to usage
    assert st.tenants.held("t") == charge(400) and st.tenants.reserved("t") == charge(400)


def test_a_tenant_over_its_quota_evicts_no_more_than_it_needs(quota_store):
    st = quota_store
    dram = st.dram
    st.set_quotas({"t": 3 * charge(300) + 100})     # three objects of 300 bytes
    for k in "abc":
        put(st, f"ns@t/{k}", b"x" * 300, 0.0)
    # "d" evicts "a"; "e" then needs room for 300 more, which "b" alone makes
    d, e = offs(st.reserve_many(["ns@t/d", "ns@t/e"], [300, 300], 1.0, 5.0, MiB))
    assert d >= 0 and e >= 0
    assert sorted(dram.keys()) == ["ns@t/c"]
    assert st.drain_dropped() == ["ns@t/a", "ns@t/b"] and st.tenants.held("t") == charge(300)


def test_a_key_cleared_and_put_again_during_its_write_through_keeps_the_new_value(store):
    """async: the first object's write-through is still queued when the key is cleared and
    put again. Each finished write applies to the object it was started for: the new value is
    read back (from DRAM and, once dropped there, from SSD), and clearing everything frees
    every DRAM byte."""
    old, new = b"o" * MiB, b"n" * MiB
    put(store, "k", old, now=0.0)                   # its write-through is queued, not applied
    assert store.clear("", 0.0) == ["k"]
    put(store, "k", new, now=0.0)
    obj = store.dram.get("k")
    end = time.monotonic() + 10                     # both writes done and applied
    while obj.busy != 0 or not store.ssd.idle():
        assert time.monotonic() < end, f"busy {obj.busy}"
        time.sleep(0.01)
        store.poll_done(1.0)
    assert obj.on_ssd
    assert read(store, "k", 1.0) == new
    store.dram.drop("k", 1.0)                       # on SSD: DRAM may drop its copy
    assert read(store, "k", 2.0) == new             # staged back from SSD: the new record
    assert store.clear("", 3.0) == ["k"]
    store.poll_done(4.0)
    assert store.dram.used == 0 and store.dram.stats()["quarantined"] == 0


def test_a_sync_write_cleared_before_it_reaches_the_disk_is_not_acknowledged(tmp_path):
    """sync: the key is cleared while its write is on the way to disk. The write is not
    acknowledged (the node would report a key it no longer holds), and a writer of the key
    after the clear stores it."""
    dram = DramTier(str(tmp_path / "seg5"), 8 * MiB, "abcd5555", lease_s=0.5,
                    high_watermark=0.9, low_watermark=0.5)
    ssd = SsdTier(str(tmp_path / "ssd5"), 64 * MiB, 8 * MiB, 0.95, 0.85)
    st = TieredStore(dram, ssd, "sync", 1.0)
    try:
        put(st, "k", b"a" * 1000, 0.0, persist=False)
        st.write_through(["k"], waiter="w")
        assert st.clear("", 0.0) == ["k"]
        done = []
        while not done:
            done = st.poll_done(1.0).writes
        assert done == [("w", [False])]
        assert one(st, "k", 1000, 1.0) >= 0                   # gone: a new writer stores it
    finally:
        st.close()


def test_an_eviction_is_not_reported_for_a_key_stored_again_before_the_report(tmp_path):
    """The master hears of evictions when the node loop drains them; a key committed again
    in between is held, and its report must not remove it from the master's index."""
    dram = DramTier(str(tmp_path / "seg6"), 8 * MiB, "abcd6666", lease_s=0.5,
                    high_watermark=0.9, low_watermark=0.5)
    st = TieredStore(dram, None, "none", 1.0)
    try:
        put(st, "k", b"a" * 100, 0.0)
        put(st, "gone", b"g" * 100, 0.0)
        dram.drop("k", 0.0)                 # evicted (LRU): the master is to hear of it
        dram.drop("gone", 0.0)
        put(st, "k", b"b" * 100, 0.0)       # stored again before the report went
        assert st.drain_dropped() == ["gone"]
        assert st.tenants.held("") == charge(100)
    finally:
        st.close()


def test_an_object_a_reader_found_damaged_is_dropped_only_if_it_is(tmp_path):
    """A reader's checksum mismatch names the key and the offset it read: the store drops the
    object only if it is still the one at that offset and fails its checksum here too."""
    dram = DramTier(str(tmp_path / "seg7"), 8 * MiB, "abcd7777", lease_s=0.5,
                    high_watermark=0.9, low_watermark=0.5)
    st = TieredStore(dram, None, "none", 1.0)
    try:
        put(st, "k", b"a" * 1000, 0.0)
        off = dram.get("k").offset
        assert st.drop_damaged(["k"], [off], 0.0) == []         # intact: the reader's fault
        dram.mm[off] ^= 0xFF
        assert st.drop_damaged(["k"], [off + 256], 0.0) == []   # another object's offset
        assert st.drop_damaged(["k", "k"], [off, off], 0.0) == ["k"]
        assert "k" not in dram and st.tenants.held("") == 0
        put(st, "k", b"a" * 1000, 1.0)                          # a re-put stores it again
        assert read(st, "k", 1.0) == b"a" * 1000
    finally:
        st.close()


def test_recovery_leaves_out_records_whose_keys_no_message_may_carry(tmp_path):
    """A segment written before keys were limited may hold longer ones: indexed, they would
    go into an inventory message the master refuses (over the key limit), with the other
    keys of that message, at every registration."""
    from hicache_mc.node.ssd import Job
    from hicache_mc.protocol import MAX_KEY_BYTES
    ssd = SsdTier(str(tmp_path / "ssd8"), 64 * MiB, 8 * MiB, 0.95, 0.85)
    long_key, data = "k" * (MAX_KEY_BYTES + 1), b"v" * 100
    ssd.submit(Job("append", [(long_key, data, checksum(data)), ("ok", data, checksum(data))]))
    ssd.close()
    ssd = SsdTier(str(tmp_path / "ssd8"), 64 * MiB, 8 * MiB, 0.95, 0.85)
    try:
        assert list(ssd.keys()) == ["ok"]
    finally:
        ssd.close()


class Counted(str):
    """A key that counts how often the store looks at its text."""
    looks = 0

    def startswith(self, *args):
        Counted.looks += 1
        return super().startswith(*args)

    def partition(self, *args):
        Counted.looks += 1
        return super().partition(*args)

    def split(self, *args, **kw):
        Counted.looks += 1
        return super().split(*args, **kw)


def test_a_tenants_clear_walks_its_own_keys_only(quota_store):
    """A clear costs O(the clearing tenant's objects), not a scan of every key on the node:
    tenant u's clear never looks at tenant t's 2,000 keys."""
    st = quota_store
    st.set_quotas({})
    theirs = [Counted(f"ns@t/{i}") for i in range(2000)]
    for k in theirs:
        put(st, k, b"x", 0.0)
    put(st, "ns@u/a", b"a", 0.0)
    put(st, "ns@u/b", b"b", 0.0)
    Counted.looks = 0
    assert st.clear("", 1.0, tenant="u") == ["ns@u/a", "ns@u/b"]
    assert st.clear("ns@u/", 1.0) == []                 # an admin's clear of one namespace
    assert Counted.looks == 0
    assert st.clear("ns@t/1", 1.0, tenant="t")[:3] == ["ns@t/1", "ns@t/10", "ns@t/100"]


def test_the_smallest_objects_are_charged_what_they_cost(quota_store):
    """0-byte objects take a DRAM slot and the node's and the master's records: each counts
    charge(0) against its tenant's quota, so a quota bounds a tenant's object count too."""
    st = quota_store
    st.set_quotas({"t": 100 * charge(0)})
    put(st, "other/x", b"x" * 1000, 0.0)
    for lo in range(0, 1000, 100):
        keys = [f"ns@t/{i}" for i in range(lo, lo + 100)]
        got = st.reserve_many(keys, [0] * 100, 0.0, 5.0, MiB)
        assert all(r.outcome is Reserved.SLOT for r in got)     # each evicts t's oldest
        st.commit_many(keys, [0] * 100)
    assert st.tenants.held("t") == 100 * charge(0) and charge(0) > 256
    assert st.stats()["tenants"] == {"t": 100 * charge(0), "": charge(1000)}
    assert len(st.tenants.keys("t")) == 100 and "other/x" in st.dram


def test_the_dram_tier_counts_each_objects_memory_against_its_capacity(tmp_path):
    """With object_bytes, a tier of 1 MiB holds at most 1 MiB / (256 + object_bytes) empty
    objects: the node's memory for them stays within the tier's size."""
    t = DramTier(str(tmp_path / "meta"), 1 << 20, "abcd1234", lease_s=1.0, high_watermark=0.9,
                 low_watermark=0.5, object_bytes=768)
    try:
        n = 0
        while t.reserve(f"k{n}", 0, 0.0, 10.0) is not None:
            n += 1
            assert n <= 1024
        assert n == (1 << 20) // (256 + 768) and t.used == n * 1024
        for i in range(n):
            assert t.commit(f"k{i}", 0) is not None
        assert t.reserve("more", 0, 1.0, 10.0) is not None     # evicts the oldest
        assert "k0" not in t and t.used == n * 1024
    finally:
        t.close()
