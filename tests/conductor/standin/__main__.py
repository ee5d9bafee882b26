"""A fleet of stand-in SGLang workers in one process (importing sglang's modules costs seconds
of CPU: one process pays it once).

    python -m standin SPEC.json          (with tests/conductor on sys.path)

SPEC: ``{"tokenizer": DIR, "workers": [{"name": .., "role": .., "page_size": .., ...}, ...]}``
(every key of a worker spec is read in worker.py). Prints one JSON line, the workers'
descriptions (name, url, role, events and replay endpoints), once all of them serve; runs
until SIGTERM.
"""
from __future__ import annotations

import asyncio
import json
import logging
import signal
import sys

from .cache import page_hashes
from .prompts import Prompts
from .worker import StandinWorker


async def main(spec_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    prompts = Prompts(spec["tokenizer"])
    if spec.get("cached_tokenizer"):
        # benchmarks: the conductor's piece-cached tokenization, which gives the same ids
        # (tests/conductor/test_prompts.py) for a fraction of the CPU
        from hicache_mc.conductor.prompts import PromptTokenizer
        fast = PromptTokenizer(spec["tokenizer"])
        prompts.chat, prompts.text = fast.chat, fast.text
    page_hashes(list(range(32)), 16)   # loads SGLang's native hash extension (seconds, once)
    rooms: dict = {}
    workers = [StandinWorker(w["name"], prompts, {**spec.get("defaults", {}), **w}, rooms)
               for w in spec["workers"]]
    for w in workers:
        await w.start()
    print(json.dumps([w.describe() for w in workers]), flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)
    await stop.wait()
    for w in workers:
        if not w.crashed:
            await w.close()


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    asyncio.run(main(sys.argv[1]))
