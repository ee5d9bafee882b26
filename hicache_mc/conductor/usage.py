"""What a worker's answer says about the request it served: prompt and completion tokens, the
cached tokens per tier, and the worker's own TTFT when it reports one.

SGLang puts them in ``meta_info`` (``/generate``: ``prompt_tokens``, ``completion_tokens``,
``cached_tokens``, ``cached_tokens_details`` = ``{device, host, storage}`` with HiCache, and
``first_token_latency`` with ``--enable-metrics``) and in the OpenAI ``usage``
(``prompt_tokens_details.cached_tokens`` with ``--enable-cache-report``). A streamed answer
carries them in its last events (the usage chunk with ``stream_options.include_usage``; every
``/generate`` chunk has ``meta_info``). A cached total without its split is reported under
``UNSPLIT``.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import orjson

from .api import Tier

TIERS = {"device": Tier.GPU, "host": Tier.HOST, "storage": Tier.L3}
UNSPLIT = "unsplit"


class Usage(NamedTuple):
    prompt_tokens: int
    completion_tokens: int
    cached: dict                      # Tier (or UNSPLIT) -> tokens
    worker_ttft_s: Optional[float]    # SGLang's first_token_latency, when it reports it


def parse(tail: bytes, streamed: bool) -> Optional[Usage]:
    """The usage in an answer's body (non-streaming) or its last SSE events; None if none."""
    docs = _events(tail) if streamed else [_load(tail)]
    for doc in docs:
        u = _from_doc(doc)
        if u is not None:
            return u
    return None


def _events(tail: bytes) -> list:
    """The SSE events' JSON documents, last first."""
    out = []
    for block in reversed(tail.split(b"\n\n")):
        block = block.strip()
        if block.startswith(b"data:") and block[5:].strip() != b"[DONE]":
            doc = _load(block[5:])
            if doc is not None:
                out.append(doc)
    return out


def _load(data: bytes):
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return None


def _from_doc(doc) -> Optional[Usage]:
    if isinstance(doc, list):
        doc = doc[0] if doc else None
    if not isinstance(doc, dict):
        return None
    meta = doc.get("meta_info")
    if isinstance(meta, dict) and "prompt_tokens" in meta:
        return _from_meta(meta)
    usage = doc.get("usage")
    if isinstance(usage, dict) and "prompt_tokens" in usage:
        details = usage.get("prompt_tokens_details") or {}
        split = _split((doc.get("sglext") or {}).get("cached_tokens_details"))
        total = int(details.get("cached_tokens") or 0) if isinstance(details, dict) else 0
        return Usage(int(usage["prompt_tokens"]), int(usage.get("completion_tokens") or 0),
                     split if split is not None else ({UNSPLIT: total} if total else {}), None)
    return None


def _from_meta(meta: dict) -> Usage:
    split = _split(meta.get("cached_tokens_details"))
    total = int(meta.get("cached_tokens") or 0)
    ttft = meta.get("first_token_latency")
    return Usage(int(meta["prompt_tokens"]), int(meta.get("completion_tokens") or 0),
                 split if split is not None else ({UNSPLIT: total} if total else {}),
                 float(ttft) if isinstance(ttft, (int, float)) else None)


def _split(details) -> Optional[dict]:
    if not isinstance(details, dict):
        return None
    return {tier: int(details.get(key) or 0) for key, tier in TIERS.items() if details.get(key)}
