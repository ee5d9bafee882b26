"""Losing one node costs what it holds, never the client's calls to the other nodes; a node that
missed a heartbeat takes no new objects."""
from __future__ import annotations

import signal
import time

import numpy as np

from hicache_mc import protocol as P
from hicache_mc.client import Chain, StoreClient
from procs import Cluster, request

KiB = 1 << 10


def holders(c: Cluster, keys: list[str]) -> list[str]:
    """The node id the master names for each key ("" where it has none)."""
    reply = request(c.master, P.LocateRequest(keys))
    return [e[0] if e else "" for e in reply.located()]


def node_ids(c: Cluster) -> list[str]:
    """The nodes' ids, in the order they were added (each was waited for before the next)."""
    by_address = {n["address"]: n["node_id"] for n in c.stats()["nodes"]}
    return [by_address[p.address] for p in c.nodes]


def two_nodes(tmp_path, heartbeat_s: float, liveness: int) -> Cluster:
    c = Cluster(tmp_path, heartbeat_s=heartbeat_s, liveness=liveness)
    c.start_master()
    for n in (1, 2):
        c.add_node(dram="64MiB")
        c.wait_nodes(n)
    return c


def test_a_dead_node_does_not_stop_a_clients_writes_to_the_others(tmp_path):
    c = two_nodes(tmp_path, heartbeat_s=0.2, liveness=3)
    page = np.arange(64 * KiB, dtype=np.uint8)
    ptr = page.ctypes.data
    try:
        with StoreClient(c.master, transport="tcp", timeout_s=2.0, circuit_failures=2,
                         circuit_open_s=30.0) as s:
            keys = [f"loss/{i}" for i in range(32)]
            for k in keys:          # one at a time: each lands on the node with most room
                assert s.batch_put_from([k], [ptr], [page.nbytes]) == [True]
            a, b = node_ids(c)
            on_a = [k for k, h in zip(keys, holders(c, keys)) if h == a]
            assert on_a and len(on_a) < len(keys), "placement put everything on one node"
            c.nodes[0].kill(signal.SIGKILL)
            for _ in range(2):      # two failures open node a's circuit (for 30 s)
                assert s.batch_get_into(on_a[:1], [ptr], [page.nbytes]) == [False]
            c.wait_nodes(1)         # the master has dropped a: it places on b only
            fresh = [f"loss/new{i}" for i in range(8)]
            assert s.batch_put_from(fresh, [ptr] * 8, [page.nbytes] * 8) == [True] * 8
            assert set(holders(c, fresh)) == {b}
            assert s.node_circuits.of(a).opens == 1
            on_b = [k for k in keys if k not in on_a]
            assert s.batch_get_into(on_b, [ptr] * len(on_b), [page.nbytes] * len(on_b)) == \
                [True] * len(on_b)
    finally:
        c.stop()


def test_the_master_stops_placing_on_a_node_that_missed_a_heartbeat(tmp_path):
    c = two_nodes(tmp_path, heartbeat_s=0.25, liveness=40)     # expired only after 10 s
    page = np.arange(64 * KiB, dtype=np.uint8)
    try:
        a, b = node_ids(c)
        c.nodes[0].pause()
        end = time.monotonic() + 20
        while next(n["age_s"] for n in c.stats()["nodes"] if n["node_id"] == a) < 0.5:
            assert time.monotonic() < end
            time.sleep(0.05)
        with StoreClient(c.master, transport="tcp", timeout_s=2.0) as s:
            keys = [f"missed/{i}" for i in range(16)]
            for k in keys:
                assert s.batch_put_from([k], [page.ctypes.data], [page.nbytes]) == [True], k
        assert set(holders(c, keys)) == {b}
        assert {n["node_id"] for n in c.stats()["nodes"]} == {a, b}, "a expired: the test proves nothing"
    finally:
        c.nodes[0].kill(signal.SIGCONT)
        c.stop()


def four_nodes(tmp_path, heartbeat_s: float = 0.2, liveness: int = 3) -> Cluster:
    c = Cluster(tmp_path, heartbeat_s=heartbeat_s, liveness=liveness)
    c.start_master()
    for n in range(1, 5):
        c.add_node(dram="32MiB")
        c.wait_nodes(n)
    return c


