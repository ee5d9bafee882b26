"""NodeRounds: the rounds a get or a put runs with one node, around a transport's copy.

    read:   Lease -> the transport copies the leased ranges out -> Release
    write:  Reserve -> the transport copies into the reserved slots -> Commit

A transport only moves bytes (``transport/base.py``); the client runs these rounds on its own
channel to the node and gets back what they did (``Written``: with the commit's report number,
its fence for read-your-writes). A batch goes in rounds of at most ``ROUND_BYTES``, each under
its own lease or reservation, so a round ends far inside it. A read that outlives its lease is
a miss (the slots may have been reused); a write that outlives its reservation is not
committed. A Lease or Reserve reply naming another segment than the client's record of the node
(the node restarted at the same address) is given back unused.
"""
from __future__ import annotations

import logging
import time
from typing import NamedTuple, Sequence

from .. import protocol as P
from ..errors import HicacheError
from ..rpc import Channel
from ..transport.base import Transport, groups

log = logging.getLogger(__name__)

ROUND_BYTES = 64 << 20      # one lease / reservation covers at most this much


class ChecksumCounter:
    """Counts and logs checksum mismatches (a mismatch is a miss, never a wrong page)."""

    def __init__(self):
        self.failures = 0

    def check(self, key: str, expected: int, actual: int) -> bool:
        if expected == actual:
            return True
        self.failures += 1
        log.warning("checksum mismatch on %s: treated as a miss", key)
        return False


class Written(NamedTuple):
    ok: list[bool]      # per key: stored (or stored already)
    seq: int            # the node's report number of the last commit (0: none)


