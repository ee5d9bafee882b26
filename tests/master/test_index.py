from hicache_mc.master.index import KeyIndex, NodeSlots
from hicache_mc.master.registry import NodeRegistry
from hicache_mc.protocol import NodeInfo


def test_index_pack_unpack_and_leading_run():
    idx = KeyIndex()
    idx.add("a", 1, 4 << 20, (1 << 64) - 1)
    idx.add("b", 2, 7, 5)
    assert idx.get("a") == (1, 4 << 20, (1 << 64) - 1)
    assert idx.leading_run(["a", "b", "c"], {1, 2}) == 2
    assert idx.leading_run(["a", "b"], {1}) == 1           # node 2 not live
    assert not idx.remove("a", 2) and idx.remove("a", 1)    # only the holder removes
    assert idx.drop_slot(2) == 1 and len(idx) == 0


def test_node_slots_are_stable():
    s = NodeSlots()
    assert s.slot("x") == 0 and s.slot("y") == 1 and s.slot("x") == 0 and s.node_id(1) == "y"


def info(i, host="h1", cap=1000):
    return NodeInfo(f"n{i}", f"tcp://127.0.0.1:{i}", host, f"/dev/shm/x-{i}", cap)


def test_placement_prefers_writer_host_then_free_space():
    reg = NodeRegistry(1.0, 3)
    reg.upsert(info(1, "h1"), 0)
    reg.upsert(info(2, "h2"), 1)
    reg.upsert(info(3, "h2"), 2)
    assert reg.place([100], "h1") == ["n1"]
    spread = reg.place([100] * 4, "h2")
    assert sorted(spread) == ["n2", "n2", "n3", "n3"]
    assert reg.place([10], "elsewhere")[0] in {"n1", "n2", "n3"}


def test_expiry():
    reg = NodeRegistry(1.0, 3)
    st = reg.upsert(info(1), 0)
    assert reg.expire(st.last_seen + 2.0) == []
    assert [s.info.node_id for s in reg.expire(st.last_seen + 3.5)] == ["n1"]
    assert reg.place([1], "h1") == [None]


def test_add_many_packs_like_add():
    one, many = KeyIndex(), KeyIndex()
    keys = [f"ns/{i}" for i in range(5)]
    for i, k in enumerate(keys):
        one.add(k, 3, 100 + i, (1 << 64) - 1 - i)
    many.add_many(keys, 3, [100 + i for i in range(5)], [(1 << 64) - 1 - i for i in range(5)])
    assert one.get_many(keys) == many.get_many(keys) and many.get("ns/4") == (3, 104, (1 << 64) - 5)


def test_placement_of_a_batch_that_fits_one_local_node_goes_there_whole():
    reg = NodeRegistry(1.0, 3)
    reg.upsert(info(1, "h1", cap=1000), 0)
    reg.upsert(info(2, "h2", cap=5000), 1)
    assert reg.place([300, 300, 300], "h1") == ["n1"] * 3
    # n1 has 100 left: the next batch does not fit it and spills to the most free node
    assert reg.place([300, 100], "h1") == ["n2", "n1"]


def test_the_journal_keeps_each_namespaces_last_change_and_keys_where_followed():
    from hicache_mc.residency import digests
    idx = KeyIndex()
    idx.journal, idx.key_spaces = {}, {"a"}
    idx.add_many(["a/1", "a/2", "b/1"], 0, [1, 1, 1], [0, 0, 0])
    assert idx.remove("a/1", 0) and not idx.remove("b/1", 5)      # only the holder removes
    assert idx.journal == {"a": {digests(["a/1"]): False, digests(["a/2"]): True},
                           "b": {digests(["b/1"]): True}}
    assert idx.key_journal == {"a": {"a/1": False, "a/2": True}}   # b: nobody follows its keys
    assert idx.digests("a") == digests(["a/2"]) and idx.namespace_size("b") == 1
    idx.journal.clear()
    assert idx.drop_slot(0) == 2 and len(idx) == 0
    assert idx.journal == {"a": {digests(["a/2"]): False}, "b": {digests(["b/1"]): False}}
