"""A store key's 16-byte digest: what the master's index holds, the residency wire carries and
a client's view looks up.

A *page key* ``<namespace>/<page hash>/<part>`` (the page hash exactly 64 hex digits, as
SGLang's SHA-256 page hashes are, the part at most 15 bytes) is digested from its page hash,
which is already a hash: its 32 bytes as four little-endian 64-bit words, each folded
(``w ^ w >> 32``), the digest's two halves are ``w . MIX[:, 0]`` and ``w . MIX[:, 1]`` (mod
2^64), XOR the namespace's salt (xxh3-128 of the namespace), XOR the part (its bytes,
zero-padded, its length in the last byte). Fold and odd multipliers are one-to-one, so hashes
that differ in one word (a counter written in hex, say) never share a digest, and the fold
carries a word's high bits into the low ones the product spreads from: 100k hashes of
counters, shifted counters and repeated halves share no 8-byte prefix (tests/test_keydigest.py). So a view answers a chain of SGLang pages from
their hex hashes in one vectorised pass (``page_prefixes``: one hex decode, one matrix product)
instead of building every key and hashing it again (benchmarks/bench_view.py). Every other key
is digested by xxh3-128 of its text.

Distinct keys have distinct digests but for chance (~n^2/2^129) or on purpose: the page hash is
the client's to choose, so a client can make two keys of one namespace share a digest (a hash
in upper and in lower case, say; SGLang's are lower case). That
costs only that namespace (the index and the views keep one map per namespace): a lookup says
"stored" for a key that is not (the node finds no such key: a miss) or a Place says "stored"
for a key that is not (the put is skipped: later gets miss), never another key's bytes. With a
token a namespace is one tenant's, whose clients may clear each other's keys anyway.
"""
from __future__ import annotations

import functools
from typing import Optional

import numpy as np
from xxhash import xxh3_128_digest

HASH_HEX = 64           # SGLang's page hash: SHA-256, lowercase hex
MAX_PART = 15           # bytes of a page key's part (the 16th byte of its term is the length)
_SEP = ord("/")
# odd 64-bit multipliers (the finalisers of SplitMix64 and MurmurHash3), one column per half
MIX = np.array([[0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F], [0x165667B19E3779F9, 0xD6E8FEB86659FD93],
                [0xFF51AFD7ED558CCD, 0xC4CEB9FE1A85EC53], [0x94D049BB133111EB, 0xBF58476D1CE4E5B9]],
               dtype=np.uint64)
_MIX = [[int(x) for x in col] for col in MIX.T]
_M64 = (1 << 64) - 1


@functools.lru_cache(maxsize=4096)
def _salt(ns: str) -> bytes:
    return xxh3_128_digest(b"hicache-mc page key\0" + ns.encode())


@functools.lru_cache(maxsize=4096)
def _term(ns: str, part: bytes) -> bytes:
    """The namespace's salt XOR the part's term: what a page hash's 16 bytes are XORed with."""
    t = part.ljust(15, b"\0") + bytes((len(part),))
    return bytes(a ^ b for a, b in zip(_salt(ns), t))


def _page(key: str) -> Optional[tuple[str, bytes, bytes]]:
    """(namespace, page hash bytes, part bytes) of a page key, else None."""
    i = key.find("/")
    if i < 0 or len(key) < i + HASH_HEX + 2 or key[i + HASH_HEX + 1] != "/":
        return None
    h, part = key[i + 1:i + 1 + HASH_HEX], key[i + HASH_HEX + 2:].encode()
    if len(part) > MAX_PART or not h.isascii():
        return None
    try:
        return key[:i], bytes.fromhex(h), part
    except ValueError:      # (fromhex skips whitespace: the length tells)
        return None


def digest(key: str) -> bytes:
    """The 16-byte digest of one key."""
    page = _page(key)
    if page is None or len(page[1]) != HASH_HEX // 2:
        return xxh3_128_digest(key.encode())
    ns, h, part = page
    w = [int.from_bytes(h[i:i + 8], "little") for i in range(0, 32, 8)]
    w = [x ^ x >> 32 for x in w]
    lo, hi = (sum(k * x for k, x in zip(col, w)) & _M64 for col in _MIX)
    return ((lo | hi << 64) ^ int.from_bytes(_term(ns, part), "little")).to_bytes(16, "little")


