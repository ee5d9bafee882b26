"""A request's prompt as token ids, computed as SGLang 0.5.23 computes them, fast.

What SGLang does (``OpenAIServingChat._apply_jinja_template``, ``TokenizerManager``):

- ``/v1/chat/completions``: each message's ``content`` of ``None`` becomes ``""``; a list of
  parts is joined with spaces for a template that takes strings (the ``string`` content
  format), kept as a list of text parts for one that iterates over them (``openai``); a tool
  message's text parts are always joined; the template is rendered to text with
  ``add_generation_prompt=True``, the request's ``tools`` and ``chat_template_kwargs``, and
  the text encoded without special tokens;
- ``/v1/completions`` and ``/generate`` with ``text``: the tokenizer called on the text (special
  tokens added as the tokenizer adds them); ``/generate`` with ``input_ids``: those ids.

A request this cannot reproduce (images, audio, a prompt list, ``continue_final_message``,
LoRA adapters) gets ``None``: the router then routes it on load alone.

**Speed.** Encoding 8k tokens of text costs ~5-15 ms in ``tokenizers`` on this machine's
cores, over the conductor's whole budget. Text between two added tokens (``<|im_start|>``
and the like) is encoded independently of its neighbours (the tokenizer splits added tokens
out before it pre-tokenizes), so a rendered prompt is split there and each piece is looked
up in an LRU of pieces already encoded: a conversation's earlier turns and a shared system
prompt are encoded once. The split is used only when every added token is a plain one (no
``lstrip`` / ``rstrip`` / ``single_word``) and a probe prompt encodes the same both ways.
"""
from __future__ import annotations

import logging
import re
from array import array
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional

log = logging.getLogger(__name__)

CACHE_CHARS = 64 << 20        # characters of text kept encoded (ids take ~8 B a token more)
_FOR_CONTENT = re.compile(r"for\s+\w+\s+in\s+[\w.\[\]'\"]*content")


class Unroutable(ValueError):
    """The prompt cannot be tokenized as SGLang would; route on load."""


