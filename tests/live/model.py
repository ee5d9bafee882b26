"""A tiny Qwen2 with random weights and a locally trained tokenizer: a real model directory
that SGLang loads on CPU in seconds, made with transformers (nothing is downloaded).

The weights are seeded, so every call with the same ``TinyModel`` writes the same model: two
servers started from two directories would still agree, and the logprobs of one run can be
compared with the next. Prompts are words ``w0`` .. ``w399``; ``prompt_ids`` gives token ids
directly, so a test controls exactly how many pages a prompt fills.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

# The tokenizer's corpus: random sentences over a closed word list, so byte-level BPE learns
# the words and a prompt of n words is close to n tokens.
WORDS = tuple(f"w{i}" for i in range(400))
SPECIAL = ("<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                 "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                 "{% endif %}")


@dataclass(frozen=True)
class TinyModel:
    """The model's shape. The defaults are the smallest that exercise every part of HiCache
    (two layers, grouped-query attention): 64 B of K per token and layer, so a 16-token page
    is 2 KiB per part. ``benchmarks/bench_live_ttft.py`` passes a larger one."""
    hidden: int = 64
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 128
    vocab: int = 512
    context: int = 4096
    seed: int = 0


def make_tiny_model(out: Path, shape: TinyModel = TinyModel()) -> Path:
    """Write the tokenizer and the model to ``out`` (created); returns ``out``."""
    import torch
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=_train_tokenizer(shape), unk_token="<unk>",
                                        eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(out)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=shape.hidden,
                         intermediate_size=shape.intermediate, num_hidden_layers=shape.layers,
                         num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
                         max_position_embeddings=shape.context, tie_word_embeddings=True,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.eos_token_id,
                         torch_dtype="bfloat16")
    torch.manual_seed(shape.seed)
    Qwen2ForCausalLM(config).to(torch.bfloat16).save_pretrained(out)
    return out


def _train_tokenizer(shape: TinyModel):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    rng = random.Random(shape.seed)
    corpus = [" ".join(rng.choice(WORDS) for _ in range(30)) for _ in range(300)]
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=shape.vocab, special_tokens=list(SPECIAL),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tokenizer


def prompt_ids(n: int, seed: int, vocab: int = TinyModel.vocab) -> list[int]:
    """``n`` token ids drawn from ``seed``: distinct seeds give distinct first pages (ids below
    len(SPECIAL) are left out, so no prompt holds an end-of-text token)."""
    rng = random.Random(seed)
    return [rng.randrange(len(SPECIAL), vocab) for _ in range(n)]


def prompt_text(n_words: int, seed: int) -> str:
    """A text prompt of ``n_words`` words drawn from ``seed``."""
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n_words))
