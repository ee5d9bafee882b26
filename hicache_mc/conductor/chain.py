"""A request's page-hash chain, computed from its token ids exactly as SGLang 0.5.23 does.

One chain names a prompt's pages in every place a router looks them up:

- **L3 page keys.** HiCache's storage key of page ``i`` is the hex SHA-256 of page ``i - 1``'s
  digest (32 raw bytes; nothing for page 0) followed by page ``i``'s token ids as little-endian
  u32 (``get_hash_str``; a page holding an id above 2^32 - 1 hashes the tag byte ``0xff`` then
  every id as u64, the native hash's "wide" encoding). A request with an ``extra_key`` or a
  ``cache_salt`` seeds the chain with ``storage_namespace_seed`` (``get_storage_hash_str``).
  The store's keys are ``keys.batch_page_keys(namespace, page_hashes, parts)``.
- **KV-event block hashes** (L1 / L2 residency, as SGLang's publisher reports it): the first
  16 hex characters of a page hash as a signed int64 (``hash_str_to_int64``). A namespaced
  request's events come from a second chain (``compute_node_event_hash_values``): seeded by
  ``sha256("sglang-cache-salt-v1\\0" + cache_salt)`` when there is a salt, never by the
  extra key, and each block hash is then re-hashed with the namespace seed
  (``namespaced_block_hash``): of the extra key when the publisher knows it as a LoRA
  adapter, or of (extra key, salt) in the publisher's Dynamo format.

Only whole pages are cached, so only whole pages are hashed here (SGLang hashes a trailing
partial page too, but never stores it). Pure Python (hashlib): a router host need not have
sglang; tests/conductor/test_chain_parity.py checks every function against SGLang's own.
"""
from __future__ import annotations

import hashlib
import sys
from array import array
from dataclasses import dataclass
from typing import NamedTuple, Optional, Sequence

from ..keys import batch_page_keys

_U32_MAX = 0xFFFF_FFFF
_I64_MAX = 0x7FFF_FFFF_FFFF_FFFF
_WIDE_TAG = b"\xff"              # an odd byte count: a wide page never hashes like a u32 one
_STORAGE_SEED_TAG = b"sglang-cache-namespace-v1"
_EVENT_SEED_TAG = b"sglang-kv-event-namespace-v1"
_SALT_CHAIN_TAG = b"sglang-cache-salt-v1\0"
_LITTLE = sys.byteorder == "little"


@dataclass(frozen=True)
class CacheNamespace:
    """What SGLang keys a request's cache by besides its tokens."""
    extra_key: Optional[str] = None       # SGLang's per-request extra key (a LoRA's, ...)
    cache_salt: Optional[str] = None
    lora: bool = False                    # the publisher knows extra_key as a LoRA adapter
    dynamo_format: bool = False           # the publisher runs in its Dynamo format

    def __post_init__(self):
        if self.cache_salt == "":         # SGLang's RadixKey reads an empty salt as none
            object.__setattr__(self, "cache_salt", None)

    @property
    def plain(self) -> bool:
        return self.extra_key is None and self.cache_salt is None


PLAIN = CacheNamespace()


class Chain(NamedTuple):
    """A prompt's whole pages: their hex page hashes and their KV-event block hashes."""
    page_hashes: list[str]
    block_hashes: list[int]

    def l3_keys(self, namespace: str, parts: tuple[str, ...]) -> list[str]:
        """The store keys of these pages, page-major, as the SGLang backend names them."""
        return batch_page_keys(namespace, self.page_hashes, parts)


def _page_bytes(tokens: Sequence[int]) -> bytes:
    try:
        words = array("I", tokens)
    except OverflowError:
        words = None
    if words is None or not _LITTLE:
        if any(t < 0 or t > _I64_MAX for t in tokens):
            raise ValueError("a token id must be a non-negative int64")
        if words is None:
            return _WIDE_TAG + b"".join(t.to_bytes(8, "little") for t in tokens)
        words.byteswap()
    return words.tobytes()


def hash_pages(tokens: Sequence[int], page_tokens: int,
               prior_hash: Optional[str] = None) -> list[str]:
    """SGLang's ``get_hash_str(tokens, prior_hash, page_size)`` over the whole pages only."""
    if page_tokens <= 0:
        raise ValueError(f"page_tokens {page_tokens}: must be positive")
    prior = bytes.fromhex(prior_hash) if prior_hash else b""
    out = []
    for start in range(0, len(tokens) - page_tokens + 1, page_tokens):
        prior = hashlib.sha256(prior + _page_bytes(tokens[start:start + page_tokens])).digest()
        out.append(prior.hex())
    return out


def _seed(tag: bytes, parts: tuple[Optional[str], ...]) -> "hashlib._Hash":
    # A presence byte and a length prefix keep (None, "a"), ("", "a") and ("a", "") apart.
    digest = hashlib.sha256(tag)
    for part in parts:
        if part is None:
            digest.update(b"\x00")
        else:
            encoded = part.encode("utf-8")
            digest.update(b"\x01" + len(encoded).to_bytes(8, "little") + encoded)
    return digest


def storage_seed(ns: CacheNamespace) -> Optional[str]:
    """SGLang's ``storage_namespace_seed``: the prior hash of a namespaced storage chain."""
    return None if ns.plain else _seed(_STORAGE_SEED_TAG, (ns.extra_key, ns.cache_salt)).hexdigest()


def event_seed(ns: CacheNamespace) -> Optional[bytes]:
    """The seed SGLang's publisher re-hashes this namespace's block hashes with (None: none)."""
    if ns.dynamo_format:
        extra, salt = ns.extra_key, ns.cache_salt
    else:
        extra, salt = (ns.extra_key if ns.lora else None), None
    if extra is None and salt is None:
        return None
    return _seed(_EVENT_SEED_TAG, (extra, salt)).digest()


def block_hash(page_hash: str) -> int:
    """SGLang's ``hash_str_to_int64``: the first 64 bits of a page hash as a signed int64."""
    v = int(page_hash[:16], 16)
    return v - (1 << 64) if v > _I64_MAX else v


def namespaced(block: int, seed: Optional[bytes]) -> int:
    """SGLang's ``namespaced_block_hash``."""
    if seed is None:
        return block
    digest = hashlib.sha256(seed + block.to_bytes(8, "big", signed=True)).digest()
    return int.from_bytes(digest[:8], "big", signed=True)


def chain(tokens: Sequence[int], page_tokens: int, ns: CacheNamespace = PLAIN) -> Chain:
    """The page hashes (L3 keys) and block hashes (KV events) of ``tokens``' whole pages."""
    pages = hash_pages(tokens, page_tokens, storage_seed(ns))
    if ns.plain:
        return Chain(pages, [block_hash(h) for h in pages])
    salt_prior = None
    if ns.cache_salt is not None:
        salt_prior = hashlib.sha256(_SALT_CHAIN_TAG + ns.cache_salt.encode("utf-8")).hexdigest()
    seed = event_seed(ns)
    events = hash_pages(tokens, page_tokens, salt_prior)
    return Chain(pages, [namespaced(block_hash(h), seed) for h in events])
