"""A router's side of the L3 event stream: which blocks of a prefix the L3 holds.

    python -m hicache_mc.sglang.kv_events --master tcp://127.0.0.1:7370 --namespace NS &
    python examples/l3_events_consumer.py --namespace NS --prefix HASH1,HASH2,HASH3

Subscribes to the bridge's PUB endpoint (SGLang's KV-event format), asks its replay endpoint for
the batches it has buffered, then follows live batches, checking their sequence numbers (a gap:
replay from the last one seen). It keeps the set of block hashes the L3 holds and, every
``--every`` seconds, prints for the prefix (SGLang page hashes, hex, in order: what
``get_hash_str`` chains over a prompt's pages) which of its pages the L3 holds and the leading
run a prefetch would read.
"""
from __future__ import annotations

import argparse
import time

import msgspec
import zmq

END = (-1).to_bytes(8, "big", signed=True)


def to_int64(page_hash: str) -> int:
    """SGLang's hash_str_to_int64: the first 16 hex digits as a signed 64-bit int."""
    v = int(page_hash[:16], 16)
    return v - (1 << 64) if v >= 1 << 63 else v


class Event(msgspec.Struct, tag_field="type", tag=True, omit_defaults=True):
    pass


class BlockStored(Event):
    block_hashes: list[int]
    parent_block_hash: int | None = None
    token_ids: list = []
    block_size: int = 0
    lora_id: int | None = None
    medium: str | None = None


class BlockRemoved(Event):
    block_hashes: list[int]
    medium: str | None = None


class AllBlocksCleared(Event):
    pass


class Batch(msgspec.Struct, array_like=True):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    attn_dp_rank: int | None = None


DECODE = msgspec.msgpack.Decoder(Batch)


class Holdings:
    def __init__(self):
        self.blocks: set[int] = set()
        self.last_seq = -1

    def apply(self, seq: int, payload: bytes) -> None:
        if seq <= self.last_seq:
            return
        self.last_seq = seq
        for e in DECODE.decode(payload).events:
            if isinstance(e, BlockStored):
                self.blocks.update(e.block_hashes)
            elif isinstance(e, BlockRemoved):
                self.blocks.difference_update(e.block_hashes)
            elif isinstance(e, AllBlocksCleared):
                self.blocks.clear()


def replay(ctx: zmq.Context, endpoint: str, start: int, held: Holdings) -> None:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        sock.send_multipart([b"", start.to_bytes(8, "big")])
        while sock.poll(5000):
            _, _topic, seq, payload = sock.recv_multipart()
            if seq == END:
                return
            held.apply(int.from_bytes(seq, "big"), payload)
        print("replay: no answer in 5 s")
    finally:
        sock.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--namespace", required=True, help="the topic: the deployment's namespace")
    ap.add_argument("--endpoint", default="tcp://127.0.0.1:5557")
    ap.add_argument("--replay-endpoint", default="tcp://127.0.0.1:5558")
    ap.add_argument("--prefix", default="", help="comma-separated page hashes (hex), in order")
    ap.add_argument("--every", type=float, default=2.0)
    ap.add_argument("--seconds", type=float, default=0, help="stop after this long (0: never)")
    args = ap.parse_args()
    prefix = [h.strip() for h in args.prefix.split(",") if h.strip()]
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, args.namespace.encode())
    sub.connect(args.endpoint)
    held = Holdings()
    replay(ctx, args.replay_endpoint, 0, held)
    start, next_print = time.monotonic(), 0.0
    while not args.seconds or time.monotonic() - start < args.seconds:
        if sub.poll(100):
            _topic, seq_b, payload = sub.recv_multipart()
            seq = int.from_bytes(seq_b, "big")
            if seq > held.last_seq + 1:     # missed some: the replay buffer has them
                replay(ctx, args.replay_endpoint, held.last_seq + 1, held)
            held.apply(seq, payload)
        if time.monotonic() >= next_print:
            next_print = time.monotonic() + args.every
            marks = ["x" if to_int64(h) in held.blocks else "." for h in prefix]
            run = (marks + ["."]).index(".")
            print(f"seq {held.last_seq}: the L3 holds {len(held.blocks)} blocks"
                  + (f"; prefix {''.join(marks)}: {run} of {len(prefix)} pages from the start"
                     if prefix else ""), flush=True)


if __name__ == "__main__":
    main()
