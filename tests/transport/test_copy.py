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


def test_channel_keeps_several_requests_in_flight(store):
    ctx = zmq.Context()
    ch = Channel(ctx, store.master)
    try:
        deadline = time.monotonic() + 5
        first = ch.send(P.ExistsRequest(["a"]))
        second = ch.send(P.StatsRequest())
        # asked for in the other order: the first reply is kept until it is asked for
        assert isinstance(ch.recv(second, deadline), P.StatsReply)
        assert isinstance(ch.recv(first, deadline), P.ExistsReply)
        third = ch.send(P.StatsRequest())
        ch.forget([third])
        with pytest.raises(StoreUnavailable):
            ch.recv(third, deadline)
        assert isinstance(ch.call(P.ExistsRequest(["b"]), 5), P.ExistsReply)   # its reply was dropped
        assert not ch._early
    finally:
        ch.close()
        ctx.term()


def test_channel_ready_never_waits_and_keeps_the_reply(store):
    ctx = zmq.Context()
    ch = Channel(ctx, store.master)
    try:
        rid = ch.send(P.StatsRequest())
        other = ch.send(P.ExistsRequest(["a"]))
        end = time.monotonic() + 5
        while not ch.ready(rid):
            assert time.monotonic() < end
        assert isinstance(ch.recv(rid, 0), P.StatsReply)       # here already: no wait
        # a timed-out recv that does not reset keeps the request awaited (unless the reply
        # was quick enough to be there already)
        late = ch.send(P.StatsRequest())
        try:
            got = ch.recv(late, 0, reset=False)
        except StoreUnavailable:
            assert late in ch._waiting
            got = ch.recv(late, time.monotonic() + 5)
        assert isinstance(got, P.StatsReply)
        assert isinstance(ch.recv(other, time.monotonic() + 5), P.ExistsReply)
    finally:
        ch.close()
        ctx.term()
