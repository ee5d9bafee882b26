import random

from hicache_mc.node.allocator import SlotAllocator


def test_allocate_free_coalesces_back_to_one_range():
    a = SlotAllocator(4096, 1 << 20, align=256)
    offs = [a.allocate(1000) for _ in range(100)]
    assert len(set(offs)) == 100 and all(o >= 4096 for o in offs)
    assert a.used == 100 * 1024
    random.Random(1).shuffle(offs)
    for o in offs:
        a.free(o, 1000)
    assert a.used == 0 and a.largest_free() == 1 << 20


def test_no_overlap_under_random_churn():
    a = SlotAllocator(0, 1 << 20, align=64)
    live = {}
    rng = random.Random(7)
    for _ in range(3000):
        if live and rng.random() < 0.45:
            off = rng.choice(list(live))
            a.free(off, live.pop(off))
        else:
            size = rng.randint(1, 40_000)
            off = a.allocate(size)
            if off >= 0:
                live[off] = size
        spans = sorted((o, o + ((s + 63) // 64) * 64) for o, s in live.items())
        assert all(e1 <= s2 for (_, e1), (s2, _) in zip(spans, spans[1:]))
        assert all(0 <= s and e <= 1 << 20 for s, e in spans)


def test_full_returns_minus_one():
    a = SlotAllocator(0, 4096, align=256)
    assert a.allocate(4096) == 0
    assert a.allocate(1) == -1 and not a.can_allocate(1)
