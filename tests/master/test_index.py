from hicache_mc.master.index import KeyIndex, NodeSlots
from hicache_mc.master.placement import Ask, place
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


def ask(sizes, host="h1", **kw):
    return Ask(sizes, kw.pop("want", [1] * len(sizes)), kw.pop("held", [()] * len(sizes)), host, **kw)


def test_a_new_chain_goes_whole_to_the_writers_host_then_to_the_node_with_most_room():
    reg = NodeRegistry(1.0, 3)
    reg.upsert(info(1, "h1"), 0)
    reg.upsert(info(2, "h2", cap=2000), 1)
    reg.upsert(info(3, "h2"), 2)
    assert place(reg, ask([100], "h1")) == [["n1"]]
    assert place(reg, ask([100] * 4, "h2")) == [["n2"]] * 4       # one chain, one node
    assert place(reg, ask([10], "elsewhere")) == [["n2"]]


def test_a_heartbeat_sent_before_a_chains_commit_does_not_hide_the_chain_from_placement():
    reg = NodeRegistry(1.0, 3)
    reg.upsert(info(1), 0, b"a")
    reg.upsert(info(2), 1, b"b")
    assert place(reg, ask([300])) == [["n1"]]
    reg.touch("n1", b"a", {"used": 0})      # its stats were taken before the chain committed
    assert place(reg, ask([300])) == [["n2"]]
    reg.touch("n1", b"a", {"used": 300})    # the next one counts it
    assert reg.nodes["n1"].free == 700
    reg.touch("n2", b"b", {"used": 300})    # counted twice for one interval: a busy node looks
    assert reg.nodes["n2"].free == 400      # fuller, never emptier
    reg.touch("n2", b"b", {"used": 300})
    assert reg.nodes["n2"].free == 700


def test_expiry():
    reg = NodeRegistry(1.0, 3)
    st = reg.upsert(info(1), 0)
    assert reg.expire(st.last_seen + 2.0) == []
    assert [s.info.node_id for s in reg.expire(st.last_seen + 3.5)] == ["n1"]
    assert place(reg, ask([1])) == [[]]


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
    assert place(reg, ask([300, 300, 300])) == [["n1"]] * 3
    # n1 has 100 left: the next chain does not fit it and goes where there is room
    assert place(reg, ask([300, 100])) == [["n2"]] * 2
    # no node has room: the writer's own still takes it (it evicts its least recently used)
    assert place(reg, ask([9000])) == [["n1"]]


def test_a_chain_follows_its_parent_until_it_branches_and_hot_keys_get_copies():
    reg = NodeRegistry(1.0, 3)
    for i in (1, 2, 3):
        reg.upsert(info(i, "h1", cap=10_000 - i), i)
    assert place(reg, ask([10] * 3, parent=("n3",))) == [["n3"]] * 3   # with its parent
    assert place(reg, ask([10], parent=("n3",), follow=False)) == [["n1"]]   # a branch
    # two copies of the first key: the parent's node and the next with most room
    got = place(reg, ask([10, 10], want=[2, 1], parent=("n3",)))
    assert got == [["n3", "n2"], ["n3"]]
    # a key held once already wants one more copy, elsewhere; an avoided node takes nothing
    assert place(reg, ask([10], want=[2], held=[("n1",)], avoid=frozenset({"n2"}))) == [["n3"]]
    assert place(reg, ask([10], want=[3], held=[("n1", "n2", "n3")])) == [[]]


def test_copies_of_a_key_keep_it_stored_until_the_last_goes():
    idx = KeyIndex()
    idx.add_many(["c/1", "c/2"], 1, [8, 8], [5, 6])
    idx.add_many(["c/1"], 2, [8], [5])               # the same object on node 2: a copy
    assert idx.holders("c/1") == [1, 2] and idx.holders("c/2") == [1]
    assert idx.get_many(["c/1"], {1, 2}, frozenset({2}))[0] >> 104 == 2    # the reader's host
    assert idx.get_many(["c/1"], {2})[0] >> 104 == 2                        # the live copy
    assert idx.remove("c/1", 1) and idx.holders("c/1") == [2] and idx.held("c/1", {2})
    idx.add_many(["c/2"], 3, [8], [6])
    assert idx.drop_slot(1) == 0 and idx.holders("c/2") == [3] and len(idx) == 2
    idx.add_many(["c/2"], 4, [8], [7])              # other bytes: they replace every copy
    assert idx.holders("c/2") == [4]


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
