"""A store key's 16-byte digest: what the master's index holds, the residency wire carries and
a client's view looks up.

A *page key* ``<namespace>/<page hash>/<part>`` (the page hash exactly 64 hex digits, as
SGLang's SHA-256 page hashes are, the part at most 15 bytes) is digested from its page hash,
which is already a hash: its 32 bytes as eight little-endian 32-bit words ``w``, the digest's
two halves are ``w . MIX[:, 0]`` and ``w . MIX[:, 1]`` (64-bit products and sums, mod 2^64),
XOR the namespace's salt (xxh3-128 of the namespace), XOR the part (its bytes, zero-padded, its
length in the last byte). An odd multiplier is one-to-one, so hashes that differ in one word
(a counter written in hex, say) never share a digest, and a 32-bit word's every bit reaches
the 64-bit product's upper half: 150k hashes of counters, shifted counters and repeated halves
share no 8-byte prefix (tests/test_keydigest.py). So a view answers a chain of SGLang pages from
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

import enum
import functools
from binascii import unhexlify
from typing import NamedTuple, Optional

import numpy as np
from xxhash import xxh3_128_digest

HASH_HEX = 64           # SGLang's page hash: SHA-256, lowercase hex
MAX_PART = 15           # bytes of a page key's part (the 16th byte of its term is the length)
_SEP = ord("/")
# odd 64-bit multipliers (the first 16 outputs of SplitMix64 from 0, made odd), one column per
# half of the digest, one row per 32-bit word of the hash
MIX = np.array([[0xe220a8397b1dcdaf, 0x3ee5789041c98ac3], [0x6e789e6aa1b965f5, 0xf3b8488c368cb0a7],
                [0x06c45d188009454f, 0x657eecdd3cb13d09], [0xf88bb8a8724c81ed, 0xc2d326e0055bdef7],
                [0x1b39896a51a8749b, 0x8621a03fe0bbdb7b], [0x53cb9f0c747ea2eb, 0x8e1f7555983aa92f],
                [0x2c829abe1f4532e1, 0xb54e0f1600cc4d19], [0xc584133ac916ab3d, 0x84bb3f97971d80ab]],
               dtype=np.uint64)
_MIX = [[int(x) for x in col] for col in MIX.T]
_MIX0 = np.ascontiguousarray(MIX[:, 0])    # the first half alone: a view's 8-byte prefix
_MIX0C = np.ascontiguousarray(MIX[:, :1])   # ... as a column (rows of one half)
_M64 = (1 << 64) - 1
SHORTEST = HASH_HEX + 2     # a page key's least length: "/<hash>/" (an empty namespace and part)


class Kind(enum.Enum):
    PAGES = "every key a page key"
    TEXT = "no key a page key"
    MIXED = "some are, or the batch's shape does not tell"


class Batch(NamedTuple):
    kind: Kind
    rows: Optional[np.ndarray] = None   # PAGES: the digests as rows of two uint64


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
    w = [int.from_bytes(h[i:i + 4], "little") for i in range(0, 32, 4)]
    lo, hi = (sum(k * x for k, x in zip(col, w)) & _M64 for col in _MIX)
    return ((lo | hi << 64) ^ int.from_bytes(_term(ns, part), "little")).to_bytes(16, "little")


def _text(keys: list[str]) -> list[bytes]:
    """xxh3-128 of each key's text, in C-level loops (~0.05 us a key)."""
    return list(map(xxh3_128_digest, map(str.encode, keys)))


def _classify(keys: list[str], ns: Optional[str], halves: int = 2) -> Batch:
    """What a batch of keys is, at C speed where its shape tells: keys too short to be page
    keys (most keys that are not SGLang's), or keys of one namespace and one length whose
    separator column says which they are."""
    longest = max(map(len, keys))
    if longest < SHORTEST:
        return Batch(Kind.TEXT)
    if ns is None or len(keys) <= 4:
        return Batch(Kind.MIXED)
    return _page_batch(keys, ns, longest, halves)


def digest_list(keys: list[str], ns: Optional[str] = None) -> list[bytes]:
    """Each key's digest. With ``ns`` (every key's namespace, when the caller knows it has one)
    a batch of same-length page keys is digested in one vectorised pass; without, each
    namespace's keys are (a hybrid model's pools, a node's inventory), but for namespaces of a
    few keys (a pass costs ~10 us, a key alone ~2 us)."""
    if not keys:
        return []
    batch = _classify(keys, ns)
    if batch.kind is Kind.PAGES:
        return batch.rows.view("V16").ravel().tolist()
    if batch.kind is Kind.TEXT:
        return _text(keys)
    if ns is not None or len(keys) <= 4:
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


