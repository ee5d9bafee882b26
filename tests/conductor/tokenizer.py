"""A small tokenizer trained here, saved as a Hugging Face tokenizer folder: byte-level BPE
with Qwen2's special tokens and a Qwen2-style chat template (a default system message,
``<|im_start|>role\\n...<|im_end|>``), so tests never download one."""
from __future__ import annotations

import json
import os
import random

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{%- if messages[0]['role'] != 'system' %}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


def words(n: int = 4000, seed: int = 7) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice("etaoinshrdlucmfwypvbgkqjxz") for _ in range(rng.randint(1, 9)))
            for _ in range(n)]


def text(n_words: int, seed: int, vocab: list[str]) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(vocab) for _ in range(n_words))


def train(folder: str, vocab_size: int = 2048) -> str:
    """Train and save into ``folder`` (kept if it already holds one); returns ``folder``."""
    if os.path.exists(os.path.join(folder, "tokenizer.json")):
        return folder
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    vocab = words()
    corpus = [text(200, seed, vocab) for seed in range(300)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                 pad_token="<|endoftext|>")
    hf.chat_template = CHAT_TEMPLATE
    os.makedirs(folder, exist_ok=True)
    hf.save_pretrained(folder)
    return folder


if __name__ == "__main__":
    import sys
    print(train(sys.argv[1]))
    print(json.dumps(os.listdir(sys.argv[1])))
