"""Arenas end to end: a node lends a writer room, the writer's puts place objects in it and
commit them with their offsets (one round trip to the node instead of two).

Real master and node processes on 127.0.0.1; the node must reject every malformed or stale
arena commit with an error that names it, keep serving, and account for every byte."""
import threading
import time

import numpy as np
import pytest

from hicache_mc import protocol as P
from hicache_mc.client import StoreClient
from procs import in_threads, request

KiB = 1 << 10


def node_stats(address: str) -> dict:
    reply = request(address, P.NodeStatsRequest())
    assert isinstance(reply, P.StatsReply), reply
    return reply.stats


def node_of(store) -> str:
    return store.cluster.stats()["nodes"][0]["address"]


def data(key: str, size: int) -> np.ndarray:
    return np.random.default_rng(abs(hash(key)) % (1 << 32)).integers(0, 256, size, dtype=np.uint8)


def put_and_check(c: StoreClient, keys: list[str], size: int) -> None:
    srcs = [data(k, size) for k in keys]
    assert c.batch_put_from(keys, [a.ctypes.data for a in srcs], [size] * len(keys)) == [True] * len(keys)
    dsts = [np.zeros(size, np.uint8) for _ in keys]
    assert c.batch_get_into(keys, [a.ctypes.data for a in dsts], [size] * len(keys)) == [True] * len(keys)
    assert all(np.array_equal(a, b) for a, b in zip(srcs, dsts))


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_puts_go_through_an_arena_and_every_byte_is_accounted_for(store, transport):
    """Four threads share one client; whichever put holds the arenas places its objects there,
    the others reserve. Afterwards every object reads back, and once the client has closed
    (giving its arenas back) the node's used bytes are exactly its objects'."""
    node = node_of(store)
    sizes = [1000, 4 * KiB, 64 * KiB]
    with StoreClient(store.master, transport=transport) as c:
        def writer(t: int) -> None:
            for r in range(12):
                put_and_check(c, [f"ar-{transport}/{t}/{r}/{i}" for i in range(8)], sizes[r % 3])
        assert not in_threads(writer, 4)
        assert c.stats()["client"]["arena_puts"] >= 12
        assert node_stats(node)["arenas"] >= 1
    st = node_stats(node)
    assert st["objects"] == 4 * 12 * 8 and st["reserved"] == 0
    assert st["arenas"] == 0 and st["arena_bytes"] == 0
    rounded = [max(256, -(-s // 256) * 256) for s in sizes]
    assert st["used"] == 4 * 4 * 8 * sum(rounded)


def test_malformed_arena_requests_get_errors_that_name_them(store):
    node = node_of(store)
    reply = request(node, P.ArenaRequest(-1))
    assert isinstance(reply, P.ErrorReply) and reply.code == "bad_request" and "size" in reply.message
    lent = request(node, P.ArenaRequest(1 << 20))
    assert isinstance(lent, P.ArenaReply) and lent.arena and lent.size == 1 << 20 and lent.ttl > 0
    start, end = lent.offset, lent.offset + lent.size
    cases = [
        (P.CommitRequest(["k"], [1], [start], lent.arena, []), "bad_request", "one size per key"),
        (P.CommitRequest(["k"], [1], [start + 1], lent.arena, [10]), "bad_request", "aligned"),
        (P.CommitRequest(["k"], [1], [end - 256], lent.arena, [1024]), "bad_request", "past the arena's end"),
        (P.CommitRequest(["k", "l"], [1, 2], [start + 512, start], lent.arena, [10, 10]), "bad_request",
         "at or after"),
        (P.CommitRequest(["k"], [1], [start], lent.arena + 1, [10]), "unknown_arena", "no such arena"),
        (P.CommitRequest(["k"], [1], [start], lent.arena, [10], -5), "bad_request", "lend"),
    ]
    for msg, code, words in cases:
        reply = request(node, msg)
        assert isinstance(reply, P.ErrorReply) and reply.code == code and words in reply.message, (msg, reply)
    # nothing was committed by the refused requests; a good commit still works
    reply = request(node, P.CommitRequest(["good"], [P_sum := 5], [start], lent.arena, [10]))
    assert isinstance(reply, P.CommitReply) and reply.ok == [True] and P_sum == 5
    st = node_stats(node)
    assert st["objects"] == 1 and st["arenas"] == 1
    request(node, P.ArenaRequest(0, give_back=lent.arena))
    assert node_stats(node)["arena_bytes"] == 0


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_puts_into_an_arena_ask_the_master_nothing_and_the_next_arena_comes_with_the_commit(store, transport):
    """Once a client holds an arena on its host's only node, a put is one round trip: no
    Place (the master's count stays still), no Arena request (each commit brings the next
    arena), and yet another client finds every object the moment the put returns."""
    with StoreClient(store.master, transport=transport) as c, StoreClient(store.master) as other:
        for r in range(3):
            put_and_check(c, [f"local-{transport}/warm/{r}/{i}" for i in range(8)], 16 * KiB)
        ch = c._channel(node_of(store))
        sent = []
        real_send = ch.send
        ch.send = lambda msg, payload=None: sent.append(type(msg).__name__) or real_send(msg, payload)
        places, local = store.cluster.stats()["place_calls"], c.counters["put_local"]
        for r in range(10):
            keys = [f"local-{transport}/{r}/{i}" for i in range(8)]
            srcs = [data(k, 16 * KiB) for k in keys]
            assert c.batch_put_from(keys, [a.ctypes.data for a in srcs], [16 * KiB] * 8) == [True] * 8
            assert other.batch_exists(keys) == 8
            got = [np.zeros(16 * KiB, np.uint8) for _ in keys]
            assert other.batch_get_into(keys, [a.ctypes.data for a in got], [16 * KiB] * 8) == [True] * 8
            assert all(np.array_equal(a, b) for a, b in zip(srcs, got))
            assert node_stats(node_of(store))["arenas"] <= 2
        assert store.cluster.stats()["place_calls"] == places
        assert c.counters["put_local"] == local + 10
        assert set(sent) == {"CommitRequest"} and len(sent) == 10, sent
    st = node_stats(node_of(store))
    assert st["arenas"] == 0 and st["arena_bytes"] == 0 and st["reserved"] == 0


def test_with_two_nodes_every_put_asks_the_master_and_no_arena_is_left_behind(cluster):
    """With two nodes the master spreads a host's objects over them and finds keys either
    holds: no put skips the Place (its reply names no sole node). A writer whose puts move
    between the nodes asks for no arena (it would leave one behind at each move), and no
    lent byte is left on either node."""
    cluster.start_master()
    cluster.add_node()
    cluster.add_node()
    cluster.wait_nodes(2)
    nodes = [n["address"] for n in cluster.stats()["nodes"]]
    with StoreClient(cluster.master) as c:
        for r in range(12):                     # one key a put: the master alternates nodes
            put_and_check(c, [f"two/{r}"], 16 * KiB)
        assert sum(node_stats(n)["arenas"] for n in nodes) == 0
        for r in range(12):                     # batches the master splits over both
            put_and_check(c, [f"two/big/{r}/{i}" for i in range(32)], 64 * KiB)
        assert c.counters["put_local"] == 0
        assert cluster.stats()["place_calls"] == 24
        assert sum(node_stats(n)["arenas"] for n in nodes) <= 2
    assert sum(node_stats(n)["objects"] for n in nodes) == 12 + 12 * 32
    for n in nodes:
        st = node_stats(n)
        assert st["reserved"] == 0 and st["arenas"] == 0 and st["arena_bytes"] == 0


def test_an_arena_the_node_no_longer_knows_sends_the_put_the_ordinary_way(store):
    with StoreClient(store.master) as c:
        for r in range(3):
            put_and_check(c, [f"gone/{r}/{i}" for i in range(4)], 8 * KiB)
        assert c._arenas.held
        for arena in c._arenas.held:
            arena.id += 1                    # as if the node had restarted at the same address
        before = c.stats()["client"]["arena_puts"]
        put_and_check(c, [f"gone/after/{i}" for i in range(4)], 8 * KiB)   # refused: written anyway
        assert not c._arenas.held
        for r in range(2):          # the next put asks for a new arena, the one after uses it
            put_and_check(c, [f"gone/again/{r}/{i}" for i in range(4)], 8 * KiB)
        assert c.stats()["client"]["arena_puts"] == before + 1


def test_an_unused_arena_lapses_on_the_node_and_the_client_moves_on(cluster):
    cluster.env["HICACHE_MC_RESERVE_S"] = "1.0"
    cluster.start_master()
    node = cluster.add_node(dram="64MiB")
    cluster.wait_nodes(1)
    with StoreClient(cluster.master) as c:
        for r in range(3):
            put_and_check(c, [f"lapse/{r}/{i}" for i in range(4)], 8 * KiB)
        assert node_stats(node.address)["arenas"] >= 1
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:      # lapses after 1 s, then a 2 s lease of quarantine
            st = node_stats(node.address)
            if not st["arena_bytes"] and not st["quarantined"]:
                break
            time.sleep(0.2)
        st = node_stats(node.address)
        assert st["arenas"] == 0 and st["arena_bytes"] == 0 and st["quarantined"] == 0
        for r in range(3):
            put_and_check(c, [f"lapse/after/{r}/{i}" for i in range(4)], 8 * KiB)
    assert "expired unused" in node.log()


def test_puts_bigger_than_a_node_lends_reserve_as_usual(cluster):
    """A node lends at most 1/16 of its DRAM: a client asking for more takes the note and
    reserves those puts the usual way, while smaller ones still go through arenas."""
    cluster.start_master()
    node = cluster.add_node(dram="16MiB")           # lends 1 MiB at most
    cluster.wait_nodes(1)
    with StoreClient(cluster.master) as c:
        for r in range(4):
            put_and_check(c, [f"big/{r}/{i}" for i in range(24)], 64 * KiB)   # 1.5 MiB puts
        assert c.stats()["client"]["arena_puts"] == 0
        for r in range(4):
            put_and_check(c, [f"small/{r}/{i}" for i in range(4)], 64 * KiB)
        assert c.stats()["client"]["arena_puts"] >= 2
        for r in range(4):
            c.clear("big/")
            put_and_check(c, [f"big/{r}/{i}" for i in range(24)], 64 * KiB)
    st = node_stats(node.address)
    assert st["arenas"] == 0 and st["arena_bytes"] == 0 and st["reserved"] == 0


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_an_arena_on_a_node_restarted_at_the_same_ports_never_touches_the_new_nodes_objects(cluster, transport):
    """The node restarts at the same address and stream port, and another client fills the
    start of its new segment, where the first client's arena was in the old one. That client's
    next put, sent before it has heard of the restart, copies into its arena while its Place
    is on its way: through shm into the dead segment, through tcp refused (the stream port
    checks the segment). The Place brings the node's new record and the put is stored the
    ordinary way, the first time, from a new thread and from one whose connections are to
    the old process alike; the other client's objects read back intact."""
    from procs import free_port
    cluster.start_master()
    port, data_port = free_port(), free_port()
    args = ("--data-port", str(data_port))
    first = cluster.add_node(port=port, args=args)
    cluster.wait_nodes(1)
    with StoreClient(cluster.master, transport=transport) as old:
        for r in range(3):
            put_and_check(old, [f"before/{r}/{i}" for i in range(8)], 16 * KiB)
        assert old._arenas.held
        first.kill()
        cluster.wait_nodes(0, timeout_s=10)
        cluster.add_node(port=port, args=args)
        cluster.wait_nodes(1)
        keys = [f"other/{i}" for i in range(64)]
        with StoreClient(cluster.master, transport=transport) as other:
            srcs = [data(k, 16 * KiB) for k in keys]
            assert all(other.batch_put_from(keys, [a.ctypes.data for a in srcs], [16 * KiB] * 64))
            srcs_old = [data(f"after/{i}", 16 * KiB) for i in range(8)]
            ok = []

            def put_after() -> None:    # a thread with no connection to the old process yet
                ok.append(old.batch_put_from([f"after/{i}" for i in range(8)],
                                             [a.ctypes.data for a in srcs_old], [16 * KiB] * 8))
            t = threading.Thread(target=put_after)
            t.start()
            t.join()
            assert all(ok[-1])
            # this thread's connections are to the old process: they are found closed, not used
            srcs_old += [data(f"after2/{i}", 16 * KiB) for i in range(8)]
            assert all(old.batch_put_from([f"after2/{i}" for i in range(8)],
                                          [a.ctypes.data for a in srcs_old[8:]], [16 * KiB] * 8))
            back = [np.zeros(16 * KiB, np.uint8) for _ in srcs_old]
            names = [f"after/{i}" for i in range(8)] + [f"after2/{i}" for i in range(8)]
            assert old.batch_get_into(names, [a.ctypes.data for a in back], [16 * KiB] * 16) == [True] * 16
            assert all(np.array_equal(a, b) for a, b in zip(srcs_old, back))
            dsts = [np.zeros(16 * KiB, np.uint8) for _ in keys]
            assert other.batch_get_into(keys, [a.ctypes.data for a in dsts], [16 * KiB] * 64) == [True] * 64
            assert all(np.array_equal(a, b) for a, b in zip(srcs, dsts))
            assert other.checks.failures == 0 and old.checks.failures == 0
