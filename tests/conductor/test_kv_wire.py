"""SGLang's KV-event wire, decoded by the conductor without sglang: batches encoded by SGLang's
own structs and encoder, as its ZmqEventPublisher sends them."""
from __future__ import annotations

import msgspec
from sglang.srt.disaggregation.kv_events import (AllBlocksCleared, BlockRemoved, BlockStored,
                                                 KVEventBatch, StorageMedium)

from hicache_mc.conductor import kv_wire
from hicache_mc.conductor.api import BlocksRemoved, BlocksStored, Cleared, Tier

ENCODE = msgspec.msgpack.Encoder().encode       # the publisher thread's encoder


def frames(seq: int, batch) -> list:
    return [b"topic", seq.to_bytes(8, "big"), ENCODE(batch)]


def test_sglang_batch_becomes_router_events_per_tier():
    batch = KVEventBatch(ts=1.0, events=[
        BlockStored(block_hashes=[11, 12], parent_block_hash=None, token_ids=[1, 2, 3, 4],
                    block_size=2, lora_id=None, medium=StorageMedium.GPU.value),
        BlockStored(block_hashes=[13], parent_block_hash=12, token_ids=[5, 6], block_size=2,
                    lora_id=None, medium=StorageMedium.CPU.value, cache_salt="s", session_id="x"),
        BlockRemoved(block_hashes=[11], medium=StorageMedium.GPU.value),
        BlockStored(block_hashes=[14], parent_block_hash=None, token_ids=[7, 8], block_size=2,
                    lora_id=None),                              # no medium: SGLang's GPU
        BlockStored(block_hashes=[15], parent_block_hash=None, token_ids=[9, 9], block_size=2,
                    lora_id=None, medium=StorageMedium.EXTERNAL.value),
        AllBlocksCleared()], attn_dp_rank=0)
    f = kv_wire.parse(frames(41, batch))
    assert f.seq == 41
    events, skipped = kv_wire.to_api("w", f.batch)
    assert events == [BlocksStored("w", Tier.GPU, [11, 12]), BlocksStored("w", Tier.HOST, [13]),
                      BlocksRemoved("w", Tier.GPU, [11]), BlocksStored("w", Tier.GPU, [14]),
                      Cleared("w")]
    assert skipped == 1                          # EXTERNAL: the L3 comes from the view


def test_malformed_frames_are_refused_not_raised():
    assert kv_wire.parse([b"t", b"\x00" * 8]) is None                     # two frames
    assert kv_wire.parse([b"t", b"\x01", b""]) is None                    # a short number
    bad = kv_wire.parse([b"t", (7).to_bytes(8, "big"), b"\xc1garbage"])
    assert bad.seq == 7 and bad.batch is None
    odd = kv_wire.parse([b"t", (8).to_bytes(8, "big"), ENCODE([1.0, [{"type": "Mystery"}], 0])])
    assert odd.seq == 8 and odd.batch is None