class NodeRounds:
    def __init__(self, checks: ChecksumCounter, verify: bool = True):
        self.checks = checks
        self.verify = verify

    # -------------------------------------------------------------- get

    def read(self, ch: Channel, mover: Transport, node: P.NodeInfo, keys: list[str],
             ptrs: list[int], sizes: list[int], deadline: float) -> list[bool]:
        """Fill ``ptrs[i]`` with the object ``keys[i]`` held by ``node`` (reached through
        ``ch``); True only when its size is ``sizes[i]`` and its checksum matches."""
        out = [False] * len(keys)
        pending = list(range(len(keys)))
        while pending:
            later = []
            try:
                for group in groups([sizes[i] for i in pending], ROUND_BYTES):
                    later += self._read_round(ch, mover, node, [pending[j] for j in group], keys,
                                              ptrs, sizes, deadline, out)
            except HicacheError:
                if len(pending) == len(keys):
                    raise
                break       # a later round failed: what the earlier ones read stands
            if len(later) == len(pending):
                break       # DRAM could stage none of them: misses
            pending = later     # objects DRAM had no room for while the others were leased
        return out

    def _read_round(self, ch, mover, node, idx, keys, ptrs, sizes, deadline, out) -> list[int]:
        """Lease and read objects ``idx``; the ones the node could not stage into DRAM yet."""
        sent = time.monotonic()
        reply = P.raise_if_error(ch.recv(ch.send(P.LeaseRequest([keys[i] for i in idx])), deadline))
        if not self._same_segment(ch, node, reply, [keys[i] for i in idx]):
            return []
        until = sent + reply.ttl
        todo, sums, offs, spare, spare_offs, later = [], [], [], [], [], []
        for i, off, have, expected in zip(idx, reply.offsets, reply.sizes, reply.checksums):
            if off == P.LEASE_LATER:
                later.append(i)
            elif off >= 0 and have == sizes[i]:
                todo.append(i)
                offs.append(off)
                sums.append(expected)
            elif off >= 0:      # another size than asked: given back unread
                spare.append(keys[i])
                spare_offs.append(off)
        got = mover.fetch(node, offs, [ptrs[i] for i in todo], [sizes[i] for i in todo],
                          min(deadline, until)) if todo else []
        if todo and time.monotonic() > until:
            log.warning("%s read of %d objects outlived its lease; treated as misses",
                        mover.name, len(todo))
            damaged = []
        else:
            for i, expected, actual in zip(todo, sums, got):
                out[i] = not self.verify or self.checks.check(keys[i], expected, actual)
            # a copy made under the lease that does not match: the object may be damaged
            damaged = [not out[i] for i in todo] + [False] * len(spare)
        # done with the slots: the node may reuse them now (one Release). A failed fetch
        # releases nothing: a transfer it abandoned may still be running.
        self._release(ch, node, [keys[i] for i in todo] + spare, offs + spare_offs, damaged, deadline)
        return later

    # -------------------------------------------------------------- put

    def write(self, ch: Channel, mover: Transport, node: P.NodeInfo, keys: list[str],
              ptrs: list[int], sizes: list[int], deadline: float) -> Written:
        """Store each object from ``ptrs[i]`` on ``node`` and commit it."""
        out, seq = [False] * len(keys), 0
        for idx in groups(sizes, ROUND_BYTES):
            seq = max(seq, self._write_round(ch, mover, node, idx, keys, ptrs, sizes, deadline, out))
        return Written(out, seq)

    def _write_round(self, ch, mover, node, idx, keys, ptrs, sizes, deadline, out) -> int:
        """Reserve, fill and commit objects ``idx``; the commit's report number (0: none)."""
        sent = time.monotonic()
        reply = P.raise_if_error(ch.recv(ch.send(P.ReserveRequest([keys[i] for i in idx],
                                                                  [sizes[i] for i in idx])), deadline))
        if not self._same_segment(ch, node, reply, [keys[i] for i in idx]):
            return 0        # not stored
        until = sent + reply.ttl
        todo, offs = [], []
        for i, off in zip(idx, reply.offsets):
            if off == P.RESERVE_STORED:
                out[i] = True           # stored already
            elif off >= 0:
                todo.append(i)
                offs.append(off)
        if not todo:
            return 0
        try:
            sums = mover.store(node, offs, [ptrs[i] for i in todo], [sizes[i] for i in todo],
                               min(deadline, until))
        except Exception:
            # left reserved, the keys would answer "busy" to every writer until it lapses
            self._release(ch, node, [keys[i] for i in todo], offs)
            raise
        if time.monotonic() > until:
            log.warning("%s write outlived its reservation; not committing %d objects",
                        mover.name, len(todo))
            return 0
        reply = P.raise_if_error(ch.recv(ch.send(P.CommitRequest([keys[i] for i in todo], sums, offs)),
                                         deadline))
        for i, ok in zip(todo, reply.ok):
            out[i] = ok
        return reply.seq

    # -------------------------------------------------------------- both

    def _same_segment(self, ch, node, reply, asked: list[str]) -> bool:
        """Whether a Lease or Reserve reply's offsets are in the segment ``node`` (the record
        this client holds) describes. When not, the node restarted at the same address since
        the record was made: its leases or slots are given back, and the caller treats the keys
        as misses / not stored until a fresh record comes with a master reply."""
        if reply.segment == P.segment_of(node):
            return True
        held = [j for j, off in enumerate(reply.offsets) if off >= 0]
        self._release(ch, node, [asked[j] for j in held], [reply.offsets[j] for j in held])
        log.info("node %s restarted (segment %s, this client knew %s): %d keys wait for its new "
                 "record", node.node_id, reply.segment, P.segment_of(node), len(asked))
        return False

    @staticmethod
    def _release(ch, node, keys: list[str], offsets: list[int], damaged: Sequence[bool] = (),
                 deadline: float = 0.0) -> None:
        """Give back reserved slots that will not be written, or leases that will not be
        read (the reply is not awaited), or leases that were read: ``damaged`` says of each
        whether its copy failed its checksum. Then the node checks those objects, drops the
        ones that are damaged and tells the master before it answers (awaited until
        ``deadline``): once a read has missed on a damaged object, a put stores it again."""
        if not keys:
            return
        try:
            if any(damaged):
                ch.recv(ch.send(P.ReleaseRequest(keys, offsets, list(damaged))), deadline)
            else:
                ch.forget([ch.send(P.ReleaseRequest(keys, offsets))])
        except HicacheError as exc:     # unreleased leases and slots lapse on the node
            log.debug("release on %s failed: %s", node.node_id, exc)
