"""A prompt encoded only as far as a cache could serve it (reach.py): the ids routing gets are
the start of the whole prompt's, exactly; encoding stops at the first page held nowhere and
goes on while pages are held; the rest lands in the piece cache once warmed."""
from __future__ import annotations

import pytest

from hicache_mc.conductor import reach
from hicache_mc.conductor.prompts import PromptTokenizer
from tokenizer import text, words

PAGE = 16
VOCAB = words()


@pytest.fixture
def prompts(tokenizer_dir):
    return PromptTokenizer(tokenizer_dir)


def chat(seed: int, n_words: int = 3000) -> dict:
    return {"messages": [{"role": "system", "content": "short system"},
                         {"role": "user", "content": text(n_words, seed, VOCAB) + "  end.\n"}]}


def test_a_new_long_prompt_is_encoded_only_until_no_cache_can_serve_it(prompts):
    assert prompts.partial
    rendered = prompts.render_chat(chat(1))
    whole = prompts.encode(rendered, add_special_tokens=False)
    prompts.cache.clear()
    routed = reach.encode(prompts, prompts.pieces(rendered, False), held=lambda ids: 0, page_size=PAGE)
    assert not routed.complete
    assert 0 < len(routed.ids) < len(whole) // 4
    assert routed.ids == whole[:len(routed.ids)]              # exactly the prompt's start
    assert abs(routed.tokens - len(whole)) < 0.1 * len(whole)  # its length, estimated
    reach.warm(prompts, routed.rest)
    again = reach.encode(prompts, prompts.pieces(rendered, False), held=lambda ids: 0, page_size=PAGE)
    assert again.complete and again.ids == whole


def test_pages_held_somewhere_keep_the_encoding_going(prompts):
    rendered = prompts.render_chat(chat(2))
    whole = prompts.encode(rendered, add_special_tokens=False)
    prompts.cache.clear()
    held_all = reach.encode(prompts, prompts.pieces(rendered, False),
                            held=lambda ids: len(ids) // PAGE, page_size=PAGE)
    assert held_all.complete and held_all.ids == whole
    prompts.cache.clear()
    first = reach.encode(prompts, prompts.pieces(rendered, False), held=lambda ids: 0, page_size=PAGE)
    prompts.cache.clear()
    # a cache holding the first 100 pages: encoding goes past them before it stops
    some = reach.encode(prompts, prompts.pieces(rendered, False),
                        held=lambda ids: min(len(ids) // PAGE, 100), page_size=PAGE)
    assert not some.complete and len(first.ids) < 100 * PAGE <= len(some.ids)
    assert some.ids == whole[:len(some.ids)]


@pytest.mark.parametrize("seed", range(5))
def test_text_prompts_too_with_their_special_tokens(prompts, seed):
    prompt = text(2500, 100 + seed, VOCAB).replace(" ", "  ", seed) + "\n\n" * seed
    whole = prompts.text(prompt)
    prompts.cache.clear()
    routed = reach.encode(prompts, prompts.pieces(prompt, True), held=lambda ids: 0, page_size=PAGE)
    assert routed.ids == whole[:len(routed.ids)]


def test_warming_runs_off_the_loop_and_caches_on_it(prompts):
    import asyncio
    rendered = prompts.render_chat(chat(3))
    whole = prompts.encode(rendered, add_special_tokens=False)
    prompts.cache.clear()
    routed = reach.encode(prompts, prompts.pieces(rendered, False), held=lambda ids: 0, page_size=PAGE)

    async def go():
        reach.warm(prompts, routed.rest, asyncio.get_running_loop())
        while not all(p in prompts.cache for p in routed.rest if isinstance(p, str)):
            await asyncio.sleep(0.01)
    asyncio.run(asyncio.wait_for(go(), 30))
    again = reach.encode(prompts, prompts.pieces(rendered, False), held=lambda ids: 0, page_size=PAGE)
    assert again.complete and again.ids == whole
