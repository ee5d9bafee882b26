"""Key namespacing shared by the SGLang adapter, the GPU-direct path and the embedding cache.

SGLang's page key is a chained SHA-256 over token ids only: it says nothing of the model, the
KV dtype, the host layout or the page size, so two deployments could read each other's pages.
hicache-mc prefixes every key with a namespace: a short digest of everything that changes the
bytes of a page. A store key is ``<namespace>/<page hash>/<part>``; parts are ``k`` and ``v`` for
MHA and ``kv`` for MLA, in the order ``get_page_buffer_meta`` gives the pointers. A namespace
with a tenant ends in ``@<tenant>``: the store counts quotas and stats by it, and refuses a
client's key whose tenant is not the one its credential names (``foreign_key``).
"""
from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass
from typing import Optional

NAMESPACE_CHARS = 16   # 64 bits of SHA-256: collisions need ~4e9 distinct deployments
TENANT_SEP = "@"       # "<digest>@<tenant>": the store reads a key's tenant for quotas and stats
_TENANT_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


def check_tenant(tenant: str) -> str:
    """A tenant name is 1-64 of [A-Za-z0-9_.-] ("" = no tenant)."""
    if tenant and not _TENANT_RE.match(tenant):
        raise ValueError(f"tenant {tenant!r}: use 1-64 letters, digits, '_', '.' or '-'")
    return tenant


def with_tenant(namespace: str, tenant: str) -> str:
    return f"{namespace}{TENANT_SEP}{check_tenant(tenant)}" if tenant else namespace


def tenant_of(key: str) -> str:
    """The tenant a store key belongs to ("" for none): what follows '@' in its namespace."""
    ns = key.split("/", 1)[0]
    i = ns.rfind(TENANT_SEP)
    return ns[i + 1:] if i >= 0 else ""


def foreign_key(keys: list[str], tenant: str) -> Optional[str]:
    """The first of ``keys`` not in ``tenant`` (None: all are). The usual batch shares one
    namespace, checked once: every key between the least and the greatest shares a prefix
    both have."""
    if not keys:
        return None
    ns, sep, _ = keys[0].partition("/")
    if sep and tenant_of(ns) == tenant and min(keys).startswith(ns + "/") and \
            max(keys).startswith(ns + "/"):
        return None
    return next((k for k in keys if tenant_of(k) != tenant), None)


@dataclass(frozen=True)
class KVNamespace:
    """Everything that changes the bytes of a KV page. MLA pages are shared by all TP ranks."""
    model: str
    kv_dtype: str                 # e.g. "torch.bfloat16"
    layout: str                   # host layout: page_first, page_first_direct, page_head, layer_first
    page_size: int
    start_layer: int = 0
    end_layer: int = -1           # inclusive; -1 = all layers
    tp_size: int = 1
    tp_rank: int = 0
    is_mla: bool = False
    pp_rank: int = 0
    attn_cp_rank: int = 0
    tenant: str = ""
    attn_cp_size: int = 1         # a CP rank holds a slice of a page whose shape depends on the size

    def digest(self) -> str:
        fields = asdict(self)
        if self.is_mla:  # one copy of an MLA page serves every TP rank
            fields["tp_size"] = fields["tp_rank"] = None
        blob = json.dumps(["kv", fields], sort_keys=True).encode()
        return with_tenant(hashlib.sha256(blob).hexdigest()[:NAMESPACE_CHARS], self.tenant)

    def parts(self) -> tuple[str, ...]:
        return ("kv",) if self.is_mla else ("k", "v")


def page_keys(namespace: str, page_hash: str, parts: tuple[str, ...]) -> list[str]:
    """Store keys of one page, one per part."""
    return [f"{namespace}/{page_hash}/{p}" for p in parts]


def batch_page_keys(namespace: str, page_hashes: list[str], parts: tuple[str, ...]) -> list[str]:
    """Store keys of many pages, page-major: [p0/k, p0/v, p1/k, p1/v, ...]."""
    return [f"{namespace}/{h}/{p}" for h in page_hashes for p in parts]


def embedding_namespace(model: str, encoder_version: str = "", dtype: Optional[str] = None,
                        tenant: str = "") -> str:
    """Namespace of multimodal embeddings; never equal to a KV namespace."""
    blob = json.dumps(["emb", model, encoder_version, dtype, tenant]).encode()
    return with_tenant("emb-" + hashlib.sha256(blob).hexdigest()[:NAMESPACE_CHARS], tenant)
