"""TieredStore policy in-process: back-pressure when DRAM is full of objects not yet on disk."""
import numpy as np
import pytest

from hicache_mc.node.dram import DramTier
from hicache_mc.node.ssd import SsdTier
from hicache_mc.node.store import TieredStore
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


def test_writes_beyond_dram_wait_for_the_disk_instead_of_failing(store):
    # no maintain()/poll_done() between writes: only back-pressure can make room
    blobs = {f"k{i}": np.full(MiB, i, dtype=np.uint8).tobytes() for i in range(40)}
    for i, (k, b) in enumerate(blobs.items()):
        assert store.write(k, memoryview(b), checksum(b), now=float(i)), k
        store.persist([k])
    store.poll_done(100.0)
    assert store.dram.dropped == []                 # nothing acknowledged was dropped
    for k, b in blobs.items():
        got = store.read(k, 100.0)
        assert got is not None and bytes(got[2]) == b, k
    assert store.stats()["tenants"] == {"": 40 * MiB}


def test_reserve_waits_too(store):
    for i in range(30):
        off = store.reserve(f"r{i}", MiB, float(i), 5.0)
        assert off >= 0
        store.dram.mm[off: off + MiB] = bytes([i]) * MiB
        assert store.commit(f"r{i}", checksum(bytes([i]) * MiB))
        store.persist([f"r{i}"])
    store.poll_done(100.0)
    for i in range(30):
        assert bytes(store.read(f"r{i}", 100.0)[2]) == bytes([i]) * MiB


def test_a_second_writer_is_acknowledged_only_once_the_first_holds(tmp_path):
    dram = DramTier(str(tmp_path / "seg2"), 8 * MiB, "abcd5678", lease_s=0.5,
                    high_watermark=0.9, low_watermark=0.5)
    ssd = SsdTier(str(tmp_path / "ssd2"), 64 * MiB, 8 * MiB, 0.95, 0.85)
    st = TieredStore(dram, ssd, "sync", 1.0)
    try:
        data = b"z" * 1000
        assert st.reserve("k", 1000, 0.0, 5.0) >= 0           # writer 1 is copying
        assert st.reserve("k", 1000, 0.0, 5.0) == -4          # writer 2: busy, not acknowledged
        assert st.write("k", memoryview(data), checksum(data), 0.0) is False
        off = dram.reserved["k"][0].offset
        dram.mm[off: off + 1000] = data
        assert st.commit("k", checksum(data))
        assert st.reserve("k", 1000, 0.0, 5.0) == -4          # sync: in DRAM, not yet on disk
        st.persist(["k"], waiter="w")
        while not st.finished:
            st.poll_done(1.0)
        assert st.finished == [("w", [True])]
        assert st.reserve("k", 1000, 0.0, 5.0) == -2          # on disk: a duplicate is acknowledged
        assert st.write("k", memoryview(data), checksum(data), 0.0) is True
    finally:
        st.close()


def test_reserve_many_agrees_with_reserve_key_by_key(tmp_path):
    """Stored, being stored, repeated within the batch, out of range, under a quota: each gets
    what ``reserve`` would give it; the fresh rest share one range."""
    dram = DramTier(str(tmp_path / "seg3"), 8 * MiB, "abcd9999", lease_s=0.5,
                    high_watermark=0.9, low_watermark=0.5)
    st = TieredStore(dram, None, "none", 1.0)
    try:
        assert st.write("stored", memoryview(b"s" * 100), 1, 0.0)
        assert st.reserve("busy", 100, 0.0, 5.0) >= 0
        st.quotas = {"t": 150}
        st.usage["t"] = 100
        keys = ["n/1", "stored", "busy", "n/2", "n/1", "huge", "neg", "ns@t/q", "ns@u/r"]
        sizes = [100, 100, 100, 200, 100, 10 * MiB, -1, 100, 100]
        offs = st.reserve_many(keys, sizes, 0.0, 5.0, max_size=MiB)
        assert offs[1:3] == [-2, -4] and offs[4] == -4          # stored, busy, repeated
        assert offs[5] == -1 and offs[6] == -1                  # too large, negative
        assert offs[3] == offs[0] + 256 and offs[8] == offs[3] + 256   # fresh: one range
        assert offs[7] == -1                                    # over tenant t's quota
        got = st.commit_many(["n/1", "n/2", "nothing"], [7, 8, 9])
        assert [o.size if o else None for o in got] == [100, 200, None]
        assert st.usage[""] == 400 and st.meta("n/2") == (200, 8)
        # with offsets: a commit naming another slot than the key's reservation commits nothing
        # (a writer whose reservation lapsed while another writer reserved the key elsewhere)
        a, b = st.reserve_many(["o/a", "o/b"], [100, 100], 0.0, 5.0)
        got = st.commit_many(["o/a", "o/b"], [1, 2], [a, a])
        assert got[0].offset == a and got[1] is None
        assert st.dram.reserved["o/b"][0].offset == b           # still the other writer's
        assert st.commit_many(["o/b"], [2], [b])[0].offset == b
    finally:
        st.close()
