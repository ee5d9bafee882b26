"""chain.py against SGLang 0.5.23's own hashing: page keys, storage seeds, event block hashes.

The event side runs SGLang's ``KVCacheEventRecorder.record_store`` over radix nodes split at
random page boundaries, so the salt-seeded chain, the LoRA / Dynamo namespace rule and the
parent links are SGLang's, not a reading of them.
"""
from __future__ import annotations

import os
import sys
from array import array
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hicache_mc.conductor import chain as C
from hicache_mc.keys import batch_page_keys

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(TESTS, "sglang"))
from sglang_env import apply_torchvision_stub  # noqa: E402

apply_torchvision_stub()
sg_utils = pytest.importorskip("sglang.srt.mem_cache.utils")
from sglang.srt.disaggregation.kv_events import (BlockStored, kv_event_namespace_seed,  # noqa: E402
                                                 namespaced_block_hash)
from sglang.srt.mem_cache.events import KVCacheEventRecorder, KvEventLoraNames  # noqa: E402
from sglang.srt.mem_cache.radix_cache import RadixKey, TreeNode  # noqa: E402

# SGLang's first hash loads its C++ extension (torch's cpp_extension loader: 5 s of CPU, 20 s
# of wall on a busy 2-core host); paid once here at import, with SGLang's other imports, not
# inside the first test that happens to call it.
sg_utils.get_hash_str([0], None, page_size=1)

U32 = st.integers(0, 2**32 - 1)
TOKENS = st.lists(st.one_of(U32, st.integers(0, 200)), max_size=300)
NAMES = st.one_of(st.none(), st.text(max_size=6))
PAGES = st.sampled_from([1, 2, 3, 16, 64])
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def whole(tokens, page):
    return tokens[:len(tokens) // page * page]


@SETTINGS
@given(TOKENS, PAGES)
def test_page_hashes_match_get_hash_str(tokens, page):
    expected = sg_utils.get_hash_str(whole(tokens, page), None, page_size=page)
    assert C.hash_pages(tokens, page) == expected


@SETTINGS
@given(st.lists(st.integers(0, 2**63 - 1), max_size=40), PAGES)
def test_wide_token_pages_match(tokens, page):
    expected = sg_utils.get_hash_str(whole(tokens, page), None, page_size=page)
    assert C.hash_pages(tokens, page) == expected


@SETTINGS
@given(TOKENS, PAGES, NAMES, NAMES)
def test_storage_chain_matches_get_storage_hash_str(tokens, page, extra, salt):
    ns = C.CacheNamespace(extra_key=extra, cache_salt=salt)
    key = RadixKey(array("q", whole(tokens, page)), extra_key=extra, cache_salt=salt)
    expected = sg_utils.get_storage_hash_str(key, None, page_size=page)
    assert C.chain(tokens, page, ns).page_hashes == expected


@SETTINGS
@given(st.text(min_size=16, max_size=64, alphabet="0123456789abcdef"), NAMES, NAMES)
def test_block_hash_and_namespace_seed(hexstr, extra, salt):
    assert C.block_hash(hexstr) == sg_utils.hash_str_to_int64(hexstr)
    ns = C.CacheNamespace(extra_key=extra, cache_salt=salt, dynamo_format=True)
    seed = kv_event_namespace_seed(extra_key=extra, cache_salt=ns.cache_salt)  # "": none
    assert C.event_seed(ns) == seed
    b = C.block_hash(hexstr)
    assert C.namespaced(b, seed) == namespaced_block_hash(b, namespace_seed=seed)


def recorded_block_hashes(tokens, page, ns: C.CacheNamespace, cuts):
    """What SGLang's recorder publishes when ``tokens`` enter a radix tree as nodes cut at
    ``cuts`` (page counts)."""
    names = KvEventLoraNames()
    if ns.lora and ns.extra_key is not None:
        names.register(SimpleNamespace(extra_key=ns.extra_key, lora_id="id"), "adapter")
    rec = KVCacheEventRecorder(enabled=True, page_size=page, dynamo_format=ns.dynamo_format,
                               lora_names=names)
    root = TreeNode()
    root.key, root.hash_value = RadixKey(array("q"), extra_key=None), []
    parent, start, n = root, 0, len(tokens) // page
    for end in [min(c, n) for c in cuts] + [n]:
        if end <= start:
            continue
        node = TreeNode()
        node.parent = parent
        node.key = RadixKey(array("q", tokens[start * page:end * page]), extra_key=ns.extra_key,
                            cache_salt=ns.cache_salt)
        rec.record_store(node)
        parent, start = node, end
    return [h for e in rec.take() if isinstance(e, BlockStored) for h in e.block_hashes]


@SETTINGS
@given(TOKENS, PAGES, NAMES, NAMES, st.booleans(), st.booleans(),
       st.lists(st.integers(1, 40), max_size=3))
def test_event_block_hashes_match_the_recorder(tokens, page, extra, salt, lora, dynamo, cuts):
    ns = C.CacheNamespace(extra_key=extra, cache_salt=salt, lora=lora, dynamo_format=dynamo)
    expected = recorded_block_hashes(tokens, page, ns, sorted(cuts))
    assert C.chain(tokens, page, ns).block_hashes == expected


def test_namespaces_change_the_chain():
    tokens = list(range(256))
    plain = C.chain(tokens, 64)
    salted = C.chain(tokens, 64, C.CacheNamespace(cache_salt="s"))
    assert plain.block_hashes == [C.block_hash(h) for h in plain.page_hashes]
    assert salted.page_hashes != plain.page_hashes and salted.block_hashes != plain.block_hashes


def test_l3_keys_are_the_backends():
    c = C.chain(list(range(130)), 64)
    assert len(c.page_hashes) == 2      # the partial third page is never stored
    assert c.l3_keys("ns", ("k", "v")) == batch_page_keys("ns", c.page_hashes, ("k", "v"))


def test_bad_tokens_and_pages_raise():
    with pytest.raises(ValueError):
        C.hash_pages([1, -2], 1)
    with pytest.raises(ValueError):
        C.hash_pages([1], 0)
