"""SGLang's KV-event wire, decoded without importing sglang.

A publisher (``ZmqEventPublisher``, sglang/srt/disaggregation/kv_events.py) sends, on its PUB
socket, frames ``[topic, 8-byte big-endian sequence number, msgpack KVEventBatch]``; a batch
is the array ``[ts, [event, ...], attn_dp_rank]`` and an event a map tagged by ``"type"``
(``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``; fields it does not know are
ignored). Its replay socket (ROUTER) answers ``[b"", start seq]`` with every buffered batch
from that number on, as ``[b"", topic, seq, payload]`` frames, then ``[b"", b"", -1, b""]``.

``to_api`` turns a batch into the router's observations: medium ``GPU`` (or none, SGLang's
default) is L1, ``CPU_PINNED`` L2; other media (``DISK``, ``EXTERNAL``: an L3 the router
reads from the residency view) are counted and skipped.
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Union

import msgspec

from .api import BlocksRemoved, BlocksStored, Cleared, Event, Tier

END_SEQ = -1
MAX_FRAME = 16 << 20           # a batch larger than this is refused (SGLang's for a 128k-token
#                                prefill, token ids included, is ~1 MiB)


class BlockStored(msgspec.Struct, tag_field="type", tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: Optional[int] = None
    medium: Optional[str] = None


class BlockRemoved(msgspec.Struct, tag_field="type", tag="BlockRemoved"):
    block_hashes: list[int]
    medium: Optional[str] = None


class AllBlocksCleared(msgspec.Struct, tag_field="type", tag="AllBlocksCleared"):
    pass


class Batch(msgspec.Struct, array_like=True):
    ts: float
    events: list[Union[BlockStored, BlockRemoved, AllBlocksCleared]]
    attn_dp_rank: Optional[int] = None


_decode = msgspec.msgpack.Decoder(Batch).decode
TIERS = {None: Tier.GPU, "GPU": Tier.GPU, "CPU_PINNED": Tier.HOST}


class Frame(NamedTuple):
    seq: int
    batch: Optional[Batch]        # None: undecodable (counted, skipped)


def parse(frames: list) -> Optional[Frame]:
    """A PUB message ``[topic, seq, payload]``; None for a malformed one."""
    if len(frames) != 3 or len(frames[1]) != 8:
        return None
    seq = int.from_bytes(frames[1], "big", signed=True)
    try:
        return Frame(seq, _decode(frames[2]))
    except (msgspec.DecodeError, msgspec.ValidationError):
        return Frame(seq, None)


def to_api(worker: str, batch: Batch) -> tuple[list[Event], int]:
    """The batch's events as the router's, and how many it skipped (other media)."""
    out: list[Event] = []
    skipped = 0
    for e in batch.events:
        if isinstance(e, AllBlocksCleared):
            out.append(Cleared(worker))
            continue
        tier = TIERS.get(e.medium)
        if tier is None:
            skipped += 1
        elif isinstance(e, BlockStored):
            out.append(BlocksStored(worker, tier, e.block_hashes))
        else:
            out.append(BlocksRemoved(worker, tier, e.block_hashes))
    return out, skipped
