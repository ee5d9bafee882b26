"""The conductor's prompt tokenization matches SGLang's: the stand-in workers tokenize with
SGLang's own content handling (standin/prompts.py), and both must give the same ids."""
from __future__ import annotations

import pytest

from hicache_mc.conductor.prompts import PromptTokenizer, Unroutable
from standin.prompts import Prompts
from tokenizer import text, words

VOCAB = words()
CHATS = [
    {"messages": [{"role": "user", "content": "hello  world\n\n x"}]},
    {"messages": [{"role": "system", "content": "be brief <|im_end|> inside"},
                  {"role": "user", "content": [{"type": "text", "text": "a b"}, {"type": "text", "text": "c"}]},
                  {"role": "assistant", "content": None},
                  {"role": "tool", "content": [{"type": "text", "text": "42"}], "tool_call_id": "t1"},
                  {"role": "user", "content": " trailing spaces  "}]},
    {"messages": [{"role": "user", "content": text(2000, 5, VOCAB)}]},
    {"messages": [{"role": "user", "content": "é ü 漢字 🙂 <|im_start|> not a turn"}]},
]


@pytest.fixture(scope="module")
def both(tokenizer_dir):
    return PromptTokenizer(tokenizer_dir), Prompts(tokenizer_dir)


@pytest.mark.parametrize("i", range(len(CHATS)))
def test_chat_ids_match_sglang(both, i):
    mine, sglang = both
    assert mine.chat(CHATS[i]) == sglang.chat(CHATS[i])
    assert mine.chat(CHATS[i]) == sglang.chat(CHATS[i])          # again, from the piece cache


@pytest.mark.parametrize("prompt", ["", "x", text(1500, 9, VOCAB), " lead and trail ", "a\n\nb"])
def test_text_ids_match_sglang(both, prompt):
    mine, sglang = both
    if not prompt:
        with pytest.raises(Unroutable):
            mine.text(prompt or None)
        return
    assert mine.text(prompt) == sglang.text(prompt)
    assert mine.generate({"text": prompt}) == sglang.generate({"text": prompt})
    assert mine.generate({"input_ids": [5, 6, 7]}) == [5, 6, 7]


def test_a_conversation_encodes_only_its_new_turn(both):
    mine, sglang = both
    turns = [{"role": "user", "content": text(800, 21, VOCAB)}]
    mine.chat({"messages": turns})
    misses = mine.misses
    turns += [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "and then?"}]
    assert mine.chat({"messages": turns}) == sglang.chat({"messages": turns})
    # the long first turn and the template's fixed text came from the cache
    assert mine.misses - misses <= 3


@pytest.mark.parametrize("body", [
    {"messages": []},
    {"messages": "hi"},
    {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
    {"messages": [{"role": "user", "content": "hi"}], "continue_final_message": True},
])
def test_what_sglang_would_tokenize_otherwise_is_unroutable(both, body):
    with pytest.raises(Unroutable):
        both[0].chat(body)


def test_batches_are_unroutable(both):
    with pytest.raises(Unroutable):
        both[0].text(["a", "b"])
