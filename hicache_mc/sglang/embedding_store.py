"""HiCacheMCEmbeddingStore: SGLang's multimodal global embedding cache on hicache-mc.

SGLang 0.5.23's encoder server (``--encoder-only --enable-mm-global-cache``) wraps the store that
``EmbeddingStoreFactory.create_backend(name)`` returns, built with no arguments, in an
``EmbeddingCacheController``, which calls, all but the first from its I/O thread on TP rank 0:

1. ``register_buffer(pool)`` for its vision and audio host pools (``[tokens, dim]``, model dtype);
2. ``batch_is_exist(hashes)`` before encoding: hits skip the encoder;
3. ``batch_get_into_multi_buffers(hashes, ptrs, sizes)``: per hash, the page runs of the pool it
   allocated (a failed item frees its pages and falls back to the encoder);
4. ``batch_put_from_multi_buffers(...)`` for items it has just encoded.
``batch_get`` / ``batch_put`` are the one-buffer forms.

Pointers carry no dtype or shape, so they come from the registered pool a pointer lies in: an
item is a ``[bytes / row, dim]`` tensor of the pool's dtype, stored as one EmbeddingCache object
under ``get_key(hash)`` (``emb_<hash>``) in the namespace of (model, encoder version, pool dtype,
tenant). A pointer outside every registered pool is refused. An item whose pages are one run is
copied in place; one spread over several runs goes through a staging buffer (one memcpy).

Settings come from the environment, since the factory passes none (keywords work too):
``HICACHE_MC_MASTER`` and the other ClientConfig variables; ``HICACHE_MC_MODEL_NAME`` (default:
SGLang's ``--served-model-name``, else ``--model-path``); ``HICACHE_MC_ENCODER_VERSION``;
``HICACHE_MC_TENANT``. After construction nothing raises into SGLang: failures are ``False``.
"""
from __future__ import annotations

import ctypes
import dataclasses
import logging
import threading
from dataclasses import dataclass
from typing import List, NamedTuple

import numpy as np
import torch
from sglang.srt.mem_cache.embedding_store import EmbeddingStore

from ..auth import tenant_for
from ..client import StoreClient
from ..config import ClientConfig, load_config
from ..embeddings import EmbeddingCache, dtype_name
from ..errors import ConfigError
from ..keys import embedding_namespace

logger = logging.getLogger("hicache_mc.sglang")


@dataclass(frozen=True)
class EmbeddingSettings:
    """What names the namespace, beyond the pool's dtype."""
    model_name: str = ""         # default: SGLang's served model name, else its model path
    encoder_version: str = ""    # bump when the encoder or its preprocessing changes
    tenant: str = ""             # isolates deployments that share a store and a model


class Pool(NamedTuple):
    """A registered host pool: [start, end) addresses, row = one token of ``dim`` elements."""
    start: int
    end: int
    dtype: torch.dtype
    dim: int

    @property
    def row_bytes(self) -> int:
        return self.dim * self.dtype.itemsize


class Item(NamedTuple):
    """One hash's transfer: its shape, and where its bytes go (or come from) in the pool."""
    shape: tuple[int, int]
    ptrs: list[int]
    sizes: list[int]


