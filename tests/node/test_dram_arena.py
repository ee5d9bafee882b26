"""Arenas on the node, in-process: room lent to one writer, which places objects in it itself.

What the node must guarantee whatever the writer sends: objects only inside the arena, never
overlapping, every byte accounted for (committed, freed as a skipped gap, or given back), and
an arena that lapses is quarantined for one lease before its room is reused."""
import pytest

from hicache_mc.node.dram import DramTier
from hicache_mc.node.store import TieredStore

KiB = 1 << 10


@pytest.fixture
def store(tmp_path):
    dram = DramTier(str(tmp_path / "seg"), 1 << 20, "abcd1234", lease_s=1.0,
                    high_watermark=0.9, low_watermark=0.5)
    st = TieredStore(dram, None, "none", 1.0)
    yield st
    st.close()


def commit(store, arena, items, now=0.0):
    """items: [(key, offset, size)]; per key: "new" (committed), "stored" (stored already) or
    None (not committed)."""
    keys, offsets, sizes = zip(*items)
    assert store.dram.arena_error(arena, list(offsets), list(sizes)) is None
    got = store.commit_arena(arena, list(keys), [7] * len(keys), list(offsets), list(sizes),
                             now, 10.0, 1 << 20)
    return [None if r is None else "stored" if isinstance(r, tuple) else "new" for r in got]


def test_objects_placed_by_the_writer_are_readable_and_gaps_are_freed(store):
    dram = store.dram
    arena, start, size = dram.open_arena(256 * KiB, 0.0, 10.0)
    assert size == 256 * KiB and dram.arena_bytes == size and dram.alloc.used == size
    # a 1000-byte object takes 1024; the writer skipped 4 KiB (a key the master deduplicated)
    assert commit(store, arena, [("a", start, 1000), ("b", start + 1024 + 4 * KiB, 4 * KiB)]) == ["new", "new"]
    assert dram.objects["a"].offset == start and dram.objects["b"].size == 4 * KiB
    assert dram.arena_bytes == size - 1024 - 8 * KiB        # the gap went back, not to an object
    assert dram.alloc.used == size - 4 * KiB
    dram.close_arena(arena, 0.0)                             # given back: its rest is free now
    assert dram.arena_bytes == 0 and dram.alloc.used == 1024 + 4 * KiB
    assert store.usage[""] == 1000 + 4 * KiB


def test_commits_must_go_forward_inside_the_arena(store):
    dram = store.dram
    arena, start, size = dram.open_arena(64 * KiB, 0.0, 10.0)
    other, ostart, _ = dram.open_arena(64 * KiB, 0.0, 10.0)
    assert commit(store, arena, [("a", start + 4 * KiB, 100)]) == ["new"]
    for offsets, sizes, why in [
            ([start], [100], "at or after"),                       # behind the cursor (over "a")
            ([start + 8 * KiB, start + 8 * KiB], [100, 100], "at or after"),   # overlapping
            ([start + 8 * KiB + 1], [100], "aligned"),
            ([start + 60 * KiB], [8 * KiB], "past the arena's end"),
            ([ostart], [100], "past the arena's end"),                # another writer's arena
            ([start + 8 * KiB], [-1], "size -1")]:
        assert why in dram.arena_error(arena, offsets, sizes), (offsets, sizes)
    assert "no such arena" in dram.arena_error(12345, [start], [1])
    dram.close_arena(other, 0.0)


def test_a_stored_key_is_acknowledged_and_its_place_skipped(store):
    dram = store.dram
    arena, start, _ = dram.open_arena(64 * KiB, 0.0, 10.0)
    assert store.reserve("busy", 100, 0.0, 5.0) >= 0                 # another writer storing it
    assert commit(store, arena, [("a", start, 100)]) == ["new"]
    first = dram.objects["a"].offset
    # "a" again: stored already; "busy": not this writer's to acknowledge
    assert commit(store, arena, [("a", start + 256, 100), ("busy", start + 512, 100),
                                 ("c", start + 768, 100)]) == ["stored", None, "new"]
    assert dram.objects["a"].offset == first and dram.objects["c"].offset == start + 768
    assert dram.arena_error(arena, [start + 768], [1]) is not None   # the cursor moved past "c"


