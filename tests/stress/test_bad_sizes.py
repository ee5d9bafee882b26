"""Absurd sizes and oversized frames: refused, without allocating them, without stalling.

The node here accepts values up to 1 MiB (``HICACHE_MC_NODE_MAX_VALUE``), so an oversized
value costs the test only a few MiB on the wire. Peak memory is read from /proc (VmHWM): a
server that buffered an oversized frame shows it there even after freeing it.

The last five tests keep bugs this suite found from coming back: frames buffered before their
size was checked, millions of keys stalling the master, hostile checksums taken for a disk
failure, an unchecked node record.
"""
from __future__ import annotations

import time

import msgpack
import pytest
import zmq

from hicache_mc import protocol as P
from hicache_mc.client import StoreClient
from harness import stress_cluster, valid_client_works, vm_hwm
from procs import raw_request, request

MiB = 1 << 20
LIMIT = 1 * MiB


@pytest.fixture(scope="module")
def sized(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sizes")
    c = stress_cluster(tmp)
    c.env["HICACHE_MC_NODE_MAX_VALUE"] = str(LIMIT)
    c.start_master()
    c.add_node(dram="32MiB")
    c.add_node(dram="32MiB", args=("--ssd", "64MiB", "--ssd-dir", str(tmp / "ssd"), "--durability", "sync"))
    c.wait_nodes(2)
    yield c
    c.stop()


def node_stats(c, i: int) -> dict:
    address = c.nodes[i].address
    return next(n for n in c.stats()["nodes"] if n["address"] == address)


# ------------------------------------------------------------------ holds today

@pytest.mark.parametrize("size", [1 << 60, (1 << 64) - 1, (1 << 63) - 1, LIMIT + 1, -1, -(1 << 63)])
def test_absurd_reserve_size_is_refused_without_allocating(sized, size):
    node = sized.nodes[0]
    before = vm_hwm(node.p.pid)
    reply = request(node.address, P.ReserveRequest([f"absurd/{size}", f"fine/{size}"], [size, 4096]))
    assert isinstance(reply, P.ReserveReply), reply
    assert reply.offsets[0] == -1 and reply.offsets[1] >= 0
    assert vm_hwm(node.p.pid) - before < 4 * MiB


@pytest.mark.parametrize("keys,sums,offsets", [(2, 1, 2), (1, 2, 1), (3, 3, 0), (0, 1, 1)])
def test_commit_whose_lists_differ_in_length_is_refused(sized, keys, sums, offsets):
    names = [f"mismatch/{keys}-{sums}-{offsets}/{i}" for i in range(keys)]
    reply = request(sized.nodes[0].address, P.CommitRequest(names, [0] * sums, [4096] * offsets))
    assert isinstance(reply, P.ErrorReply) and reply.code == "bad_request", reply
    with StoreClient(sized.master) as c:
        assert all(not c.exists(k) for k in names)


@pytest.mark.parametrize("blob", [
    b"\xdd\xff\xff\xff\xff",                # array32 claiming 2^32-1 items in 5 bytes
    b"\xdf\xff\xff\xff\xff",                # map32 likewise
    b"\xc6\xff\xff\xff\xf0" + b"ab",        # bin32 claiming 4 GiB
    b"\x91" * 100_000 + b"\xc0",            # 100k nested arrays
    msgpack.packb([P.VERSION, 1, ["ExistsRequest", ["a"] * 10, {}]])[:-3],   # cut short
], ids=["array32", "map32", "bin32", "deep", "truncated"])
@pytest.mark.parametrize("which", ["master", "node"])
def test_msgpack_bombs_are_refused_without_allocating(sized, blob, which):
    proc = sized.master_proc if which == "master" else sized.nodes[0]
    address = sized.master if which == "master" else sized.nodes[0].address
    before = vm_hwm(proc.p.pid)
    reply = raw_request(address, [blob])
    assert isinstance(reply, P.ErrorReply) and reply.code == "bad_request", reply
    assert vm_hwm(proc.p.pid) - before < 4 * MiB
    assert proc.alive


def test_absurd_place_sizes_do_not_break_placement(sized):
    for sizes in ([1 << 60], [-(1 << 62)], [(1 << 64) - 1, 0]):
        reply = request(sized.master, P.PlaceRequest([f"place/{i}" for i in range(len(sizes))], sizes, "h"))
        assert isinstance(reply, (P.PlaceReply, P.ErrorReply)), reply
    valid_client_works(sized, "place")


# ------------------------------------------------------------------ bugs found by the suite (fixed)

def test_oversized_header_frame_is_refused_without_allocating(sized):
    proc = sized.master_proc
    before = vm_hwm(proc.p.pid)
    reply = raw_request(sized.master, [b"\x00" * (P.MAX_HEADER_BYTES + 16 * MiB)], timeout_s=10)
    assert reply is None or isinstance(reply, P.ErrorReply), reply   # refused or disconnected
    assert proc.alive
    valid_client_works(sized, "oversized-header")
    grew = vm_hwm(proc.p.pid) - before
    assert grew < 16 * MiB, f"the master's peak memory grew {grew >> 20} MiB for one refused frame"


def test_oversized_value_frame_is_refused_without_allocating(sized):
    node = sized.nodes[0]
    before = vm_hwm(node.p.pid)
    reply = raw_request(node.address, [b"\x01" * (64 * MiB)], timeout_s=10)
    assert reply is None, reply     # over MAXMSGSIZE: ZeroMQ drops the peer
    assert node.alive
    grew = vm_hwm(node.p.pid) - before
    assert grew < 16 * MiB, f"the node's peak memory grew {grew >> 20} MiB for one refused 64 MiB value"


def test_request_with_millions_of_keys_does_not_stall_the_master(sized):
    expired = sized.stats()["nodes_expired"]
    header = msgpack.packb([P.VERSION, 1, ["ExistsRequest", [""] * 2_000_000, {}]])
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(sized.master)
    try:
        sock.send(header)
        time.sleep(0.1)                                  # the master is decoding it now
        t0 = time.monotonic()
        reply = request(sized.master, P.StatsRequest(), timeout_s=10)
        waited = time.monotonic() - t0
        sock.poll(30_000)                                # let the big one finish either way
    finally:
        sock.close()
    sized.wait_nodes(2)
    assert isinstance(reply, P.StatsReply)
    assert reply.stats["nodes_expired"] == expired, "nodes were expired while the master was busy"
    assert waited < 1.0, f"the master did not answer a Stats request for {waited:.1f} s"


def test_hostile_checksum_or_key_is_not_taken_for_a_disk_failure(sized):
    node = sized.nodes[1]
    for keys, sums in ([["neg/checksum"], [-1]], [["k" * 70_000], [0]]):
        reply = request(node.address, P.CommitRequest(keys, sums, [4096]))
        assert isinstance(reply, (P.CommitReply, P.ErrorReply)), reply
    time.sleep(3 * sized.heartbeat_s)                    # the counters travel with heartbeats
    assert node_stats(sized, 1).get("ssd_write_errors", 0) == 0
    assert "ssd tier unusable" not in node.log()


def test_register_with_wrongly_typed_node_record_is_refused(sized):
    bogus = {"node_id": "bogus", "address": "tcp://127.0.0.1:1", "host": "h", "shm_path": "/nonexistent",
             "capacity": "big"}
    reply = request(sized.master, P.RegisterRequest(bogus))
    place = request(sized.master, P.PlaceRequest(["reg/a"], [10], "h"))
    stats = request(sized.master, P.StatsRequest())
    time.sleep(sized.heartbeat_s * sized.liveness + 0.5)   # let a registered fake expire either way
    assert isinstance(reply, P.ErrorReply) and reply.code == "bad_request", reply
    assert isinstance(place, P.PlaceReply), place
    assert isinstance(stats, P.StatsReply), stats