class HiCacheMCEmbeddingStore(EmbeddingStore):
    """SGLang ``EmbeddingStore`` backed by a hicache-mc cluster."""

    def __init__(self, **options):
        names = {f.name for f in dataclasses.fields(EmbeddingSettings)}
        client_opts = {k: v for k, v in options.items() if k not in names}
        self.settings = load_config(EmbeddingSettings,
                                    **{k: v for k, v in options.items() if k in names})
        self.model = self.settings.model_name or _sglang_model_name()
        if not self.model:
            raise ConfigError("model_name: the hicache_mc embedding store needs the model's name "
                              "(set HICACHE_MC_MODEL_NAME, or start it from SGLang)")
        self.client = StoreClient(config=load_config(ClientConfig, section="client", **client_opts))
        try:   # a bad tenant name fails here, not at the first pool
            self.settings = dataclasses.replace(
                self.settings, tenant=tenant_for(self.client.config.token, self.settings.tenant))
            embedding_namespace(self.model, "", None, self.settings.tenant)
        except ValueError as exc:
            self.client.close()
            raise ConfigError(f"tenant: {exc}") from exc
        self.pools: list[Pool] = []
        self._caches: dict[torch.dtype, EmbeddingCache] = {}
        self._lock = threading.Lock()
        logger.info("hicache_mc embedding store: model %s, encoder version %r, master %s",
                    self.model, self.settings.encoder_version, self.client.config.master)

    # ------------------------------------------------------------------ set-up

    def register_buffer(self, tensor: torch.Tensor) -> None:
        """Learn a host pool: items whose pointers lie in it have its dtype and row size."""
        if tensor.dim() < 1 or tensor.numel() == 0:
            return
        start = tensor.data_ptr()
        pool = Pool(start, start + tensor.numel() * tensor.element_size(), tensor.dtype,
                    int(tensor.shape[-1]))
        with self._lock:
            self.pools.append(pool)
        register = getattr(self.client, "register_buffer", None)
        if register is not None:  # transports that need registered memory (mooncake)
            register(pool.start, pool.end - pool.start)
        logger.info("hicache_mc embedding store: pool of %s rows x %d, %s, namespace %s",
                    tensor.shape[0] if tensor.dim() > 1 else 1, pool.dim, dtype_name(pool.dtype),
                    self._cache(pool.dtype).namespace)

    def _cache(self, dtype: torch.dtype) -> EmbeddingCache:
        with self._lock:
            cache = self._caches.get(dtype)
            if cache is None:
                s = self.settings
                cache = self._caches[dtype] = EmbeddingCache(
                    model=self.model, encoder_version=s.encoder_version, dtype=dtype,
                    tenant=s.tenant, client=self.client)
            return cache

    def _plan(self, ptrs: List[int], sizes: List[int]) -> tuple[torch.dtype, Item]:
        """Dtype and shape of one item from the pool its buffers lie in; ValueError otherwise."""
        if not ptrs or len(ptrs) != len(sizes):
            raise ValueError(f"{len(ptrs)} buffers and {len(sizes)} sizes")
        pool = next((p for p in self.pools if p.start <= ptrs[0] < p.end), None)
        if pool is None:
            raise ValueError(f"buffer {ptrs[0]:#x} lies in no registered pool "
                             f"({len(self.pools)} registered)")
        for p, s in zip(ptrs, sizes):
            if not pool.start <= p <= p + s <= pool.end or s <= 0 or s % pool.row_bytes:
                raise ValueError(f"buffer {p:#x}+{s} is not whole rows of one registered pool "
                                 f"(row {pool.row_bytes} B)")
        return pool.dtype, Item((sum(sizes) // pool.row_bytes, pool.dim), list(ptrs), list(sizes))

    # ------------------------------------------------------------------ EmbeddingStore

    def batch_is_exist(self, hashes: List[str]) -> List[bool]:
        """Per hash: stored in this deployment's namespace (any registered pool dtype)."""
        try:
            keys = [self.get_key(h) for h in hashes]
            found = [False] * len(keys)
            for cache in list(self._caches.values()):
                found = [a or b for a, b in zip(found, cache.batch_exists(keys))]
            return found
        except Exception:
            logger.exception("hicache_mc embedding store: batch_is_exist failed; misses")
            return [False] * len(hashes)

    def batch_get(self, hashes: List[str], ptrs: List[int], sizes: List[int]) -> List[bool]:
        return self.batch_get_into_multi_buffers(hashes, [[p] for p in ptrs], [[s] for s in sizes])

    def batch_put(self, hashes: List[str], ptrs: List[int], sizes: List[int]) -> List[bool]:
        return self.batch_put_from_multi_buffers(hashes, [[p] for p in ptrs], [[s] for s in sizes])

    def batch_get_into_multi_buffers(self, hashes: List[str], ptrs: List[List[int]],
                                     sizes: List[List[int]]) -> List[bool]:
        """Copy each stored item into its page runs; False = miss (the controller re-encodes)."""
        return self._transfer("get", hashes, ptrs, sizes)

    def batch_put_from_multi_buffers(self, hashes: List[str], ptrs: List[List[int]],
                                     sizes: List[List[int]]) -> List[bool]:
        """Store each item from its page runs; True once every instance can read it."""
        return self._transfer("put", hashes, ptrs, sizes)

    # ------------------------------------------------------------------ transfers

    def _transfer(self, op: str, hashes, ptrs, sizes) -> List[bool]:
        result = [False] * len(hashes)
        try:
            groups: dict[torch.dtype, list[tuple[int, Item]]] = {}
            for i, (h, p, s) in enumerate(zip(hashes, ptrs, sizes)):
                try:
                    dtype, item = self._plan(list(p), list(s))
                except ValueError as exc:
                    logger.warning("hicache_mc embedding store: %s of %s refused: %s", op, h, exc)
                    continue
                groups.setdefault(dtype, []).append((i, item))
            for dtype, members in groups.items():
                ok = self._move(op, dtype, [self.get_key(hashes[i]) for i, _ in members],
                                [item for _, item in members])
                for (i, _), good in zip(members, ok):
                    result[i] = good
        except Exception:
            logger.exception("hicache_mc embedding store: batch %s failed; reported as failed", op)
        return result

    def _move(self, op: str, dtype: torch.dtype, keys: list[str], items: list[Item]) -> list[bool]:
        # One buffer per item: the store copies in place. Several page runs: a staging buffer.
        cache = self._cache(dtype)
        staged = {i: np.empty(sum(it.sizes), np.uint8) for i, it in enumerate(items)
                  if len(it.ptrs) > 1}
        ptrs = [staged[i].ctypes.data if i in staged else it.ptrs[0] for i, it in enumerate(items)]
        sizes = [sum(it.sizes) for it in items]
        shapes = [it.shape for it in items]
        if op == "put":
            for i, buf in staged.items():
                _scatter(items[i], buf.ctypes.data, to_runs=False)
            return cache.batch_put_from(keys, ptrs, sizes, dtype=dtype, shapes=shapes)
        ok = cache.batch_get_into(keys, ptrs, sizes, dtype=dtype, shapes=shapes)
        for i, buf in staged.items():
            if ok[i]:
                _scatter(items[i], buf.ctypes.data, to_runs=True)
        return ok

    def close(self) -> None:
        self.client.close()


def _scatter(item: Item, staging: int, to_runs: bool) -> None:
    """Copy between a contiguous staging buffer and an item's page runs."""
    off = 0
    for p, s in zip(item.ptrs, item.sizes):
        if to_runs:
            ctypes.memmove(p, staging + off, s)
        else:
            ctypes.memmove(staging + off, p, s)
        off += s


def _sglang_model_name() -> str:
    """The served model name (else model path) of the SGLang process we run in; "" outside one."""
    try:
        from sglang.srt.runtime_context import get_server_args
        args = get_server_args()
    except Exception:
        return ""
    name = getattr(args, "served_model_name", None) or getattr(args, "model_path", None)
    return str(name) if name else ""