class PromptTokenizer:
    """Token ids of requests' prompts for one served model (a Hugging Face tokenizer folder)."""

    def __init__(self, path: str, cache_chars: int = CACHE_CHARS):
        from transformers import PreTrainedTokenizerFast
        self.tok = PreTrainedTokenizerFast.from_pretrained(path)
        self.backend = self.tok.backend_tokenizer
        self.template = self.tok.chat_template
        self.openai_format = bool(self.template and _FOR_CONTENT.search(self.template))
        self.cache: OrderedDict[str, list[int]] = OrderedDict()    # touched on the loop only
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="prompts-warm")
        self.cache_chars, self.cached_chars = cache_chars, 0
        self.hits = self.misses = 0
        self.specials = self._specials()
        self.splitter = self._splitter()
        self.partial = False
        self.partial = self._partial()

    # ------------------------------------------------------------------ set-up

    def _specials(self) -> tuple[list[int], list[int]]:
        """The ids the tokenizer adds around a text (a BOS, say)."""
        probe = self.backend.encode("a", add_special_tokens=False).ids
        full = self.backend.encode("a", add_special_tokens=True).ids
        for i in range(len(full) - len(probe) + 1):
            if full[i:i + len(probe)] == probe:
                return full[:i], full[i + len(probe):]
        return [], []

    def _splitter(self) -> Optional[re.Pattern]:
        added = self.backend.get_added_tokens_decoder()
        if not added:
            return None
        if any(t.lstrip or t.rstrip or t.single_word for t in added.values()):
            log.info("prompts: added tokens strip whitespace; prompts are encoded whole")
            return None
        self.added_ids = {t.content: i for i, t in added.items()}
        pattern = re.compile("(" + "|".join(re.escape(c) for c in sorted(self.added_ids, key=len,
                                                                       reverse=True)) + ")")
        probe = "x y<|a|>" + " ".join(self.added_ids) + "\n hello  world \n\n" + \
            "".join(f"{c}z {c}\n" for c in self.added_ids)
        self.splitter = pattern
        whole = self.backend.encode(probe, add_special_tokens=False).ids
        if self._split_encode(probe) != whole:
            log.warning("prompts: encoding by pieces differs from whole; prompts are encoded whole")
            return None
        self.cache.clear()
        self.cached_chars = 0
        return pattern

    # ------------------------------------------------------------------ encoding

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        ids = self._split_encode(text) if self.splitter is not None else self._piece(text)
        if add_special_tokens and (self.specials[0] or self.specials[1]):
            return self.specials[0] + ids + self.specials[1]
        return ids

    def _split_encode(self, text: str) -> list[int]:
        out: list[int] = []
        added = self.added_ids
        for piece in self.splitter.split(text):
            if not piece:
                continue
            tid = added.get(piece)
            if tid is not None:
                out.append(tid)
            else:
                out.extend(self._piece(piece))
        return out

    def _piece(self, text: str) -> list[int]:
        cache = self.cache
        ids = cache.get(text)
        if ids is not None:
            cache.move_to_end(text)
            self.hits += 1
            return ids
        self.misses += 1
        ids = self.backend.encode(text, add_special_tokens=False).ids
        self._store(text, ids)
        return ids

    def _store(self, text: str, ids: list[int]) -> None:
        cache = self.cache
        cache[text] = ids
        self.cached_chars += len(text)
        while self.cached_chars > self.cache_chars and cache:
            old, _ = cache.popitem(last=False)
            self.cached_chars -= len(old)

    # ------------------------------------------------------------------ by pieces

    def pieces(self, text: str, add_special_tokens: bool) -> Optional[list]:
        """``text`` as the encoder sees it: ids (added and special tokens) and the text between
        them, each encoded independently; None when this tokenizer is not encoded by pieces."""
        if self.splitter is None:
            return None
        out: list = []
        if add_special_tokens:
            out += self.specials[0]
        for piece in self.splitter.split(text):
            if piece:
                out.append(self.added_ids.get(piece, piece))
        if add_special_tokens:
            out += self.specials[1]
        return out

    def ids(self, piece: str) -> list[int]:
        """One piece's ids (from the cache, or encoded into it)."""
        return self._piece(piece)

    def warm(self, pieces: list, loop) -> None:
        """Encode the pieces not cached on a thread of its own (``tokenizers`` lets go of the
        interpreter lock while it encodes), and cache them on ``loop``, which serves on."""
        todo = [p for p in pieces if isinstance(p, str) and p not in self.cache]
        if todo:
            self._pool.submit(self._encode_for, todo, loop)

    def _encode_for(self, todo: list, loop) -> None:
        ids = [e.ids for e in self.backend.encode_batch(todo, add_special_tokens=False)]
        loop.call_soon_threadsafe(self._remember, todo, ids)

    def _remember(self, pieces: list, ids: list) -> None:
        for piece, piece_ids in zip(pieces, ids):
            if piece not in self.cache:
                self.misses += 1
                self._store(piece, piece_ids)

    def known(self, piece: str) -> Optional[list[int]]:
        """One piece's ids if they are in the cache."""
        return self.cache.get(piece)

    def head(self, piece: str, chars: int) -> tuple[list[int], int]:
        """The ids of the longest start of ``piece[:chars]`` that ends where the pre-tokenizer
        cuts (tokens never span a cut there, so they are the first ids of the whole piece), and
        its length in characters; ``([], 0)`` when this tokenizer cannot say."""
        if not self.partial:
            return [], 0
        cuts = self.backend.pre_tokenizer.pre_tokenize_str(piece[:chars])
        if len(cuts) < 2:
            return [], 0
        end = cuts[-1][1][0]                 # the last pre-token may continue past ``chars``
        return self.backend.encode(piece[:end], add_special_tokens=False).ids, end

    def _partial(self) -> bool:
        """Whether ``head`` holds for this tokenizer: checked on a probe at several cuts."""
        pre = self.backend.pre_tokenizer
        if self.splitter is None or pre is None or self.backend.normalizer is not None:
            return False
        probe = ("Lorem ipsum,  dolor sit amet; 12345 67.8 e.g. don't  stop\n\n  "
                 "naïve café — 漢字 🙂\tx  y " * 20)
        whole = self.backend.encode(probe, add_special_tokens=False).ids
        self.partial = True
        for chars in range(7, len(probe), 97):
            ids, _ = self.head(probe, chars)
            if ids != whole[:len(ids)]:
                log.warning("prompts: the start of a text encodes differently alone; long new "
                            "prompts are encoded whole before routing")
                return False
        return True

    # ------------------------------------------------------------------ requests

    def chat(self, body: dict) -> list[int]:
        """The prompt ids of a chat completion request."""
        return self.encode(self.render_chat(body), add_special_tokens=False)

    def render_chat(self, body: dict) -> str:
        """A chat completion request's prompt text, rendered as SGLang renders it."""
        if self.template is None:
            raise Unroutable("the tokenizer has no chat template")
        if body.get("continue_final_message") or body.get("add_generation_prompt") is False:
            raise Unroutable("continue_final_message / add_generation_prompt")
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise Unroutable("no messages")
        text = self.tok.apply_chat_template(
            [self._message(m) for m in messages], tokenize=False, add_generation_prompt=True,
            tools=body.get("tools") or None, return_dict=False,
            **(body.get("chat_template_kwargs") or {}))
        if not isinstance(text, str):
            raise Unroutable("the template did not render text")
        return text

    def _message(self, msg: Any) -> dict:
        if not isinstance(msg, dict):
            raise Unroutable("a message is not an object")
        out = {k: v for k, v in msg.items() if v is not None}
        content = msg.get("content")
        if content is None:
            out["content"] = ""
        elif isinstance(content, list):
            texts = []
            for part in content:
                if isinstance(part, str):
                    texts.append(part)
                elif isinstance(part, dict) and part.get("type") == "text":
                    texts.append(part.get("text", ""))
                else:
                    raise Unroutable("a non-text content part")
            if self.openai_format and msg.get("role") != "tool":
                out["content"] = [{"type": "text", "text": t} for t in texts]
            else:
                out["content"] = " ".join(texts)
        elif not isinstance(content, str):
            raise Unroutable("content is neither text nor parts")
        return out

    def text(self, prompt: Any) -> list[int]:
        """The prompt ids of ``/v1/completions`` or ``/generate`` text."""
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if isinstance(prompt, str):
            return self.encode(prompt, add_special_tokens=True)
        if isinstance(prompt, list) and prompt and _ids(prompt):
            return prompt                      # the OpenAI API's pre-tokenized prompt
        raise Unroutable("a batch of prompts")

    def generate(self, body: dict) -> list[int]:
        ids = body.get("input_ids")
        if ids is not None:
            if isinstance(ids, list) and ids and _ids(ids):
                return ids
            raise Unroutable("input_ids is not one list of token ids")
        return self.text(body.get("text"))


def _ids(values: list) -> bool:
    """Whether ``values`` are all non-negative int64s (checked in C: 8k ids in ~50 µs)."""
    try:
        return min(array("q", values)) >= 0
    except (TypeError, OverflowError):
        return False
