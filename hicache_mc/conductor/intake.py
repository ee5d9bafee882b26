"""An incoming generation request read for routing: its kind, whether it streams, its bound on
new tokens, its SLOs, and its prompt's token ids and page chain (when they can be known).

Bodies are OpenAI's (``/v1/chat/completions``, ``/v1/completions``) or SGLang's native
``/generate``; only the fields routing needs are read, and the body itself is forwarded as it
came. SLOs per request come from the ``X-Conductor-TTFT-SLO`` / ``X-Conductor-TBT-SLO``
headers (seconds); the router's defaults apply otherwise.
"""
from __future__ import annotations

import enum
from typing import Any, NamedTuple, Optional

from .chain import PLAIN, CacheNamespace, chain
from .prompts import PromptTokenizer, Unroutable


class Kind(enum.Enum):
    CHAT = "/v1/chat/completions"
    COMPLETION = "/v1/completions"
    GENERATE = "/generate"


class BadRequest(ValueError):
    """The body is not a request this endpoint takes (answered 400)."""


class Intake(NamedTuple):
    stream: bool
    max_new_tokens: int
    ttft_slo_s: Optional[float]
    tbt_slo_s: Optional[float]
    tokens: Optional[list]            # None: unroutable (load-only)
    unroutable: str                   # why, when tokens is None
    page_hashes: list
    block_hashes: Optional[list]      # None: the plain chain's (page hash prefixes)
    prompt_tokens: int


def read(kind: Kind, doc: Any, headers, prompts: Optional[PromptTokenizer], page_size: int) -> Intake:
    if not isinstance(doc, dict):
        raise BadRequest("the body is not a JSON object")
    stream = bool(doc.get("stream"))
    if kind is Kind.GENERATE:
        params = doc.get("sampling_params") or {}
        max_new = params.get("max_new_tokens") if isinstance(params, dict) else None
    else:
        max_new = doc.get("max_completion_tokens") or doc.get("max_tokens")
    if max_new is not None and (not isinstance(max_new, int) or isinstance(max_new, bool) or max_new < 0):
        raise BadRequest("max_tokens must be a non-negative integer")
    tokens, why = _tokens(kind, doc, prompts)
    ns = _namespace(doc)
    pages: list = []
    blocks = None
    if tokens is not None and page_size > 0:
        c = chain(tokens, page_size, ns)
        pages = c.page_hashes
        blocks = None if ns.plain else c.block_hashes
    prompt = len(tokens) if tokens is not None else _guess_tokens(doc)
    return Intake(stream, int(max_new or 0), _slo(headers, "X-Conductor-TTFT-SLO"),
                  _slo(headers, "X-Conductor-TBT-SLO"), tokens, why, pages, blocks, prompt)


def _tokens(kind: Kind, doc: dict, prompts: Optional[PromptTokenizer]):
    if prompts is None:
        return None, "no tokenizer"
    if doc.get("lora_path") or doc.get("image_data") or doc.get("audio_data") or \
            doc.get("video_data") or doc.get("n", 1) not in (1, None):
        return None, "lora, multimodal or n > 1"
    try:
        if kind is Kind.CHAT:
            return prompts.chat(doc), ""
        if kind is Kind.COMPLETION:
            return prompts.text(doc.get("prompt")), ""
        return prompts.generate(doc), ""
    except Unroutable as exc:
        return None, str(exc)
    except Exception as exc:          # a template error on odd input: still served, on load
        return None, f"tokenization failed: {type(exc).__name__}"


def _namespace(doc: dict) -> CacheNamespace:
    extra, salt = doc.get("extra_key"), doc.get("cache_salt")
    if extra is None and salt is None:
        return PLAIN
    return CacheNamespace(extra if isinstance(extra, str) else None,
                          salt if isinstance(salt, str) else None)


def _guess_tokens(doc: dict) -> int:
    """A prompt's length without its tokens: ~4 characters a token of its text."""
    text = doc.get("messages") or doc.get("prompt") or doc.get("text") or doc.get("input_ids") or ""
    if isinstance(text, list) and text and all(isinstance(t, int) for t in text):
        return len(text)
    return max(1, len(str(text)) // 4)


def _slo(headers, name: str) -> Optional[float]:
    value = headers.get(name)
    if value is None:
        return None
    try:
        v = float(value)
    except ValueError:
        raise BadRequest(f"{name}: expected seconds, got {value!r}") from None
    if not 0 < v < 3600:
        raise BadRequest(f"{name}: expected 0 < seconds < 3600, got {value!r}")
    return v
