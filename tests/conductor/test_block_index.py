"""BlockIndex: leading prefixes per worker and tier, its LRU bound, clears, stale streams."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from hicache_mc.conductor.api import BlocksRemoved, BlocksStored, Cleared, StreamHealth, Tier
from hicache_mc.conductor.index import SWEEP_MIN_DEAD, BlockIndex, Prefix

G, H = Tier.GPU, Tier.HOST


def index_of(workers, max_blocks=1000):
    ix = BlockIndex(max_blocks)
    for w in workers:
        ix.add_worker(w)
    return ix


def test_prefix_per_tier_stops_at_the_first_gap():
    ix = index_of(["a", "b", "c"])
    ix.apply([BlocksStored("a", G, [1, 2, 3]), BlocksStored("a", H, [1, 2, 3, 4, 5]),
              BlocksStored("b", H, [1, 2]), BlocksStored("b", G, [4, 5]),
              BlocksStored("c", G, [2, 3])])
    assert ix.prefixes([1, 2, 3, 4, 5, 6]) == {"a": Prefix(3, 2), "b": Prefix(0, 2)}
    ix.apply([BlocksRemoved("a", H, [4])])
    assert ix.prefixes([1, 2, 3, 4, 5]) == {"a": Prefix(3, 0), "b": Prefix(0, 2)}


def naive(stores, chain, hidden):
    """The leading run of ``chain`` per worker in GPU, and in GPU or HOST, from sets."""
    out = {}
    for w, tiers in stores.items():
        if w in hidden:
            continue
        g = next((i for i, h in enumerate(chain) if h not in tiers[G]), len(chain))
        a = next((i for i, h in enumerate(chain) if h not in tiers[G] | tiers[H]), len(chain))
        if a:
            out[w] = Prefix(g, a - g)
    return out


OPS = st.lists(st.tuples(st.sampled_from(["store", "remove", "clear", "stale", "live", "readd"]),
                         st.integers(0, 4), st.sampled_from([G, H]),
                         st.lists(st.integers(0, 12), max_size=8)), max_size=60)


@settings(max_examples=300, deadline=None)
@given(OPS, st.lists(st.integers(0, 12), max_size=14))
def test_prefixes_match_a_naive_model(ops, chain):
    workers = [f"w{i}" for i in range(5)]
    ix = index_of(workers, max_blocks=10_000)
    stores = {w: {G: set(), H: set()} for w in workers}
    hidden = set()
    for op, wi, tier, hashes in ops:
        w = workers[wi]
        if op == "store":
            ix.apply([BlocksStored(w, tier, hashes)])
            stores[w][tier] |= set(hashes)
        elif op == "remove":
            ix.apply([BlocksRemoved(w, tier, hashes)])
            stores[w][tier] -= set(hashes)
        elif op == "clear":
            ix.apply([Cleared(w)])
            stores[w] = {G: set(), H: set()}
        elif op in ("stale", "live"):
            ix.apply([StreamHealth(w, op == "live")])
            (hidden.discard if op == "live" else hidden.add)(w)
        else:
            ix.add_worker(w)        # known again: starts over, stream live
            stores[w] = {G: set(), H: set()}
            hidden.discard(w)
        assert ix.prefixes(chain) == naive(stores, chain, hidden)


def test_lru_bound_drops_the_least_recently_touched():
    ix = index_of(["a"], max_blocks=4)
    ix.apply([BlocksStored("a", G, [1, 2, 3, 4])])
    assert ix.prefixes([1, 2]) == {"a": Prefix(2, 0)}      # touches 1, 2 (with the next apply)
    ix.apply([BlocksStored("a", G, [5, 6])])                 # evicts 3 and 4, not 1, 2
    assert ix.memory().blocks == 4 and ix.counters.evicted == 2
    assert ix.prefixes([1, 2, 3]) == {"a": Prefix(2, 0)}
    assert ix.prefixes([5, 6]) == {"a": Prefix(2, 0)}
    for n in range(100):
        ix.apply([BlocksStored("a", H, [100 + n])])
        assert ix.memory().blocks <= 4


def test_stale_stream_hides_a_worker_until_live_and_keeps_its_events():
    ix = index_of(["a", "b"])
    ix.apply([BlocksStored("a", G, [1, 2]), StreamHealth("a", False),
              BlocksStored("a", G, [3]), BlocksStored("b", G, [1])])
    assert ix.prefixes([1, 2, 3]) == {"b": Prefix(1, 0)}
    assert not ix.visible("a")
    ix.apply([StreamHealth("a", True)])
    assert ix.prefixes([1, 2, 3]) == {"a": Prefix(3, 0), "b": Prefix(1, 0)}


def test_clears_and_removed_workers_are_forgotten_and_slots_reused():
    ix = index_of(["a", "b"])
    for n in range(50):                      # many clears: sweeps recycle the dead slots
        ix.apply([BlocksStored("a", G, [1, 2]), BlocksStored("b", H, [1]), Cleared("a")])
        assert ix.prefixes([1, 2]) == {"b": Prefix(0, 1)}
    mem = ix.memory()             # block 2 holds dead bits only until the next sweep
    assert ix.counters.sweeps > 0 and mem.blocks <= 2 and mem.slots <= 2 + SWEEP_MIN_DEAD
    ix.remove_worker("b")
    ix.add_worker("c")
    assert ix.prefixes([1, 2]) == {}
    ix.apply([BlocksStored("c", G, [1])])
    assert ix.prefixes([1, 2]) == {"c": Prefix(1, 0)}


def test_unknown_workers_and_l3_events_are_ignored():
    ix = index_of(["a"])
    ix.apply([BlocksStored("zz", G, [1]), BlocksStored("a", Tier.L3, [1]), Cleared("zz"),
              StreamHealth("zz", False), BlocksRemoved("zz", G, [1])])
    assert ix.prefixes([1]) == {} and ix.counters.ignored == 5


def test_memory_reports_bytes_per_block():
    ix = index_of([f"w{i}" for i in range(40)], max_blocks=10_000)
    for i in range(40):
        ix.apply([BlocksStored(f"w{i}", G, range(1 << 62, (1 << 62) + 1000))])
    mem = ix.memory()
    assert mem.blocks == 1000 and 40 < mem.bytes_per_block < 1000
