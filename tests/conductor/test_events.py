"""One worker's KV-event stream against SGLang's own ZmqEventPublisher (in this process, real
sockets): catch-up from the replay endpoint, gaps filled from it, a restarted publisher,
and the stall judgement by expectation."""
from __future__ import annotations

import asyncio
import time

import msgspec
import pytest
import zmq.asyncio
from sglang.srt.disaggregation.kv_events import BlockStored, KVEventBatch, ZmqEventPublisher

from hicache_mc.conductor.api import BlocksStored, Cleared, StreamHealth, Tier
from hicache_mc.conductor.events import EventStream


def batch(*hashes: int) -> KVEventBatch:
    return KVEventBatch(ts=time.time(), events=[BlockStored(
        block_hashes=list(hashes), parent_block_hash=None, token_ids=[1] * len(hashes),
        block_size=1, lora_id=None, medium="GPU")])


async def until(cond, timeout_s: float = 5.0) -> None:
    end = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < end, "timed out"
        await asyncio.sleep(0.01)


class Rig:
    """A publisher, a stream following it (its SUB pointed wherever a test says), what the
    stream passed on."""

    def __init__(self, sub_endpoint=None, stall_s: float = 0.3):
        self.pub = ZmqEventPublisher(0, "tcp://127.0.0.1:*", "tcp://127.0.0.1:*", bind=True)
        src = self.pub.describe_local_source(1)
        self.got: list = []
        self.stream = EventStream(zmq.asyncio.Context.instance(), "w", sub_endpoint or src["endpoint"],
                                  src["replay_endpoint"], self.got.extend, stall_s=stall_s)

    def stored(self) -> list[int]:
        return [h for e in self.got if isinstance(e, BlocksStored) for h in e.block_hashes]

    def close(self) -> None:
        self.stream.stop()
        self.pub.shutdown()


@pytest.fixture
def rig():
    r = Rig()
    yield r
    r.close()


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


def test_catch_up_then_follow(rig):
    async def go():
        rig.pub.publish(batch(1))                 # before the stream exists: only in replay
        rig.pub.publish(batch(2))
        await asyncio.sleep(0.2)
        task = asyncio.ensure_future(rig.stream.run())
        await until(lambda: rig.stored() == [1, 2])
        await until(lambda: rig.stream.connected)
        rig.pub.publish(batch(3))
        await until(lambda: rig.stored() == [1, 2, 3])
        assert rig.got[0] == BlocksStored("w", Tier.GPU, [1])
        rig.stream.stop()
        await task
    run(go())


def test_a_gap_in_the_numbers_is_filled_from_replay(rig):
    async def go():
        rig.pub.publish(batch(1))
        await asyncio.sleep(0.2)
        # the stream missed seq 0..1 on SUB (it saw seq 2 first): it asks the replay endpoint
        rig.pub.publish(batch(2))
        rig.pub.publish(batch(3))
        await asyncio.sleep(0.2)
        rig.stream.last = 0                         # as if seq 0 had been applied
        frames = [b"", (2).to_bytes(8, "big"), msgspec.msgpack.encode(batch(3))]
        await rig.stream.receive(frames)
        assert rig.stored() == [2, 3] and rig.stream.last == 2
        assert rig.stream.counters.gaps == 1 and rig.stream.counters.lost == 0
    run(go())


def test_a_publisher_starting_over_clears_the_worker(rig):
    async def go():
        rig.stream.last = 41
        frames = [b"", (0).to_bytes(8, "big"), msgspec.msgpack.encode(batch(9))]
        await rig.stream.receive(frames)
        assert rig.got[0] == Cleared("w") and rig.stored() == [9] and rig.stream.last == 0
    run(go())


def test_expected_events_that_do_not_come_mark_the_stream_stalled_until_they_do(rig):
    async def go():
        task = asyncio.ensure_future(rig.stream.run())
        await until(lambda: rig.stream.connected)
        rig.pub.publish(batch(1))
        await until(lambda: rig.stored() == [1])
        sent = time.monotonic()
        rig.stream.expect(sent)                     # nothing published since: a stall
        await until(lambda: StreamHealth("w", False) in rig.got)
        assert rig.stream.counters.stalls == 1
        rig.pub.publish(batch(2))                   # the stream resumes
        await until(lambda: rig.got[-2:] == [BlocksStored("w", Tier.GPU, [2]), StreamHealth("w", True)])
        rig.stream.stop()
        await task
    run(go())


def test_a_batch_heard_after_the_request_was_sent_meets_the_expectation(rig):
    async def go():
        task = asyncio.ensure_future(rig.stream.run())
        await until(lambda: rig.stream.connected)
        sent = time.monotonic()
        rig.pub.publish(batch(1))                   # the request's events, before its answer
        await until(lambda: rig.stored() == [1])
        rig.stream.expect(sent)                     # the answer arrives after them
        await asyncio.sleep(rig.stream.stall_s * 3)
        assert rig.stream.live and rig.stream.counters.stalls == 0
        rig.stream.stop()
        await task
    run(go())


def test_a_busy_loop_does_not_stop_the_input(rig):
    """The SUB socket is read on a thread of its own: while the loop is busy (a stretch of
    tokenization, say) the frames pile up in the stream's own bounded queue, none dropped,
    none lost, rather than in ZeroMQ's pipe, whose stopped input aborts the process in
    libzmq 4.3.5 once the connection is replaced (zeromq/libzmq#3937: seen once under a
    replayed trace, not reproduced on demand; this checks the queue path, not the crash)."""
    async def go():
        task = asyncio.ensure_future(rig.stream.run())
        await until(lambda: rig.stream.connected)
        for i in range(3000):
            rig.pub.publish(batch(i))
        time.sleep(2.0)                            # the loop does nothing else meanwhile
        await until(lambda: len(rig.stored()) == 3000, 20)
        assert rig.stream.counters.gaps == 0 and rig.stream.counters.lost == 0
        rig.stream.stop()
        await task
        assert rig.stream.counters.dropped == 0
    run(go())
