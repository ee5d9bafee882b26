"""A stand-in worker's tokenization: the prompt's token ids as SGLang 0.5.23 computes them.

- ``/v1/chat/completions``: each message through SGLang's own
  ``process_content_for_template_format`` (the template's content format from SGLang's own
  ``detect_jinja_template_content_format``), tool content flattened as SGLang's
  ``normalize_tool_content`` does, the template rendered to text with
  ``add_generation_prompt=True`` and the request's tools and ``chat_template_kwargs``, and
  the text encoded without adding special tokens (``OpenAIServingChat._apply_jinja_template``);
- ``/v1/completions`` and ``/generate`` with text: the tokenizer called on the text
  (``TokenizerManager._tokenize_texts``); ``/generate`` with ``input_ids``: those.

Written from SGLang's code, independently of the conductor's own tokenization, so that a
test of the conductor against these workers checks the conductor's tokenization too.
"""
from __future__ import annotations

import copy

from sglang.srt.parser.jinja_template_utils import (detect_jinja_template_content_format,
                                                    process_content_for_template_format)


class Prompts:
    def __init__(self, tokenizer_dir: str):
        from transformers import PreTrainedTokenizerFast
        self.tok = PreTrainedTokenizerFast.from_pretrained(tokenizer_dir)
        self.content_format = detect_jinja_template_content_format(self.tok.chat_template)

    def chat(self, body: dict) -> list[int]:
        messages = []
        for msg in copy.deepcopy(body["messages"]):
            if msg.get("content") is None:
                msg["content"] = ""
            msg = process_content_for_template_format(msg, self.content_format, [], [], [], [])
            if msg.get("role") == "tool" and isinstance(msg.get("content"), list) and all(
                    isinstance(p, str) or (isinstance(p, dict) and p.get("type") == "text")
                    for p in msg["content"]):
                msg["content"] = " ".join(p if isinstance(p, str) else p.get("text", "")
                                          for p in msg["content"])
            messages.append(msg)
        text = self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                            tools=body.get("tools"), return_dict=False,
                                            **(body.get("chat_template_kwargs") or {}))
        return self.tok.encode(text, add_special_tokens=False)

    def text(self, text: str) -> list[int]:
        return self.tok(text)["input_ids"]

    def generate(self, body: dict) -> list[int]:
        if body.get("input_ids") is not None:
            return list(body["input_ids"])
        return self.text(body["text"])

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids)
