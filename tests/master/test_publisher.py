"""The residency publisher in-process (no token): how a turn's changes are cut into messages."""
import time

import zmq

from hicache_mc import residency as R
from hicache_mc.auth import Guard
from hicache_mc.master import publisher as pub_mod
from hicache_mc.master.publisher import Publisher

NS = "0123456789abcdef@t"


def _pair():
    ctx = zmq.Context.instance()
    pub = Publisher(ctx, Guard(ctx, ""), "127.0.0.1", 0, "epoch", 10.0)
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, R.topic(NS))
    sub.connect(f"tcp://127.0.0.1:{pub.port}")
    end = time.monotonic() + 5
    while not pub.counters["residency_subscriptions"]:
        assert time.monotonic() < end, "subscription never reached the publisher"
        pub.sock.poll(50)
        pub.on_readable()
    return pub, sub


def _updates(sub, n: int) -> list:
    out = []
    while len(out) < n:
        assert sub.poll(5000), f"{len(out)} of {n} updates"
        topic, body = sub.recv_multipart()
        u = R.decode(body)
        if not u.beat:
            out.append(u)
    return out


def test_a_turn_cut_into_chunks_names_its_reports_on_the_last_chunk_only():
    pub, sub = _pair()
    try:
        digests = {i.to_bytes(16, "little"): True for i in range(R.CHUNK + 5)}
        moved = {"node-a": ("seg", 7)}
        pub.flush({NS: digests}, lambda: {}, moved, 0.0)
        first, last = _updates(sub, 2)
        assert (first.seq, last.seq) == (1, 2)
        assert len(first.added) == 16 * R.CHUNK and len(last.added) == 16 * 5
        # a view that applied only the first chunk must not take node-a's report 7 as seen
        assert first.nodes == {} and last.nodes == {"node-a": ("seg", 7)}
    finally:
        sub.close(0)
        pub.close()


def test_key_updates_are_cut_by_bytes_as_well_as_by_count():
    big = [(f"{NS}/{'x' * 900}{i}", True) for i in range(20_000)]    # ~18 MB of key text
    parts = pub_mod._key_chunks(big)
    assert sum(map(len, parts)) == len(big) and [k for p in parts for k in p] == big
    assert all(sum(len(k) for k, _ in p) <= pub_mod.KEY_CHUNK_BYTES for p in parts)
    small = [(f"{NS}/{i}", False) for i in range(R.CHUNK + 1)]
    assert [len(p) for p in pub_mod._key_chunks(small)] == [R.CHUNK, 1]


def test_a_forgotten_namespace_numbers_on_above_every_number_given():
    """A namespace with no keys and no subscriber is forgotten; its next update, and any other
    new namespace's, is numbered above every number handed out before, so a view holding an
    old snapshot sees a gap or the next number, never a number it has seen."""
    ctx = zmq.Context.instance()
    sizes = {NS: 1, "other": 1}
    pub = Publisher(ctx, Guard(ctx, ""), "127.0.0.1", 0, "epoch", 10.0, size=lambda ns: sizes.get(ns, 0))
    try:
        d = (1).to_bytes(16, "little")
        pub.flush({NS: {d: True}}, lambda: {}, {}, 0.0)
        pub.flush({NS: {d: False}, "other": {d: True}}, lambda: {}, {}, 0.0)
        assert pub.seq == {NS: 2, "other": 1} and pub.namespaces == 2      # NS still has a key
        sizes[NS] = 0
        pub.flush({NS: {d: False}}, lambda: {}, {}, 0.0)
        assert NS not in pub.seq and pub.floor == 3 and pub.namespaces == 1
        assert pub.snapshot(NS, _Empty(), {}).seq == 3          # a view starts at the floor
        sizes[NS] = 1
        pub.flush({NS: {d: True}}, lambda: {}, {}, 0.0)
        assert pub.seq[NS] == 4
    finally:
        pub.close()


class _Empty:
    def namespace_size(self, ns):
        return 0

    def digests(self, ns):
        return b""
