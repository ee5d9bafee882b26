"""Copy-and-hash helpers and several requests in flight on one channel."""
import time

import numpy as np
import pytest
import xxhash
import zmq

from hicache_mc import protocol as P
from hicache_mc.errors import StoreUnavailable
from hicache_mc.rpc import Channel
from hicache_mc.transport import base


@pytest.mark.parametrize("sizes", [[0], [1], [base.CHUNK - 1, base.CHUNK, base.CHUNK + 1],
                                   [3 << 20, 5, 1 << 20, 0, 700_001]])
def test_copy_many_copies_and_hashes_like_one_shot_xxh3(sizes):
    rng = np.random.default_rng(len(sizes))
    srcs = [rng.integers(0, 256, s, dtype=np.uint8) for s in sizes]
    dsts = [np.zeros(s, dtype=np.uint8) for s in sizes]
    addr = lambda a: a.ctypes.data if a.nbytes else 1   # noqa: E731 (any address for 0 bytes)
    sums = base.copy_many([addr(d) for d in dsts], [addr(s) for s in srcs], sizes)
    assert sums == [xxhash.xxh3_64_intdigest(s) for s in srcs]
    assert all(np.array_equal(a, b) for a, b in zip(srcs, dsts))
    assert base.hash_many([addr(s) for s in srcs], sizes) == sums
    assert base.copy_many([addr(d) for d in dsts], [addr(s) for s in srcs], sizes, digest=False) == [None] * len(sizes)


@pytest.mark.parametrize("sizes,parts", [([5] * 10, 2), ([100, 1, 1, 1], 2), ([1], 4), ([3, 3, 3], 4)])
def test_split_covers_every_index_once_in_order(sizes, parts):
    ranges = base._split(sizes, parts)
    assert [i for r in ranges for i in r] == list(range(len(sizes)))
    assert len(ranges) <= parts


def test_groups_cap_bytes_but_keep_big_items_alone():
    assert base.groups([4, 4, 4, 10, 1], 8) == [[0, 1], [2], [3], [4]]


def test_channel_drops_replies_it_no_longer_awaits(store):
    ctx = zmq.Context()
    ch = Channel(ctx, store.master)
    try:
        deadline = time.monotonic() + 5
        forgotten = ch.send(P.StatsRequest())
        ch.forget([forgotten])
        with pytest.raises(StoreUnavailable):
            ch.recv(forgotten, deadline)
        # the forgotten request's reply comes first and is dropped on the way
        assert isinstance(ch.call(P.ExistsRequest(["b"]), 5), P.ExistsReply)
        assert not ch._waiting
    finally:
        ch.close()
        ctx.term()


def test_channel_to_a_port_nobody_listens_on_fails_at_once_and_queues_nothing():
    from procs import free_port
    ctx = zmq.Context()
    ch = Channel(ctx, f"tcp://127.0.0.1:{free_port()}")
    try:
        for _ in range(3):
            t0 = time.monotonic()
            with pytest.raises(StoreUnavailable, match="refused"):
                ch.call(P.StatsRequest(), 5)
            assert time.monotonic() - t0 < 1.0
        ch._connect()
        time.sleep(0.3)         # ZeroMQ's own reconnecting is off: one failed attempt, no more
        events = 0
        while ch.link.events.poll(0):
            ch.link.events.recv_multipart()
            events += 1
        assert events <= 3
    finally:
        ch.close()
        ctx.term()
