"""What the conductor reads back from SGLang's answers: usage, cached tokens per tier, the
worker's own TTFT; bodies in the shapes SGLang 0.5.23 writes (the stand-ins' formats.py)."""
from __future__ import annotations

import json

from hicache_mc.conductor import usage
from hicache_mc.conductor.api import Tier
from standin import formats as F


def out(**kw) -> F.Out:
    o = F.Out("r1", "m", 300, {"device": 64, "host": 32, "storage": 128}, [1, 2, 3], "abc", True, 0.5)
    for k, v in kw.items():
        setattr(o, k, v)
    return o


def test_generate_meta_info_gives_the_tier_split():
    u = usage.parse(json.dumps(F.generate_doc(out())).encode(), streamed=False)
    assert u == usage.Usage(300, 3, {Tier.GPU: 64, Tier.HOST: 32, Tier.L3: 128}, None)


def test_openai_usage_without_a_split_is_unsplit():
    u = usage.parse(json.dumps(F.chat_full(out())).encode(), streamed=False)
    assert u.prompt_tokens == 300 and u.completion_tokens == 3
    assert u.cached == {usage.UNSPLIT: 224}


def test_stream_usage_comes_from_the_last_events():
    o = out()
    body = b"".join([F.sse(F.chat_chunk(o, {"content": "x"})), F.sse(F.chat_chunk(o, {}, "length")),
                     F.sse(F.usage_chunk(o, "chat.completion.chunk")), F.DONE])
    assert usage.parse(body, streamed=True).prompt_tokens == 300
    gen = b"".join([F.sse(F.generate_doc(o)), F.DONE])
    meta = dict(F.generate_doc(o), meta_info=dict(o.meta_info(), first_token_latency=0.25))
    assert usage.parse(gen, streamed=True).cached[Tier.L3] == 128
    assert usage.parse(F.sse(meta) + F.DONE, streamed=True).worker_ttft_s == 0.25


def test_no_usage_is_none():
    o = out()
    assert usage.parse(F.sse(F.chat_chunk(o, {"content": "x"})) + F.DONE, streamed=True) is None
    assert usage.parse(b"not json", streamed=False) is None
    assert usage.parse(b"data: {\"trunc", streamed=True) is None
