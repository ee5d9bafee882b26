"""Tenants: what each tenant holds on one node, and what it may hold.

A tenant is the ``@tenant`` suffix of a key's namespace ("" for none). Per tenant the node
keeps its keys (any tier) in least-recently-used order with the bytes each is charged, the
bytes charged to its reservations in flight, and its quota (this node's share, from the
master). So a clear or a quota eviction walks the tenant's own keys, never every key on the
node, and a key that leaves is credited back exactly what it was charged.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Iterable, Optional

from ..keys import tenant_of
from ..protocol import MAX_TENANTS
from .dram import SLOT_ALIGN

# What an object costs beyond its bytes. The node: its records, key and index entries in RAM,
# measured as a node process's RssAnon growth per object (benchmarks/bench_node_memory.py:
# 560 B at 200k 1-byte objects with SGLang-shaped 89-character keys, 594 B at 50k; the storage
# core alone holds 481 B per object in DRAM and 449 B per object on SSD only, by tracemalloc).
# The DRAM tier counts it against its capacity with each slot.
NODE_OBJECT_BYTES = 600
# The master: its index entry per key (docs/architecture.md, 157 B at 1M keys).
MASTER_KEY_BYTES = 160
OBJECT_BYTES = NODE_OBJECT_BYTES + MASTER_KEY_BYTES


def charge(size: int) -> int:
    """What an object of ``size`` bytes counts against its tenant's quota: the DRAM slot it
    takes (a multiple of SLOT_ALIGN, one at least: a 0-byte object too) and what its records
    cost the node and the master."""
    return max(SLOT_ALIGN, -(-size // SLOT_ALIGN) * SLOT_ALIGN) + OBJECT_BYTES


class Tenant:
    __slots__ = ("keys", "held", "reserved")

    def __init__(self):
        self.keys: "OrderedDict[str, int]" = OrderedDict()    # key -> bytes charged; LRU first
        self.held = 0           # bytes charged to its keys
        self.reserved = 0       # bytes charged to its reservations not yet committed


class Tenants:
    def __init__(self):
        self._t: dict[str, Tenant] = {}
        self._of: dict[str, str] = {}      # namespace -> tenant (a batch shares a few)
        self.quotas: dict[str, int] = {}   # tenant -> bytes this node may hold for it

    def tenant_of(self, key: str) -> str:
        ns = key.partition("/")[0]
        tenant = self._of.get(ns)
        if tenant is None:
            if len(self._of) >= 1 << 16:       # namespaces are many only under attack
                self._of.clear()
            tenant = self._of[ns] = tenant_of(ns)
        return tenant

    def _get(self, tenant: str) -> Tenant:
        t = self._t.get(tenant)
        if t is None:
            t = self._t[tenant] = Tenant()
        return t

    def _drop_if_empty(self, tenant: str, t: Tenant) -> None:
        if not t.keys and not t.reserved:
            del self._t[tenant]

    # ------------------------------------------------------------ keys

    def add(self, key: str, charge: int) -> None:
        """``key`` is held on the node now, charged ``charge`` bytes (a key held already is
        charged anew)."""
        tenant = self.tenant_of(key)
        t = self._get(tenant)
        t.held += charge - t.keys.pop(key, 0)
        t.keys[key] = charge

    def remove(self, key: str) -> Optional[int]:
        """``key`` left the node; what it was charged (None when it was not held)."""
        tenant = self.tenant_of(key)
        t = self._t.get(tenant)
        charge = t.keys.pop(key, None) if t is not None else None
        if charge is None:
            return None
        t.held -= charge
        self._drop_if_empty(tenant, t)
        return charge

    def touch(self, key: str) -> None:
        """``key`` was used: last in its tenant's eviction order."""
        t = self._t.get(self.tenant_of(key))
        if t is not None and key in t.keys:
            t.keys.move_to_end(key)

    def keys(self, tenant: Optional[str] = None, prefix: str = "") -> list[str]:
        """The keys held of ``tenant`` (every tenant's when None) that start with ``prefix``,
        least recently used first per tenant."""
        ts = self._t.values() if tenant is None else [self._t[tenant]] if tenant in self._t else []
        return [k for t in ts for k in t.keys if k.startswith(prefix)]

    def first(self, tenant: str, wanted: Callable[[str], bool]) -> Optional[str]:
        """The tenant's least recently used key that is ``wanted``."""
        t = self._t.get(tenant)
        return next((k for k in t.keys if wanted(k)), None) if t is not None else None

    # ------------------------------------------------------------ reservations and quotas

    def reserve(self, key: str, charge: int) -> None:
        self._get(self.tenant_of(key)).reserved += charge

    def unreserve(self, key: str, charge: int) -> None:
        """A reservation of ``key`` ended (committed, lapsed, given back)."""
        tenant = self.tenant_of(key)
        t = self._t.get(tenant)
        if t is not None:
            t.reserved -= charge
            self._drop_if_empty(tenant, t)

    def quota(self, tenant: str) -> Optional[int]:
        return self.quotas.get(tenant)

    def over(self, tenant: str, extra: int) -> int:
        """Bytes the tenant would be over its quota with ``extra`` more (<= 0: within it)."""
        quota = self.quotas.get(tenant)
        if quota is None:
            return 0
        t = self._t.get(tenant)
        return (t.held + t.reserved if t is not None else 0) + extra - quota

    def held(self, tenant: str) -> int:
        t = self._t.get(tenant)
        return t.held if t is not None else 0

    def reserved(self, tenant: str) -> int:
        t = self._t.get(tenant)
        return t.reserved if t is not None else 0

    def usage(self, most: int = MAX_TENANTS) -> dict[str, int]:
        """The bytes held by the ``most - 1`` biggest tenants, the rest summed under
        "(other)": a node's stats stay within what a heartbeat may carry however many
        tenants write to it."""
        return top_tenants({name: t.held for name, t in self._t.items()}, most)

    def names(self) -> Iterable[str]:
        return self._t.keys()


def top_tenants(usage: dict[str, int], most: int = MAX_TENANTS) -> dict[str, int]:
    """The ``most - 1`` biggest entries of ``usage`` (zeros left out), the rest summed under
    "(other)"."""
    held = {t: b for t, b in usage.items() if b}
    if len(held) < most:
        return held
    top = dict(sorted(held.items(), key=lambda kv: kv[1], reverse=True)[: most - 1])
    top["(other)"] = sum(held.values()) - sum(top.values())
    return top