def test_a_commit_frees_its_unplaced_tail_and_a_full_arena_is_dropped(store):
    """The places a commit named but did not fill (a key stored already, at its end) are free
    again at once, so the node's cursor is where the writer's is; the commit that reaches
    the arena's end drops it (the writer sees it full and neither gives it back nor uses it)."""
    dram = store.dram
    arena, start, size = dram.open_arena(4 * KiB, 0.0, 10.0)
    assert commit(store, arena, [("a", start, KiB)]) == ["new"]
    assert commit(store, arena, [("b", start + KiB, KiB), ("a", start + 2 * KiB, KiB)]) == ["new", "stored"]
    assert dram.arenas[arena].cursor == start + 3 * KiB               # past the unfilled "a" place
    assert dram.alloc.used == 2 * KiB + KiB and dram.arena_bytes == KiB
    assert commit(store, arena, [("a", start + 3 * KiB, KiB)]) == ["stored"]   # its last place
    assert arena not in dram.arenas and dram.arena_bytes == 0
    assert dram.alloc.used == 2 * KiB                                  # just "a" and "b"
    assert "no such arena" in dram.arena_error(arena, [start + 3 * KiB], [1])


def test_a_lapsed_arena_is_quarantined_for_a_lease_then_freed(store):
    dram = store.dram
    arena, start, size = dram.open_arena(64 * KiB, 0.0, 10.0)
    assert commit(store, arena, [("a", start, 100)], now=5.0) == ["new"]  # renews until 15.0
    store.maintain(14.0)
    assert arena in dram.arenas
    store.maintain(15.5)
    assert arena not in dram.arenas and dram.arena_bytes == 0
    assert dram.alloc.used == 256 + size - 256          # the rest is quarantined (the writer ...
    store.maintain(17.0)                                 # ... may still be copying), then free
    assert dram.alloc.used == 256 and dram.stats()["quarantined"] == 0


def test_arenas_come_only_from_free_room_below_the_high_watermark(store):
    dram = store.dram
    assert dram.open_arena(100, 0.0, 10.0) is None                   # rounds down to nothing
    for i in range(5):                                                # 640 KiB of objects
        assert dram.write(f"k{i}", memoryview(bytes(128 * KiB)), 1, now=0.0)
    got = [dram.open_arena(128 * KiB, 0.0, 10.0) for _ in range(3)]
    assert got[0] and got[1] and got[2] is None                      # 896 KiB <= 0.9 MiB < 1 MiB


def test_at_most_a_quarter_of_the_segment_is_lent_at_once(store):
    dram = store.dram
    got = [dram.open_arena(128 * KiB, 0.0, 10.0) for _ in range(3)]
    assert got[0] and got[1] and got[2] is None                      # 256 KiB = 1/4 of 1 MiB
    dram.close_arena(got[0][0], 0.0)
    assert dram.open_arena(128 * KiB, 0.0, 10.0) is not None


def test_a_tenant_over_its_quota_makes_room_from_its_own_objects_or_is_refused(store):
    dram = store.dram
    store.quotas = {"t": 1000}
    arena, start, _ = dram.open_arena(64 * KiB, 0.0, 10.0)
    assert commit(store, arena, [("ns@t/a", start, 800), ("other/x", start + 1024, 800)]) == ["new", "new"]
    # "b" evicts "a", its tenant's own older object; "c" is bigger than the whole quota
    assert commit(store, arena, [("ns@t/b", start + 2048, 800), ("ns@t/c", start + 4096, 2000)]) == ["new", None]
    assert "ns@t/a" not in dram.objects and "other/x" in dram.objects
    assert store.drain_dropped() == ["ns@t/a"] and store.usage["t"] == 800


def test_a_quota_never_evicts_what_the_same_commit_placed(store):
    dram = store.dram
    store.quotas = {"t": 1000}
    arena, start, _ = dram.open_arena(64 * KiB, 0.0, 10.0)
    assert commit(store, arena, [("ns@t/a", start, 800), ("ns@t/b", start + 1024, 800)]) == ["new", None]
    assert "ns@t/a" in dram.objects and store.usage["t"] == 800


def test_lent_room_does_not_count_as_objects_to_evict(store):
    dram = store.dram                       # 1 MiB: high 0.9 MiB, low 0.5 MiB
    arena, _, size = dram.open_arena(128 * KiB, 0.0, 10.0)
    for i in range(7):
        assert dram.write(f"k{i}", memoryview(bytes(128 * KiB)), 1, now=float(i))
    assert dram.alloc.used == 8 * 128 * KiB
    store.maintain(10.0)
    # objects down to the low watermark; the arena's room is not made up for by evicting more
    assert len(dram.objects) == 4 and arena in dram.arenas


def test_a_quota_never_evicts_a_key_the_same_commit_acknowledges_as_stored(store):
    dram = store.dram
    store.quotas = {"t": 1000}
    arena, start, _ = dram.open_arena(64 * KiB, 0.0, 10.0)
    assert commit(store, arena, [("ns@t/old", start, 600)]) == ["new"]
    # "old" again (stored: acknowledged), then "new" needs room: it may not take "old"'s
    assert commit(store, arena, [("ns@t/old", start + 1024, 600), ("ns@t/new", start + 2048, 600)]) == \
        ["stored", None]
    assert "ns@t/old" in dram.objects