def _page_batch(keys: list[str], ns: str, longest: int, halves: int = 2) -> Batch:
    """Keys of namespace ``ns``, the longest ``longest`` long: their digests when all are page
    keys of one length (rows of ``halves`` little-endian uint64: 1 for a view's prefixes), TEXT
    when none can be, else MIXED."""
    n, width = len(keys), len(keys[0])
    raw = "".join(keys)
    if len(raw) != n * width or longest != width:   # (lengths that add up, none longer: equal)
        return Batch(Kind.MIXED)
    part = width - len(ns) - HASH_HEX - 2
    if not 0 <= part <= MAX_PART:
        return Batch(Kind.TEXT)
    try:
        rows = np.frombuffer(raw.encode("ascii"), np.uint8).reshape(n, width)
    except UnicodeEncodeError:
        return Batch(Kind.MIXED)
    at = len(ns) + 1
    sep = rows[:, at + HASH_HEX] == _SEP
    if not sep.all():
        return Batch(Kind.TEXT if not sep.any() else Kind.MIXED)
    try:        # (unhexlify, unlike fromhex, skips no whitespace: n * 32 bytes or an error)
        hashes = unhexlify(rows[:, at:at + HASH_HEX].tobytes())
    except ValueError:
        return Batch(Kind.MIXED)
    # the term's bytes that the digest's ``halves`` take: the part's first 8 * halves, and its
    # length in the 16th
    term = np.zeros((n, 8 * halves), np.uint8)
    k = min(part, 8 * halves)
    term[:, :k] = rows[:, at + HASH_HEX + 1:at + HASH_HEX + 1 + k]
    if halves == 2:
        term[:, 15] = part
    term ^= np.frombuffer(_salt(ns), np.uint8)[:8 * halves]
    out = _words(hashes, n) @ (MIX if halves == 2 else _MIX0C)
    out ^= term.view("<u8")
    return Batch(Kind.PAGES, out)


def key_prefixes(keys: list[str], ns: Optional[str] = None) -> np.ndarray:
    """The first 8 bytes of each key's digest, as uint64 (what a view looks up); ``ns`` as for
    ``digest_list``."""
    batch = _classify(keys, ns, halves=1) if keys else Batch(Kind.TEXT)
    if batch.kind is Kind.PAGES:
        return batch.rows[:, 0]
    digested = map(xxh3_128_digest, map(str.encode, keys)) if batch.kind is Kind.TEXT else \
        map(digest, keys)
    return np.frombuffer(b"".join(digested), "<u8")[::2]


def page_prefixes(ns: str, page_hashes: list[str], parts: tuple[str, ...]) -> Optional[np.ndarray]:
    """The first 8 bytes of the digests of ``<ns>/<hash>/<part>`` for every part and hash,
    part-major (every hash's first part, then every hash's second, ...), as uint64 (what a
    view looks up), computed from the hex hashes in one pass; None when a hash is not 64 hex
    digits (then build the keys and use ``digests``)."""
    n = len(page_hashes)
    # joined by spaces, which fromhex skips: n * 32 bytes from n * 65 - 1 characters with a
    # space after every 64th leave no room for a hash of another length or with a space in it
    # (a length check of each hash costs 2 us of the 12 a 128-page probe takes)
    raw = " ".join(page_hashes)
    try:
        hashes = bytes.fromhex(raw)
    except ValueError:
        return None
    if len(hashes) != n * HASH_HEX // 2 or len(raw) != max(0, n * (HASH_HEX + 1) - 1) or \
            not (n < 2 or raw[HASH_HEX::HASH_HEX + 1].isspace()):
        return None
    terms = _terms8(ns, tuple(parts))
    if terms is None:
        return None
    first = _words(hashes, n) @ _MIX0
    if len(terms) == 1:
        first ^= terms[0]
        return first
    # part-major: the XOR's inner loop runs over the hashes (page-major, over the parts, it
    # took 1.9 us against 1.0 for 128 pages of two parts)
    return (terms[:, None] ^ first).ravel()


def _words(hashes: bytes, n: int) -> np.ndarray:
    """The ``n`` hashes as rows of eight little-endian 32-bit words (a product with MIX is taken
    in 64 bits)."""
    return np.frombuffer(hashes, "<u4").reshape(n, 8)


@functools.lru_cache(maxsize=256)
def _terms8(ns: str, parts: tuple[str, ...]) -> Optional[np.ndarray]:
    """The first 8 bytes of each part's term (see ``_term``), as uint64; None when a part is
    too long for a page key."""
    if any(len(p.encode()) > MAX_PART for p in parts):
        return None
    return np.array([int.from_bytes(_term(ns, p.encode())[:8], "little") for p in parts], np.uint64)

