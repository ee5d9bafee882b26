"""SGLang router's approximate radix tree, over page hashes instead of characters.

SGLang's ``cache_aware`` policy (sgl-project/sglang, ``sgl-model-gateway`` /
``sgl-router``: ``src/policies/tree.rs``) keeps one multi-tenant radix tree of the raw text of
the requests it routed, a tenant per worker: inserting a request marks its whole path for the
worker it was sent to, with the time; a match walks the tree as deep as the text goes and
names a worker holding the deepest matched node (so holding the whole matched path); every
eviction interval, each worker over ``max_tree_size`` characters loses its least recently
used leaves until it fits.

Here the "text" of a request is its chain of page hashes: a node is a page, and a page hash
already names its whole prefix (SGLang chains them), so the tree is a dict of pages with a
parent link. One page stands for its ``page_tokens`` tokens of text; sizes count pages.
Where SGLang takes the first tenant of a hash map at the deepest node (any of them), this
takes the most recently used one, to stay deterministic.
"""
from __future__ import annotations

import heapq
from typing import NamedTuple, Optional, Sequence


class Match(NamedTuple):
    pages: int                   # leading pages of the chain in the tree (any tenant)
    tenant: Optional[str]        # a tenant holding all of them; None when pages == 0


class _Node:
    __slots__ = ("key", "parent", "tenants", "kids")

    def __init__(self, key: str, parent: Optional["_Node"]):
        self.key, self.parent = key, parent
        self.tenants: dict[str, float] = {}      # tenant -> last access
        self.kids: dict[str, int] = {}           # tenant -> children holding it


class ApproxTree:
    def __init__(self) -> None:
        self.nodes: dict[str, _Node] = {}
        self.size: dict[str, int] = {}           # tenant -> pages held

    def add_tenant(self, tenant: str) -> None:
        self.size.setdefault(tenant, 0)

    def remove_tenant(self, tenant: str) -> None:
        for key in [k for k, n in self.nodes.items() if tenant in n.tenants]:
            node = self.nodes[key]
            del node.tenants[tenant]
            node.kids.pop(tenant, None)
            if not node.tenants:
                del self.nodes[key]
        self.size.pop(tenant, None)

    def insert(self, chain: Sequence[str], tenant: str, now: float) -> None:
        nodes, parent = self.nodes, None
        for key in chain:
            node = nodes.get(key)
            if node is None:
                node = nodes[key] = _Node(key, parent)
            if tenant not in node.tenants:
                self.size[tenant] = self.size.get(tenant, 0) + 1
                if parent is not None:
                    parent.kids[tenant] = parent.kids.get(tenant, 0) + 1
            node.tenants[tenant] = now
            parent = node

    def match(self, chain: Sequence[str]) -> Match:
        nodes, node, n = self.nodes, None, 0
        for key in chain:
            nxt = nodes.get(key)
            if nxt is None:
                break
            node, n = nxt, n + 1
        if node is None:
            return Match(0, None)
        return Match(n, max(node.tenants.items(), key=lambda kv: (kv[1], kv[0]))[0])

    def smallest_tenant(self, tenants: Sequence[str]) -> str:
        """The tenant holding the fewest pages (ties: the first in ``tenants``)."""
        return min(tenants, key=lambda t: self.size.get(t, 0))

    def evict(self, max_pages: int) -> int:
        """Drop least recently used leaves of every tenant over ``max_pages``; returns how
        many (tenant, page) marks went."""
        over = {t for t, s in self.size.items() if s > max_pages}
        if not over:
            return 0
        heap = []
        for key, node in self.nodes.items():
            for t in over.intersection(node.tenants):
                if not node.kids.get(t):
                    heap.append((node.tenants[t], t, key))
        heapq.heapify(heap)
        dropped = 0
        while heap:
            _, t, key = heapq.heappop(heap)
            node = self.nodes.get(key)
            if (self.size[t] <= max_pages or node is None or t not in node.tenants
                    or node.kids.get(t)):
                continue                          # fits now, gone, or no longer a leaf
            del node.tenants[t]
            node.kids.pop(t, None)
            self.size[t] -= 1
            dropped += 1
            parent = node.parent
            if not node.tenants:
                del self.nodes[key]
            if parent is not None:
                left = parent.kids.get(t, 0) - 1
                parent.kids[t] = left
                if left <= 0 and t in parent.tenants:
                    heapq.heappush(heap, (parent.tenants[t], t, parent.key))
        return dropped
