"""Where a client's writes go: a Place names the chain its keys belong to and how many copies
the hot ones want; the master answers a node per key (and nodes for further copies), and the
client writes each node's share. A key is stored once any of its writes is.

``Chain`` is what a writer knows of its keys: the key before them in their prefix chain
(SGLang passes it as ``extra_info.prefix_keys``), and how many of them, from the first, every
instance will read (a shared system prompt, a chain's first pages, a namespace marked hot). The
master keeps a chain on one node and puts the copies of hot keys on distinct nodes
(master/placement.py).

Copies of what a client reads (``replicate_reads``): a key read is one another instance will
likely read too (the trace's reused prefixes are read again and again), so after a read the
client asks the master where further copies go, for keys it has not asked about lately, and
writes them from the bytes it just read and verified. It costs that client one Place and the
writes, once per key.
"""
from __future__ import annotations

import logging
from collections import defaultdict
from typing import NamedTuple, Sequence

import zmq

from .. import protocol as P
from ..errors import HicacheError
from .batch import check_batch

log = logging.getLogger(__name__)

# Keys whose copies this client asked for lately (not asked again); forgotten all at once past
# this many: an ask for keys already copied costs one Place, answered with nothing to do.
COPIED_MAX = 1 << 16


class Failed(NamedTuple):
    """The part of a call that met failing nodes."""
    keys: list[int]     # indices of the keys they held or were to take
    nodes: list[str]


class Chain(NamedTuple):
    """A put's keys as part of a prefix chain (see the module docstring)."""
    parent: str = ""        # the key before keys[0] in the chain ("" = its first, or unknown)
    hot: int = 0            # the first ``hot`` keys want the client's ``replicas`` copies


NO_CHAIN = Chain()


def by_node(targets: list, copies: list) -> dict[str, list[int]]:
    """Node id -> the indices of the keys to write there: each key's target (None: stored
    already; "": no node) and its further copies."""
    out: dict[str, list[int]] = defaultdict(list)
    for i, target in enumerate(targets):
        if target:
            out[target].append(i)
    for i, more in enumerate(copies):
        for node_id in more:
            out[node_id].append(i)
    return out


class Copied:
    """The keys a client asked copies of lately (bounded)."""

    def __init__(self, limit: int = COPIED_MAX):
        self.limit = limit
        self._keys: set[str] = set()

    def new(self, keys: list[str]) -> list[int]:
        """The indices of ``keys`` not asked about lately; they count as asked from now on."""
        fresh = [i for i, k in enumerate(keys) if k not in self._keys]
        if len(self._keys) + len(fresh) > self.limit:
            self._keys.clear()
        self._keys.update(keys[i] for i in fresh)
        return fresh


class WritePath:
    """StoreClient's puts and copies (a mixin: the client's channels, node table and circuits)."""

    def batch_put_from(self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int],
                       chain: Chain = NO_CHAIN) -> list[bool]:
        """Store each object from ``ptrs[i]``; True once stored (or stored already). A stored
        object is visible to this client's next lookup at once, to other clients as soon as
        the master has the node's report of it (sent before the node answers). ``chain``: the
        keys' place in a prefix chain, and how many of them want ``replicas`` copies
        (client/writes.py)."""
        keys, ptrs, sizes = check_batch(keys, ptrs, sizes)
        n = len(keys)
        result = self._guard(lambda: self._put(keys, ptrs, sizes, chain), [False] * n)
        self.counters["put_keys"] += n
        self.counters["put_ok"] += sum(result)
        return result

    def _put(self, keys, ptrs, sizes, chain: Chain) -> list[bool]:
        if not keys:
            return []
        result = self._write(keys, ptrs, sizes, chain, self._deadline())
        if self.view is not None:       # answered as stored by the view (read-your-writes)
            self.view.own.add([k for k, ok in zip(keys, result) if ok])
        return result

    def _write(self, keys, ptrs, sizes, chain: Chain, deadline: float) -> list[bool]:
        """The master places the keys (keys stored already are done, though they may want
        copies), then per node a Reserve, the copy and a Commit (the transport's ``write``).
        A key is stored once any of its writes is. Keys whose node failed meanwhile are placed
        once more, avoiding it."""
        result = [False] * len(keys)
        failed = self._place_and_write(list(range(len(keys))), keys, ptrs, sizes, chain, deadline,
                                       result, ())
        again = [i for i in failed.keys if not result[i]]
        if again:
            self._place_and_write(again, keys, ptrs, sizes, chain, deadline, result, failed.nodes)
        return result

    def _place_and_write(self, which: list[int], keys, ptrs, sizes, chain: Chain, deadline: float,
                         result: list[bool], down) -> "Failed":
        """Place keys ``which`` and write them, into ``result``; the keys and the nodes of the
        nodes that failed."""
        copies = self.config.replicas
        sub = [keys[i] for i in which]
        hot = len([i for i in which if i < chain.hot]) if copies > 1 else 0
        placed = self._master(P.PlaceRequest(
            sub, [sizes[i] for i in which], self.host, chain.parent, hot, copies,
            [*self.node_circuits.open_ids(), *down]), deadline)
        self._learn(placed.nodes)
        for j, target in enumerate(placed.targets):
            result[which[j]] = result[which[j]] or target is None     # None: already stored
        failed = Failed([], [])
        for node_id, idx in by_node(placed.targets, placed.copies).items():
            idx = [which[j] for j in idx]
            node, sub_sizes = self._nodes[node_id], [sizes[i] for i in idx]
            got = self._on_node(node, len(idx), lambda t: self._write_on(
                t, node, [keys[i] for i in idx], [ptrs[i] for i in idx], sub_sizes, deadline))
            for i, good in zip(idx, got.ok):
                result[i] = result[i] or good
            if got.failed:
                failed.keys.extend(idx)
                failed.nodes.append(node_id)
            self.counters["bytes_written"] += sum(s for s, g in zip(sub_sizes, got.ok) if g)
        return failed

    def copy_reads(self, good: list[int], keys, ptrs, sizes, deadline: float) -> None:
        """With ``replicate_reads``: copies of keys just read and verified (indices ``good``),
        on further nodes, for keys not asked about lately; never a failure of the read."""
        cfg = self.config
        if not (cfg.replicate_reads and cfg.replicas > 1 and cfg.verify_checksums and good):
            return
        fresh = [good[j] for j in self.copied.new([keys[i] for i in good])]
        if not fresh:
            return
        try:
            self._write([keys[i] for i in fresh], [ptrs[i] for i in fresh],
                        [sizes[i] for i in fresh], Chain("", len(fresh)), deadline)
        except (HicacheError, zmq.ZMQError) as exc:
            self.counters["copy_errors"] += 1
            log.debug("copies of keys read were not made: %s", exc)