def put_chain(s: StoreClient, name: str, pages: int, page, calls: int = 2, hot: int = 0) -> list[str]:
    """A chain of ``pages`` keys written in ``calls`` calls, each naming the key before it."""
    keys = [f"chain/{name}/{i}" for i in range(pages)]
    step = -(-pages // calls)
    for start in range(0, pages, step):
        part = keys[start:start + step]
        chain = Chain(keys[start - 1] if start else "", max(0, min(hot - start, len(part))))
        assert s.batch_put_from(part, [page.ctypes.data] * len(part), [page.nbytes] * len(part),
                                chain) == [True] * len(part)
    return keys


def test_a_chain_stays_on_one_node_so_a_node_loss_cuts_only_its_own_chains(tmp_path):
    c = four_nodes(tmp_path)
    page = np.arange(16 * KiB, dtype=np.uint8)
    try:
        with StoreClient(c.master, transport="tcp", timeout_s=2.0) as s:
            chains = [put_chain(s, f"c{n}", 6, page) for n in range(8)]
            homes = [set(holders(c, keys)) for keys in chains]
            assert all(len(h) == 1 for h in homes), homes     # each chain whole on one node
            assert len(set.union(*homes)) >= 3, homes         # chains spread over the nodes
            lost = next(iter(homes[0]))
            c.nodes[node_ids(c).index(lost)].kill(signal.SIGKILL)
            c.wait_nodes(3)
            for keys, home in zip(chains, homes):
                assert s.batch_exists(keys) == (0 if home == {lost} else len(keys))
    finally:
        c.stop()


def test_hot_keys_have_copies_and_a_reader_gets_them_while_a_holder_is_dead(tmp_path):
    c = four_nodes(tmp_path, heartbeat_s=0.5, liveness=20)     # the master keeps the dead listed
    page = np.arange(16 * KiB, dtype=np.uint8)
    out = np.zeros_like(page)
    try:
        with StoreClient(c.master, transport="tcp", timeout_s=2.0, replicas=2) as s:
            keys = put_chain(s, "hot", 8, page, hot=4)
            reply = request(c.master, P.StatsRequest())
            assert reply.stats["copies_placed"] == 4
            first = holders(c, keys)
            assert len(set(first[:4])) == 1 and len(set(first[4:])) == 1
            lost = first[0]
            c.nodes[node_ids(c).index(lost)].kill(signal.SIGKILL)
            # the hot half is read from its copies at once; the rest lives if it lived elsewhere
            got = s.batch_get_into(keys, [out.ctypes.data] * 8, [out.nbytes] * 8)
            assert got == [True] * 4 + [first[4] != lost] * 4 and (out == page).all()
            assert lost in {n["node_id"] for n in c.stats()["nodes"]}, "expired: proves nothing"
    finally:
        c.stop()


def test_a_client_with_replicate_reads_copies_what_it_reads(tmp_path):
    c = four_nodes(tmp_path)
    page = np.arange(16 * KiB, dtype=np.uint8)
    out = np.zeros_like(page)
    try:
        with StoreClient(c.master, transport="tcp", timeout_s=2.0) as writer, \
                StoreClient(c.master, transport="tcp", timeout_s=2.0, replicas=2,
                            replicate_reads=True) as reader:
            keys = put_chain(writer, "read", 6, page)
            home = holders(c, keys)[0]
            assert reader.batch_get_into(keys, [out.ctypes.data] * 6, [out.nbytes] * 6) == [True] * 6
            c.wait_objects(12)          # each key on two nodes now
            c.nodes[node_ids(c).index(home)].kill(signal.SIGKILL)
            c.wait_nodes(3)
            out[:] = 0
            assert writer.batch_get_into(keys, [out.ctypes.data] * 6, [out.nbytes] * 6) == [True] * 6
            assert (out == page).all()
    finally:
        c.stop()


def test_a_put_whose_node_died_unnoticed_is_placed_again_elsewhere(tmp_path):
    c = two_nodes(tmp_path, heartbeat_s=5.0, liveness=10)      # the master notices after 7.5 s
    page = np.arange(16 * KiB, dtype=np.uint8)
    try:
        with StoreClient(c.master, transport="tcp", timeout_s=2.0) as s:
            head = put_chain(s, "died", 4, page, calls=1)
            home = holders(c, head)[0]
            c.nodes[node_ids(c).index(home)].kill(signal.SIGKILL)
            # the continuation follows its parent to the dead node, fails there, goes elsewhere
            tail = [f"chain/died/{i}" for i in range(4, 8)]
            assert s.batch_put_from(tail, [page.ctypes.data] * 4, [page.nbytes] * 4,
                                    Chain(head[-1])) == [True] * 4
            assert set(holders(c, tail)) == set(node_ids(c)) - {home}
            assert home in {n["node_id"] for n in c.stats()["nodes"]}, "expired: proves nothing"
    finally:
        c.stop()