def digest_list(keys: list[str], ns: Optional[str] = None) -> list[bytes]:
    """Each key's digest. With ``ns`` (every key's namespace, when the caller knows it has one)
    a batch of same-length page keys is digested in one vectorised pass; without, each
    namespace's keys are (a hybrid model's pools, a node's inventory), but for namespaces of a
    few keys (a pass costs ~10 us, a key alone ~2 us)."""
    if ns is not None:
        rows = _page_batch(keys, ns) if len(keys) > 4 else None
        return list(map(digest, keys)) if rows is None else rows.view("V16").ravel().tolist()
    if len(keys) <= 4:
        return list(map(digest, keys))
    groups: dict[str, list[int]] = {}
    for i, k in enumerate(keys):
        groups.setdefault(k.partition("/")[0], []).append(i)
    if len(groups) > len(keys) // 8:      # namespaces of a few keys each: key by key
        return list(map(digest, keys))
    out: list = [None] * len(keys)
    for space, pos in groups.items():
        part = digest_list([keys[i] for i in pos], space) if "/" in keys[pos[0]] else \
            list(map(digest, [keys[i] for i in pos]))
        for i, d in zip(pos, part):
            out[i] = d
    return out


def digests(keys: list[str]) -> bytes:
    """The keys' digests end to end (the residency wire's form)."""
    return b"".join(digest_list(keys, _one_namespace(keys)))


def _one_namespace(keys: list[str]) -> Optional[str]:
    if not keys:
        return None
    i = keys[0].find("/")
    prefix = keys[0][:i + 1]
    if i >= 0 and min(keys).startswith(prefix) and max(keys).startswith(prefix):
        return keys[0][:i]
    return None


def _page_batch(keys: list[str], ns: str) -> Optional[np.ndarray]:
    """The digests, as rows of two little-endian uint64 (16 bytes), of keys of namespace ``ns``
    that are all page keys of one length; None when they are not."""
    n, width = len(keys), len(keys[0])
    part = width - len(ns) - HASH_HEX - 2
    raw = "".join(keys)
    # every key is `width` long: the lengths add up, and none is longer
    if not 0 <= part <= MAX_PART or len(raw) != n * width or max(map(len, keys)) != width:
        return None
    try:
        rows = np.frombuffer(raw.encode("ascii"), np.uint8).reshape(n, width)
    except UnicodeEncodeError:
        return None
    at = len(ns) + 1
    if (rows[:, at + HASH_HEX] != _SEP).any():
        return None
    try:
        hashes = bytes.fromhex(rows[:, at:at + HASH_HEX].tobytes().decode("ascii"))
    except ValueError:
        return None
    if len(hashes) != n * HASH_HEX // 2:    # (fromhex skips whitespace)
        return None
    term = np.zeros((n, 16), np.uint8)
    term[:, :part] = rows[:, at + HASH_HEX + 1:]
    term[:, 15] = part
    term ^= np.frombuffer(_salt(ns), np.uint8)
    out = _folded(hashes, n) @ MIX
    out ^= term.view("<u8")
    return out


def key_prefixes(keys: list[str], ns: Optional[str] = None) -> np.ndarray:
    """The first 8 bytes of each key's digest, as uint64 (what a view looks up); ``ns`` as for
    ``digest_list``."""
    rows = _page_batch(keys, ns) if ns is not None and len(keys) > 4 else None
    if rows is None:
        return np.frombuffer(b"".join(map(digest, keys)), "<u8")[::2]
    return rows.view("<u8")[:, 0]


def page_prefixes(ns: str, page_hashes: list[str], parts: tuple[str, ...]) -> Optional[np.ndarray]:
    """The first 8 bytes of the digests of ``<ns>/<hash>/<part>`` for every hash and part,
    page-major, as uint64 (what a view looks up), computed from the hex hashes in one pass; None
    when a hash is not 64 hex digits (then build the keys and use ``digests``)."""
    n = len(page_hashes)
    raw = "".join(page_hashes)
    if len(raw) != HASH_HEX * n or max(map(len, page_hashes), default=HASH_HEX) != HASH_HEX:
        return None
    try:
        hashes = bytes.fromhex(raw)
    except ValueError:
        return None
    if len(hashes) != n * HASH_HEX // 2:    # (fromhex skips whitespace)
        return None
    terms = _terms8(ns, tuple(parts))
    if terms is None:
        return None
    first = _folded(hashes, n) @ MIX[:, 0]
    if len(terms) == 1:
        first ^= terms[0]
        return first
    return (first[:, None] ^ terms).ravel()


def _folded(hashes: bytes, n: int) -> np.ndarray:
    """The ``n`` hashes as rows of four little-endian words, each folded: ``w ^ w >> 32``."""
    w = np.frombuffer(hashes, "<u8").reshape(n, 4)
    return w ^ (w >> _32)


_32 = np.uint64(32)


@functools.lru_cache(maxsize=256)
def _terms8(ns: str, parts: tuple[str, ...]) -> Optional[np.ndarray]:
    """The first 8 bytes of each part's term (see ``_term``), as uint64; None when a part is
    too long for a page key."""
    if any(len(p.encode()) > MAX_PART for p in parts):
        return None
    return np.array([int.from_bytes(_term(ns, p.encode())[:8], "little") for p in parts], np.uint64)

