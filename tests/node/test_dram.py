import os
import stat

import pytest

from hicache_mc.node.dram import DramTier


@pytest.fixture
def tier(tmp_path):
    t = DramTier(str(tmp_path / "seg"), 1 << 20, "abcd1234", lease_s=1.0,
                 high_watermark=0.9, low_watermark=0.5)
    yield t
    t.close()


def put(t, key, size, now, fill=1):
    """Reserve, copy and commit, as a writer does; False when there is no room."""
    slot = t.reserve(key, size, now, hold_s=1.0)
    if slot is None:
        return False
    t.view(slot)[:] = bytes([fill]) * size
    return t.commit(key, checksum=fill) is slot


def test_commit_and_lease(tier):
    assert put(tier, "a", 1000, 0.0, fill=7)
    obj = tier.lease("a", 0.0)
    assert bytes(tier.view(obj)) == bytes([7]) * 1000
    assert "a" in tier and tier.get("a") is obj
    assert tier.lease("missing", 0.0) is None


def test_lru_eviction_when_full_reports_dropped(tier):
    for i in range(4):
        assert put(tier, f"k{i}", 256 << 10, now=10.0 + i)
    tier.lease("k0", 20.0)                               # k0 becomes most recent ...
    assert put(tier, "k4", 256 << 10, now=30.0)          # ... so k1 is evicted, not k0
    assert tier.take_dropped() == [("k1", 256 << 10)] and "k0" in tier
    assert tier.evictions == 1


def test_watermark_eviction_in_maintain(tier):
    for i in range(15):
        assert put(tier, f"k{i}", 64 << 10, now=float(i))
    tier.maintain(100.0)
    assert tier.used <= tier.low
    assert "k14" in tier and "k0" not in tier


def test_leased_slot_is_quarantined_not_reused(tier):
    for i in range(4):
        assert put(tier, f"k{i}", 256 << 10, now=0.0)
    obj = tier.lease("k0", now=5.0)                      # lease until 6.0; k0 is now newest
    tier.remove(["k1", "k2", "k3"], now=5.0)
    off = obj.offset
    gone = tier.remove(["k0"], now=5.5)                  # freed while leased
    assert gone == ["k0"]
    # a new object cannot take k0's slot before the lease ends
    for i in range(3):
        o = tier.reserve(f"n{i}", 256 << 10, 5.6, 1.0)
        assert o.offset != off
    assert tier.reserve("n3", 256 << 10, 5.7, 1.0) is None  # only the quarantined slot is left
    assert tier.reserve("n4", 256 << 10, 6.1, 1.0).offset == off  # lease over: reusable


def test_expired_reservation_is_reclaimed(tier):
    assert tier.reserve("r", 1000, now=0.0, hold_s=1.0) is not None
    assert tier.maintain(2.0) == [("r", 1000)]
    assert not tier.is_reserved("r") and tier.commit("r", 1) is None


def test_released_lease_frees_a_removed_slot_at_once(tier):
    for i in range(4):
        assert put(tier, f"k{i}", 256 << 10, now=0.0)
    obj = tier.lease("k0", now=5.0)
    tier.remove(["k0"], now=5.1)                         # leased: quarantined until 6.0
    assert tier.stats()["quarantined"] == 1
    tier.release("k0", obj.offset)                        # the reader is done
    assert tier.stats()["quarantined"] == 0
    assert tier.reserve("n", 256 << 10, 5.2, 1.0).offset == obj.offset   # reused, nothing evicted
    assert tier.evictions == 0


def test_slot_stays_protected_while_another_reader_holds_it(tier):
    assert put(tier, "a", 1000, now=0.0)
    obj = tier.lease("a", now=1.0)
    tier.lease("a", now=1.1)                              # a second reader
    tier.remove(["a"], now=1.2)
    tier.release("a", obj.offset)
    assert tier.stats()["quarantined"] == 1               # the second reader still copies
    tier.release("a", obj.offset)
    assert tier.stats()["quarantined"] == 0
    tier.release("a", obj.offset)                         # a stray release changes nothing


def test_release_does_not_free_a_reused_slot_or_an_expired_reservation(tier):
    assert put(tier, "a", 1000, now=0.0)
    obj = tier.lease("a", now=1.0)
    tier.remove(["a"], now=1.1)
    tier.release("a", obj.offset)                         # slot free again ...
    assert put(tier, "b", 1000, now=1.2)                  # ... and reused by b
    assert tier.get("b").offset == obj.offset
    tier.release("a", obj.offset)                         # a late duplicate must not touch b
    assert "b" in tier and tier.used >= 1000
    off = tier.reserve("r", 1000, now=2.0, hold_s=1.0).offset
    tier.maintain(3.5)                                    # expired: held for one lease
    assert tier.give_back("r", off) is None               # no longer reserved
    tier.release("r", off)                                # nobody leased it: still held
    assert tier.stats()["quarantined"] == 1
    tier.maintain(10.0)
    assert tier.stats()["quarantined"] == 0


def test_quarantine_entry_of_a_released_slot_is_skipped_later(tier):
    assert put(tier, "a", 1000, now=0.0)
    obj = tier.lease("a", now=1.0)                        # until 2.0
    tier.remove(["a"], now=1.1)
    tier.release("a", obj.offset)
    assert put(tier, "b", 1000, now=1.2)                  # takes the slot
    tier.lease("b", now=1.3)                              # until 2.3
    tier.remove(["b"], now=1.4)                           # quarantined again, same offset
    tier.maintain(2.1)                                    # a's stale heap entry pops: b stays held
    assert tier.stats()["quarantined"] == 1
    tier.maintain(2.4)
    assert tier.stats()["quarantined"] == 0 and tier.excess() == 0


