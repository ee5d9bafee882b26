"""The bodies a stand-in worker answers with: SGLang 0.5.23's OpenAI-compatible and native
shapes, non-streaming and as SSE chunks (``data: <json>\\n\\n``, then ``data: [DONE]``)."""
from __future__ import annotations

import json
import time
from dataclasses import dataclass


@dataclass
class Out:
    """What one request produced so far."""
    rid: str
    model: str
    prompt_tokens: int
    cached: dict                 # {"device": n, "host": n, "storage": n} in tokens
    ids: list
    text: str = ""
    finished: bool = False
    e2e_s: float = 0.0

    @property
    def cached_tokens(self) -> int:
        return sum(self.cached.values())

    def usage(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": len(self.ids),
                "total_tokens": self.prompt_tokens + len(self.ids),
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}

    def meta_info(self) -> dict:
        meta = {"id": self.rid, "finish_reason": None, "prompt_tokens": self.prompt_tokens,
                "weight_version": "default", "completion_tokens": len(self.ids),
                "cached_tokens": self.cached_tokens,
                "cached_tokens_details": dict(self.cached, storage_backend="HiCacheMC")}
        if self.finished:
            meta["finish_reason"] = {"type": "length", "length": len(self.ids)}
            meta["e2e_latency"] = self.e2e_s
        return meta


def sse(doc) -> bytes:
    return b"data: " + json.dumps(doc).encode() + b"\n\n"


DONE = b"data: [DONE]\n\n"


def chat_chunk(o: Out, delta: dict, finish=None) -> dict:
    return {"id": o.rid, "object": "chat.completion.chunk", "created": int(time.time()),
            "model": o.model, "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                           "finish_reason": finish, "matched_stop": None}],
            "usage": None}


def chat_full(o: Out) -> dict:
    return {"id": o.rid, "object": "chat.completion", "created": int(time.time()), "model": o.model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": o.text,
                                                  "reasoning_content": None, "tool_calls": None},
                         "logprobs": None, "finish_reason": "length", "matched_stop": None}],
            "usage": o.usage(), "metadata": {"weight_version": "default"}}


def text_chunk(o: Out, piece: str, finish=None) -> dict:
    return {"id": o.rid, "object": "text_completion", "created": int(time.time()), "model": o.model,
            "choices": [{"index": 0, "text": piece, "logprobs": None, "finish_reason": finish,
                         "matched_stop": None}], "usage": None}


def text_full(o: Out) -> dict:
    return {"id": o.rid, "object": "text_completion", "created": int(time.time()), "model": o.model,
            "choices": [{"index": 0, "text": o.text, "logprobs": None, "finish_reason": "length",
                         "matched_stop": None}], "usage": o.usage(),
            "metadata": {"weight_version": "default"}}


def generate_doc(o: Out) -> dict:
    return {"text": o.text, "output_ids": list(o.ids), "meta_info": o.meta_info()}


def usage_chunk(o: Out, obj: str) -> dict:
    return {"id": o.rid, "object": obj, "created": int(time.time()), "model": o.model,
            "choices": [], "usage": o.usage()}


def error(status: int, message: str) -> dict:
    return {"object": "error", "message": message, "type": "BadRequestError" if status < 500
            else "InternalServerError", "param": None, "code": status}
