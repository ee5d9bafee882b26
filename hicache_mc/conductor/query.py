"""The residency query endpoint, for other routers: the matched prefix of a prompt on every
worker, per tier, in the shape of Mooncake's Conductor indexer ``/query``.

``POST /query`` ``{"token_ids": [...]}`` or ``POST /query_by_hash`` with SGLang's page hashes
(``{"page_hashes": ["<hex>", ...]}``: the HiCache storage keys, which also name the L3) or its
KV-event block hashes (``{"block_hash": [int, ...]}``, Mooncake's name; ``seq_hashes`` too:
L1 and L2 only). Optional: ``block_size`` (must be the conductor's page size),
``instance_id`` (one worker), ``cache_salt`` / ``extra_key`` (as in SGLang's requests).
Answer, in tokens, per tenant (always ``default``) and worker::

    {"default": {"w0": {"longest_matched": 512, "GPU": 256, "CPU": 128, "EXTERNAL": 512,
                        "DP": {"0": 256}}, ...}}

``GPU`` (Mooncake's G1) is the leading run in the worker's device pool, ``CPU`` (G2) the
leading run in device or host memory, ``EXTERNAL`` (G3 here: the shared hicache-mc pool,
SGLang's medium ``EXTERNAL``) the leading run in the L3, the same for every worker;
``longest_matched`` the longest prefix the worker can use from any of them. A worker whose
event stream is stalled is left out (its cache is unknown).
"""
from __future__ import annotations

from typing import Any, Optional

from .chain import CacheNamespace, block_hash, chain

MAX_QUERY = 1 << 20          # tokens or hashes in one query


class QueryError(ValueError):
    pass


def parse(doc: Any, by_hash: bool, page_size: int) -> tuple[list, Optional[list], Optional[str]]:
    """(block hashes, page hashes or None, instance filter) of a query body."""
    if not isinstance(doc, dict):
        raise QueryError("the body is not a JSON object")
    if page_size <= 0:
        raise QueryError("the conductor does not know the page size yet")
    size = doc.get("block_size")
    if size is not None and size != page_size:
        raise QueryError(f"block_size {size}: the workers' pages hold {page_size} tokens")
    inst = doc.get("instance_id")
    if by_hash:
        pages = doc.get("page_hashes")
        if pages is not None:
            if not _list_of(pages, str) or not all(len(h) == 64 for h in pages):
                raise QueryError("page_hashes: a list of 64-hex-digit SGLang page hashes")
            return [block_hash(h) for h in pages], pages, inst
        hashes = doc.get("block_hash", doc.get("seq_hashes"))
        if not _list_of(hashes, int):
            raise QueryError("give page_hashes (hex strings) or block_hash (ints)")
        return hashes, None, inst
    tokens = doc.get("token_ids")
    if not _list_of(tokens, int) or any(t < 0 for t in tokens):
        raise QueryError("token_ids: a list of non-negative ints")
    ns = CacheNamespace(doc.get("extra_key"), doc.get("cache_salt"))
    c = chain(tokens, page_size, ns)
    return c.block_hashes, c.page_hashes, inst


def _list_of(v: Any, t: type) -> bool:
    return isinstance(v, list) and len(v) <= MAX_QUERY and \
        all(isinstance(x, t) and not isinstance(x, bool) for x in v)


def answer(prefixes: dict, workers: list[str], l3_pages: Optional[int], page_size: int) -> dict:
    """The Mooncake-shaped answer from the index's prefixes (name -> Prefix) and the L3's."""
    out = {}
    l3 = l3_pages or 0
    for name in workers:
        p = prefixes.get(name)
        gpu, host = (p.gpu, p.host) if p is not None else (0, 0)
        doc = {"longest_matched": max(gpu + host, l3) * page_size, "GPU": gpu * page_size,
               "CPU": (gpu + host) * page_size, "DP": {"0": gpu * page_size}}
        if l3_pages is not None:
            doc["EXTERNAL"] = l3 * page_size
        out[name] = doc
    return {"default": out}
