"""Key digests (keydigest.py): SGLang page keys digested from their page hashes, in one pass or
one key at a time alike, and every other key by xxh3-128 of its text."""
import hashlib

import numpy as np
import pytest
from xxhash import xxh3_128_digest

from hicache_mc import keydigest as K
from hicache_mc.client.digests import prefixes
from hicache_mc.keys import batch_page_keys

NS = "0123456789abcdef@teamA"
HASHES = [hashlib.sha256(str(i).encode()).hexdigest() for i in range(50)]


@pytest.mark.parametrize("parts", [("k", "v"), ("kv",), ("0", "1", "2"), ("a" * 15,), ("",)])
def test_a_batch_of_page_keys_is_digested_as_each_key_alone(parts):
    keys = batch_page_keys(NS, HASHES, parts)
    one_by_one = [K.digest(k) for k in keys]
    assert K.digest_list(keys, NS) == one_by_one
    assert K.digests(keys) == b"".join(one_by_one)
    assert len(set(one_by_one)) == len(keys)            # parts and pages all apart
    # the page hash is the digest, but for the namespace's salt and the part
    h = bytes.fromhex(HASHES[0])[:16]
    assert K.digest(keys[0]) != h and K.digest(keys[0]) != xxh3_128_digest(keys[0].encode())
    part_major = [k for p in parts for k in batch_page_keys(NS, HASHES, (p,))]
    assert np.array_equal(K.page_prefixes(NS, HASHES, parts), prefixes(K.digests(part_major)))


def test_other_keys_are_digested_by_their_text():
    h = HASHES[0]
    for key in (f"{NS}/{h[:-1]}/k", f"{NS}/{h}x/k", f"{NS}/{h}/{'p' * 16}", f"{NS}/{h}",
                f"{NS}/{h[:30]} {h[31:]}/k", "plain", "ns/page0", f"{NS}/{h[:-2]}é/k"):
        assert K.digest(key) == xxh3_128_digest(key.encode()), key
    mixed = [f"{NS}/{h}/k", f"{NS}/{h[:30]} {h[31:]}/k"] * 4      # one batch: key by key
    assert K.digest_list(mixed, NS) == [K.digest(k) for k in mixed]
    assert K.digest_list(mixed, NS)[1] == xxh3_128_digest(mixed[1].encode())


def test_the_same_page_in_another_namespace_or_part_has_another_digest():
    h = HASHES[0]
    assert len({K.digest(f"{ns}/{h}/{p}") for ns in ("a", "b", "a@t") for p in ("k", "v", "kv")}) == 9
    # a part's length is part of its term: "k" and "k\0" differ
    assert K.digest(f"a/{h}/k") != K.digest(f"a/{h}/k\0")


def test_page_prefixes_refuse_what_is_no_page_hash():
    h = HASHES[0]
    for bad in ([h[:-2], h + "ab"], [h[:62] + "  "], [h[:-1] + "g"], ["é" * 64], [h, h[:62], h + "ab"],
                [h[:62] + " ", " " + h[2:], h], [h[:63] + "\t", h], [h + " "], [" " + h[1:] + " ", h]):
        assert K.page_prefixes(NS, bad, ("k", "v")) is None, bad
    assert K.page_prefixes(NS, [], ("k",)).size == 0


def test_a_views_prefixes_of_keys_are_those_of_their_digests():
    for parts in (("k", "v"), ("",), ("a" * 8,), ("b" * 9, "c" * 9), ("d" * 15,)):
        keys = batch_page_keys(NS, HASHES, parts)
        assert np.array_equal(K.key_prefixes(keys, NS), prefixes(K.digests(keys))), parts
    keys = batch_page_keys(NS, HASHES, ("k", "v")) + [f"{NS}/odd"]
    assert np.array_equal(K.key_prefixes(keys, NS), prefixes(K.digests(keys)))     # key by key
    # a hash is a hash, whatever its case: upper and lower case share a digest
    assert K.digest(f"{NS}/{HASHES[0].upper()}/k") == K.digest(f"{NS}/{HASHES[0]}/k")


def test_hashes_that_differ_in_any_one_word_have_distinct_digests():
    """Every 8 bytes of the page hash count: hex counters, and hashes that differ only in
    their last bytes or by two words swapped, never share a digest (nor an 8-byte prefix)."""
    counters = {f"{i:064x}" for i in range(20000)} | {f"{i << 200:064x}" for i in range(1, 5000)} \
        | {f"{i << 128:064x}" for i in range(1, 20000)} | {f"{i:032x}" * 2 for i in range(1, 20000)} \
        | {f"{i << 60:064x}" for i in range(1, 20000)} | {f"{i:x}".ljust(64, "0") for i in range(1, 20000)} \
        | {f"{i << 31:064x}" for i in range(1, 20000)} | {f"{i << 32 | i:064x}" for i in range(1, 20000)}
    keys = batch_page_keys(NS, sorted(counters), ("k",))
    assert len(set(K.digest_list(keys, NS))) == len(keys)
    assert len(set(K.key_prefixes(keys, NS).tolist())) == len(keys)
    a, b = "1" * 16, "2" * 16
    assert K.digest(f"{NS}/{a}{b}{a}{a}/k") != K.digest(f"{NS}/{b}{a}{a}{a}/k")


def test_a_batch_of_several_namespaces_is_digested_as_each_key_alone():
    keys = batch_page_keys(NS, HASHES, ("k", "v")) + batch_page_keys("other", HASHES[:9], ("kv",)) \
        + [f"{NS}/plain", "nons"] + [f"n{i}/{HASHES[i]}/k" for i in range(3)]
    assert K.digest_list(keys) == [K.digest(k) for k in keys]
    assert K.digests(keys) == b"".join(K.digest(k) for k in keys)
