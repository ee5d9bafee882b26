"""An incoming generation request read for routing: its kind, whether it streams, its bound on
new tokens, its SLOs, and its prompt's token ids and page chain (when they can be known).

Bodies are OpenAI's (``/v1/chat/completions``, ``/v1/completions``) or SGLang's native
``/generate``; only the fields routing needs are read, and the body itself is forwarded as it
came. SLOs per request come from the ``X-Conductor-TTFT-SLO`` / ``X-Conductor-TBT-SLO``
headers (seconds); the router's defaults apply otherwise.
"""
from __future__ import annotations

import enum
from typing import Any, Callable, NamedTuple, Optional

from . import reach
from .chain import PLAIN, CacheNamespace, Chain, chain
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
    tokens: Optional[list]            # the prompt's ids, or their start (reach.py); None: unroutable
    unroutable: str                   # why, when tokens is None
    page_hashes: list
    block_hashes: Optional[list]      # None: the plain chain's (page hash prefixes)
    prompt_tokens: int                # estimated when the ids are only a start
    rest: list                        # pieces to encode once the request has gone (reach.warm)


Held = Callable[[Chain], int]         # leading pages of a chain that some cache holds


def read(kind: Kind, doc: Any, headers, prompts: Optional[PromptTokenizer], page_size: int,
         held: Optional[Held] = None) -> Intake:
    """The request's routing facts; with ``held``, a long new prompt is encoded only as far
    as a cache could serve it (reach.py)."""
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
    ns = _namespace(doc)
    routed, why = _tokens(kind, doc, prompts, page_size, ns, held)
    pages: list = []
    blocks = None
    if routed is not None and page_size > 0:
        c = chain(routed.ids, page_size, ns)
        pages = c.page_hashes
        blocks = None if ns.plain else c.block_hashes
    prompt = routed.tokens if routed is not None else _guess_tokens(doc)
    return Intake(stream, int(max_new or 0), _slo(headers, "X-Conductor-TTFT-SLO"),
                  _slo(headers, "X-Conductor-TBT-SLO"), routed.ids if routed else None, why, pages,
                  blocks, prompt, routed.rest if routed else [])


def _tokens(kind: Kind, doc: dict, prompts: Optional[PromptTokenizer], page_size: int,
            ns: CacheNamespace, held: Optional[Held]):
    """(reach.Routed, "") or (None, why it cannot be routed on its prompt)."""
    if prompts is None:
        return None, "no tokenizer"
    if doc.get("lora_path") or doc.get("image_data") or doc.get("audio_data") or \
            doc.get("video_data") or doc.get("n", 1) not in (1, None):
        return None, "lora, multimodal or n > 1"
    try:
        text, special, ids = _source(kind, doc, prompts)
        if ids is not None:
            return reach.Routed(ids, True, len(ids), []), ""
        pieces = prompts.pieces(text, special) if held is not None and page_size > 0 else None
        if pieces is None:
            ids = prompts.encode(text, add_special_tokens=special)
            return reach.Routed(ids, True, len(ids), []), ""
        return reach.encode(prompts, pieces, lambda ids: held(chain(ids, page_size, ns)), page_size), ""
    except Unroutable as exc:
        return None, str(exc)
    except Exception as exc:          # a template error on odd input: still served, on load
        return None, f"tokenization failed: {type(exc).__name__}"


def _source(kind: Kind, doc: dict, prompts: PromptTokenizer):
    """(text, add special tokens, None) to encode, or (None, False, ids) given."""
    if kind is Kind.CHAT:
        return prompts.render_chat(doc), False, None
    if kind is Kind.COMPLETION:
        prompt = doc.get("prompt")
    elif doc.get("input_ids") is not None:
        return None, False, prompts.generate(doc)
    else:
        prompt = doc.get("text")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        return prompt, True, None
    return None, False, prompts.text(prompt)          # ids, or Unroutable


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
