"""A stand-in worker's KV cache: pages in a GPU tier and a host tier, LRU each, and the KV
events SGLang's radix cache would publish for them.

Pages are named by SGLang's own hashing (``get_hash_str`` over the page's token ids, chained),
and each event carries ``hash_str_to_int64`` of that hash, as SGLang's ``KVCacheEventRecorder``
does for a request without an extra key or salt. A GPU page evicted for room moves to the
host tier (``BlockRemoved`` GPU, ``BlockStored`` CPU_PINNED); a host page evicted for room is
written to the L3 when one is attached (through the real store) and dropped
(``BlockRemoved`` CPU_PINNED); ``evict_all`` empties both tiers into the L3. Consecutive stores of one chain are coalesced into one
``BlockStored`` with several hashes, as the recorder coalesces them.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import NamedTuple, Optional

from sglang.srt.disaggregation.kv_events import (AllBlocksCleared, BlockRemoved, BlockStored,
                                                 StorageMedium)
from sglang.srt.mem_cache.utils import get_hash_str, hash_str_to_int64

GPU = StorageMedium.GPU.value
HOST = StorageMedium.CPU.value


def page_hashes(tokens: list[int], page_size: int) -> list[str]:
    """SGLang's chained page hashes of the whole pages of ``tokens``."""
    whole = len(tokens) // page_size * page_size
    if whole == 0:
        return []
    return get_hash_str(tokens[:whole], None, page_size=page_size)


class Match(NamedTuple):
    """How a prompt's leading pages are held: GPU first, then host, then the L3."""
    gpu: int
    host: int
    l3: int


class PageCache:
    """The two tiers of one worker; every change returns the events it causes."""

    def __init__(self, page_size: int, gpu_pages: int, host_pages: int, l3=None):
        self.page_size = page_size
        self.gpu_pages, self.host_pages = gpu_pages, host_pages
        self.gpu: OrderedDict[str, list[int]] = OrderedDict()    # page hash -> its tokens
        self.host: OrderedDict[str, list[int]] = OrderedDict()
        self.parent: dict[str, Optional[str]] = {}
        self.l3 = l3            # an L3Pages or None

    async def match(self, pages: list[str]) -> Match:
        gpu = 0
        while gpu < len(pages) and pages[gpu] in self.gpu:
            gpu += 1
        host = gpu
        while host < len(pages) and pages[host] in self.host:
            host += 1
        l3 = await self.l3.leading(pages[host:]) if self.l3 is not None and host < len(pages) else 0
        return Match(gpu, host - gpu, l3)

    def touch(self, pages: list[str]) -> None:
        for h in pages:
            if h in self.gpu:
                self.gpu.move_to_end(h)

    def insert(self, pages: list[str], tokens: list[int]) -> list:
        """Make every page of the chain GPU-resident (computed, loaded or fetched)."""
        events: list = []
        ps = self.page_size
        for i, h in enumerate(pages):
            if h in self.gpu:
                self.gpu.move_to_end(h)
                continue
            self._make_room(events)
            page_tokens = tokens[i * ps:(i + 1) * ps]
            self.gpu[h] = page_tokens
            self.parent[h] = pages[i - 1] if i else None
            self._stored(events, h, page_tokens, GPU)
        return events

    def _stored(self, events: list, h: str, page_tokens: list[int], medium: str) -> None:
        block = hash_str_to_int64(h)
        parent = self.parent.get(h)
        parent_block = hash_str_to_int64(parent) if parent else None
        tail = events[-1] if events else None
        if isinstance(tail, BlockStored) and tail.medium == medium and parent_block is not None \
                and tail.block_hashes[-1] == parent_block:
            tail.block_hashes.append(block)
            tail.token_ids.extend(page_tokens)
            return
        events.append(BlockStored(block_hashes=[block], parent_block_hash=parent_block,
                                  token_ids=list(page_tokens), block_size=self.page_size,
                                  lora_id=None, medium=medium))

    def _make_room(self, events: list) -> None:
        while len(self.gpu) >= self.gpu_pages:
            h, page_tokens = self.gpu.popitem(last=False)
            events.append(BlockRemoved(block_hashes=[hash_str_to_int64(h)], medium=GPU))
            if self.host_pages > 0 and h not in self.host:
                self._to_host(h, page_tokens, events)

    def _to_host(self, h: str, page_tokens: list[int], events: list) -> None:
        while len(self.host) >= self.host_pages:
            old, _ = self.host.popitem(last=False)
            if self.l3 is not None:
                self.l3.put([old])
            events.append(BlockRemoved(block_hashes=[hash_str_to_int64(old)], medium=HOST))
        self.host[h] = page_tokens
        self._stored(events, h, page_tokens, HOST)

    def evict_all(self) -> list:
        """Push every page out of both tiers, into the L3 when one is attached (a test's
        control: HiCache's write-back of evicted pages)."""
        events: list = []
        if self.l3 is not None:
            self.l3.put(list(self.gpu) + list(self.host))
        if self.gpu:
            events.append(BlockRemoved(block_hashes=[hash_str_to_int64(h) for h in self.gpu],
                                       medium=GPU))
        self.gpu.clear()
        if self.host:
            events.append(BlockRemoved(block_hashes=[hash_str_to_int64(h) for h in self.host],
                                       medium=HOST))
        self.host.clear()
        return events

    def clear(self) -> list:
        self.gpu.clear()
        self.host.clear()
        self.parent.clear()
        return [AllBlocksCleared()]

    def used_tokens(self) -> int:
        return len(self.gpu) * self.page_size


class L3Pages:
    """The shared L3 as the stand-in sees it: the real store, under one namespace, through a
    ``StoreClient`` (a page is its ``k`` and ``v`` objects, a few bytes each: the store and
    the conductor's view care about keys, not sizes). Calls run on one thread of their own,
    in order, so the workers' event loop never waits on the store."""

    PARTS = ("k", "v")

    def __init__(self, master: str, namespace: str):
        from concurrent.futures import ThreadPoolExecutor

        import numpy as np
        from hicache_mc.client import StoreClient
        self.client = StoreClient(master, view="off")
        self.ns = namespace
        self._payload = np.zeros(64, dtype=np.uint8)
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="standin-l3")

    def _keys(self, pages: list[str]) -> list[str]:
        from hicache_mc.keys import batch_page_keys
        return batch_page_keys(self.ns, pages, self.PARTS)

    async def leading(self, pages: list[str]) -> int:
        import asyncio
        keys = self._keys(pages)
        found = await asyncio.get_running_loop().run_in_executor(self.pool, self.client.batch_exists, keys)
        return found // len(self.PARTS)

    def put(self, pages: list[str]) -> None:
        keys = self._keys(pages)
        if keys:
            p = self._payload
            self.pool.submit(self.client.batch_put_from, keys, [p.ctypes.data] * len(keys),
                             [p.nbytes] * len(keys))

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        self.client.close()