def test_writer_gives_back_an_unfilled_reservation(tier):
    off = tier.reserve("r", 4096, now=0.0, hold_s=10.0).offset
    used = tier.used
    assert tier.give_back("r", off + 256) is None         # wrong offset: not this reservation
    assert tier.is_reserved("r")
    assert tier.give_back("r", off).size == 4096
    assert not tier.is_reserved("r") and tier.used < used
    assert tier.commit("r", 1) is None


def test_reserve_row_cuts_one_range_and_frees_slot_by_slot(tier):
    offs = [s.offset for s in tier.reserve_row(["a", "b", "c"], [1000, 256, 1], now=0.0, hold_s=1.0)]
    assert offs == [offs[0], offs[0] + 1024, offs[0] + 1280]          # in a row, 256-aligned
    assert tier.used == 1536 and all(tier.is_reserved(k) for k in "abc")
    assert tier.commit("b", 5)
    tier.give_back("a", offs[0])                # a writer gives a slot back
    tier.remove(["b"], 0.0)
    tier.give_back("c", offs[2])
    assert tier.used == 0 and tier.reserve("all", tier.capacity, 0.0, 1.0) is not None


def test_reserve_row_declines_rather_than_evict(tier):
    for i in range(3):
        assert put(tier, f"k{i}", 256 << 10, now=float(i))
    # 512 KiB would need an eviction: declined, the key-by-key path decides
    assert tier.reserve_row(["x", "y"], [256 << 10] * 2, now=5.0, hold_s=1.0) is None
    assert tier.evictions == 0 and not tier.is_reserved("x")


def test_the_segment_file_is_the_nodes_own(tmp_path):
    """Mode 0600, and never a file someone else created first (it would keep their access)."""
    path = tmp_path / "taken"
    path.write_bytes(b"")
    os.chmod(path, 0o666)
    with pytest.raises(FileExistsError):
        DramTier(str(path), 1 << 20, "abcd1234", 1.0, 0.9, 0.5)
    t = DramTier(str(tmp_path / "mine"), 1 << 20, "abcd1234", 1.0, 0.9, 0.5)
    try:
        assert stat.S_IMODE(os.stat(tmp_path / "mine").st_mode) == 0o600
    finally:
        t.close()


def test_a_slot_a_stream_transfer_moves_is_reused_only_once_it_ends(tmp_path):
    """Given back (or its object removed and released) while a stream-port transfer still
    moves it, a slot stays out of reuse until the transfer ends."""
    import time

    from hicache_mc.auth import Principal
    from hicache_mc.transport.grants import Grants

    grants, who = Grants(), Principal("client", "a")
    t = DramTier(str(tmp_path / "pinned"), 1 << 20, "abcd1234", lease_s=1.0, high_watermark=0.9,
                 low_watermark=0.5, transfers=grants)
    try:
        w = t.reserve("w", 256 << 10, 0.0, 10.0)
        grants.grant(who, w.offset, w.size, True, time.monotonic() + 30)
        moving = grants.open(who, [(w.offset, w.size)], True, 0.0)
        assert grants.revoke(who, w.offset) and t.give_back("w", w.offset) is w
        assert put(t, "r", 256 << 10, now=0.0)
        leased = t.lease("r", 0.0)
        grants.grant(who, leased.offset, leased.size, False, time.monotonic() + 30)
        reading = grants.open(who, [(leased.offset, leased.size)], False, 0.0)
        t.remove(["r"], 0.0)
        assert grants.revoke(who, leased.offset)
        t.release("r", leased.offset)               # the lease is over; the transfer is not
        assert {t.reserve(f"n{i}", 256 << 10, 2.0, 1.0).offset for i in range(2)}.isdisjoint(
            {w.offset, leased.offset})
        assert t.reserve("full", 256 << 10, 2.0, 1.0) is None   # only the two moved slots left
        assert t.stats()["quarantined"] == 2
        moving.close()
        reading.close()
        t.maintain(3.0)
        assert t.stats()["quarantined"] == 0
        assert {t.reserve(f"m{i}", 256 << 10, 3.0, 1.0).offset for i in range(2)} == \
            {w.offset, leased.offset}
    finally:
        t.close()


def test_a_segment_file_is_removed_only_when_no_live_node_holds_it(tmp_path):
    """The lock a DramTier holds on its file, not the pid in the file's name, keeps it: a
    file named after a dead pid is kept while its lock is held, and removed once free."""
    from hicache_mc.node.segment_file import remove_unowned

    path = tmp_path / "hicache-mc-4194304-abcd1234"     # a pid that lives nowhere
    t = DramTier(str(path), 1 << 20, "abcd1234", 1.0, 0.9, 0.5)
    try:
        remove_unowned(str(tmp_path))
        assert path.exists()                # locked: a live node's, whatever its pid says
    finally:
        t.close()
    assert not path.exists()
    path.write_bytes(b"x")                  # a killed node's: nobody holds its lock
    remove_unowned(str(tmp_path))
    assert not path.exists()
