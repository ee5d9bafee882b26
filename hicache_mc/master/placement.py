"""Placement: which nodes take the objects of a Place.

Placement keeps a prefix chain on one node and spreads chains across nodes: SGLang reads a
prefix's leading run only, so a chain split over nodes is cut by the loss of any of them, and
the pages after the cut are dead weight. A Place names the key before its keys (``parent``);
its keys join the parent's node, unless other chains branched off that key already (a shared
system prompt: then each branch is a chain of its own, placed where there is most room, the
writer's own host first) or the parent has copies. Keys that want copies (``replicas``) get
them on distinct nodes, the chain's same nodes for the whole call. Measured on the first 4,000
requests of Mooncake's conversation trace (simulated, 4 nodes, one lost half-way): hits in the
500 requests after the loss fall 14 % with chains, 57 % with each page on the node of most room.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import NamedTuple

from xxhash import xxh3_128_digest

from .. import protocol as P
from .index import KeyIndex, NodeSlots
from .registry import NodeRegistry, NodeState


class Ask(NamedTuple):
    """What a Place asks of ``place``, per object and for the call's chain."""
    sizes: list[int]
    want: list[int]                 # copies wanted of each object (1: one)
    held: list[tuple]               # live nodes holding each already (none for a new object)
    host: str                       # the writer's host: a new chain goes there first
    parent: tuple = ()              # live holders of the key before the call's keys
    follow: bool = True             # the call continues its parent's chain (no branch there)
    avoid: frozenset = frozenset()  # nodes the writer cannot reach


# Parents remembered to tell a chain's continuation from a branch: a parent named by a second
# Place (with keys to write) is a branch point. 16-byte digests in an LRU of this many (~100
# bytes each): far more than the chains written within any placement decision's horizon.
BRANCH_MEMORY = 1 << 16


class Branches:
    """How many Places named each recent parent key (bounded LRU)."""

    def __init__(self, limit: int = BRANCH_MEMORY):
        self.limit = limit
        self._named: OrderedDict[bytes, int] = OrderedDict()

    def note(self, parent: str) -> int:
        """Count one more Place naming ``parent``; how many have, this one included."""
        d = xxh3_128_digest(parent.encode())
        n = self._named.pop(d, 0) + 1
        self._named[d] = n
        if len(self._named) > self.limit:
            self._named.popitem(last=False)
        return n


def place(registry: NodeRegistry, ask: Ask) -> list[list[str]]:
    """Per object, the nodes to write it to (its first copy first, for an object no node
    holds yet): the chain's nodes (``_home``) while they have room, then the others by
    free space; never a node in ``ask.avoid``, nor one that missed its last heartbeat
    unless every node did; nodes without room when none has room (a node evicts to take
    it). [] for an object when no node is left to take it."""
    fresh = registry.takers(ask.avoid)
    free = {st.info.node_id: st.free for st in fresh}        # kept current as we place
    if not free:
        return [[] for _ in ask.sizes]
    home = _home(ask, fresh, free)
    order = home + sorted((n for n in free if n not in home), key=free.__getitem__, reverse=True)
    out = []
    for size, want, held in zip(ask.sizes, ask.want, ask.held):
        picks: list[str] = []
        for roomy in (True, False):     # full nodes evict their LRU objects to take more
            for node_id in order:
                if len(picks) + len(held) >= want:
                    break
                if node_id not in held and node_id not in picks and \
                        (free[node_id] >= size or not roomy):
                    picks.append(node_id)
                    free[node_id] -= size
        out.append(picks)
    for st in fresh:
        st.planned += st.free - free[st.info.node_id]
    return out


def _home(ask: "Ask", fresh: list[NodeState], free: dict[str, int]) -> list[str]:
    """The chain's nodes for this call: its parent's (while they have room for the call),
    else a new chain's, on the node with most room (the writer's host first); then the
    nodes with most room until there are as many as the most copies a key wants."""
    need = sum(size for size, want, held in zip(ask.sizes, ask.want, ask.held) if len(held) < want)
    home = [n for n in ask.parent if n in free] if ask.follow else []
    if home and free[home[0]] < need:
        home = []       # the chain's node is full: the rest starts a chain elsewhere
    if not home:
        roomy = [st for st in fresh if free[st.info.node_id] >= need] or fresh
        pool = [st for st in roomy if st.info.host == ask.host] or roomy
        home = [max(pool, key=lambda st: free[st.info.node_id]).info.node_id]
    copies = max(ask.want, default=1)
    for node_id in sorted(free, key=free.__getitem__, reverse=True):
        if len(home) >= copies:
            break
        if node_id not in home:
            home.append(node_id)
    return home[:max(copies, 1)]


def ask_of(msg: P.PlaceRequest, index: KeyIndex, registry: NodeRegistry, slots: NodeSlots,
           branches: Branches) -> Ask:
    """The Place as placement sees it: per key the copies wanted and the nodes holding it that
    could take it now (a copy on a node the writer cannot reach, or one late with its
    heartbeat, is written again elsewhere), and where the chain goes on (its parent's
    holders, unless it branched there)."""
    live, ids = {st.slot for st in registry.takers(msg.avoid)}, slots.ids
    copies = min(msg.replicas, max(1, len(registry.nodes)))
    want = [copies if i < msg.hot else 1 for i in range(len(msg.keys))]
    held = []
    for key, value, w in zip(msg.keys, index.get_many(msg.keys, live), want):
        if value is None or value >> 104 not in live:
            held.append(())
        elif w == 1:
            held.append((ids[value >> 104],))
        else:
            held.append(tuple(ids[s] for s in index.holders(key) if s in live))
    parent = tuple(ids[s] for s in index.holders(msg.parent) if s in live) if msg.parent else ()
    branched = bool(parent) and not all(held) and branches.note(msg.parent) > 1
    follow = not branched and (len(parent) == 1 or msg.hot > 0)
    return Ask(list(msg.sizes), want, held, msg.host, parent, follow, frozenset(msg.avoid))


class Placed(NamedTuple):
    """What one Place did, for the master's counters."""
    placed: int             # keys given their first copy
    copies_placed: int      # further copies asked of writers
    deduplicated: int       # keys stored already


def answer(ask: Ask, plan: list[list[str]], registry: NodeRegistry) -> tuple[P.PlaceReply, Placed]:
    """The reply to a Place from its plan: a stored key's target is None (its copies, if it
    wants more, in ``copies``); a new key's target is its first copy's node ("" when none)."""
    targets, copies = [], []
    for held, picks in zip(ask.held, plan):
        if held:
            targets.append(None)
            copies.append(picks)
        else:
            targets.append(picks[0] if picks else "")
            copies.append(picks[1:])
    nodes = {n: registry.nodes[n].record for picks in plan for n in picks}
    placed = sum(1 for held in ask.held if not held)
    counts = Placed(placed, sum(map(len, copies)), len(targets) - placed)
    return P.PlaceReply(targets, nodes, copies if any(copies) else []), counts
