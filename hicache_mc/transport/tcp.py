"""The tcp transport: bytes through the node's stream port, or as ZeroMQ frames.

``TcpTransport`` (a ``LeasedTransport``) leases or reserves objects through the node's ZeroMQ
port and moves their bytes through the node's stream port (transport/stream.py): straight
between kernel and segment on the node, kernel and caller memory on the client. Objects held
only on SSD, and nodes that run no stream port, go through ``FramesTransport``.

``FramesTransport``: the bytes travel in ZeroMQ messages (``Read`` / ``Write``), the node
reading SSD-only objects from disk itself. A batch is cut into groups of about
``GROUP_BYTES``; every group is a request of its own and all of them are sent before the first
reply is awaited, so the stages overlap: on a put the client hashes group k+1 while ZeroMQ
sends group k and the node stores group k-1; on a get the client copies (and verifies) group k
out of its frames while the node sends group k+1. Payload frames are sent without copies (from
caller memory on a put, from leased DRAM on a get).
"""
from __future__ import annotations

from typing import Callable

from .. import protocol as P
from ..rpc import Channel
from .base import (ChecksumCounter, LeasedTransport, Transport, address_of, buffer_at, copy_many,
                   groups, hash_many)
from .stream import StreamClient

GROUP_BYTES = 4 << 20


class TcpTransport(LeasedTransport):
    name = "tcp"

    def __init__(self, channel_for: Callable[[str], Channel], checks: ChecksumCounter,
                 verify: bool = True, token: str = ""):
        super().__init__(channel_for, checks, verify, FramesTransport(channel_for, checks, verify))
        self.streams = StreamClient(token)

    def read(self, node, keys, ptrs, sizes, deadline):
        if not node.data_address:
            return self.stream.read(node, keys, ptrs, sizes, deadline)
        return super().read(node, keys, ptrs, sizes, deadline)

    def write(self, node, keys, ptrs, sizes, deadline):
        if not node.data_address:
            return self.stream.write(node, keys, ptrs, sizes, deadline)
        return super().write(node, keys, ptrs, sizes, deadline)

    def fetch(self, node, offsets, dsts, sizes, until):
        return self.streams.read(node.data_address, P.segment_of(node), offsets, dsts, sizes, until, self.verify)

    def store(self, node, offsets, srcs, sizes, until):
        return self.streams.write(node.data_address, P.segment_of(node), offsets, srcs, sizes, until)

    def close(self) -> None:
        self.streams.close()


class FramesTransport(Transport):
    name = "tcp-frames"

    def __init__(self, channel_for: Callable[[str], Channel], checks: ChecksumCounter,
                 verify: bool = True):
        self.channel_for = channel_for      # node address -> this thread's channel
        self.checks = checks
        self.verify = verify

    def read(self, node, keys, ptrs, sizes, deadline):
        ch = self.channel_for(node.address)
        parts = groups(sizes, GROUP_BYTES)
        rids = [ch.send(P.ReadRequest([keys[i] for i in idx])) for idx in parts]
        out = [False] * len(keys)
        try:
            for idx, rid in zip(parts, rids):
                reply, frames = ch.recv(rid, deadline)
                self._take(P.raise_if_error(reply), frames, idx, keys, ptrs, sizes, out)
        finally:
            ch.forget(rids)
        return out

    def _take(self, reply, frames, idx, keys, ptrs, sizes, out) -> None:
        """Copy one group's frames into caller memory, verifying on the copy."""
        it, todo, srcs, sums = iter(frames), [], [], []
        for i, have, expected in zip(idx, reply.sizes, reply.checksums):
            if have < 0:
                continue
            buf = next(it).buffer
            if have != sizes[i] or len(buf) != have:
                continue
            todo.append(i)
            srcs.append(address_of(buf))
            sums.append(expected)
        got = copy_many([ptrs[i] for i in todo], srcs, [sizes[i] for i in todo], self.verify)
        for i, expected, actual in zip(todo, sums, got):
            out[i] = not self.verify or self.checks.check(keys[i], expected, actual)

    def write(self, node, keys, ptrs, sizes, deadline):
        ch = self.channel_for(node.address)
        rids, parts = [], groups(sizes, GROUP_BYTES)
        try:
            for idx in parts:   # hash this group while the previous one is on the wire
                sub_ptrs, sub_sizes = [ptrs[i] for i in idx], [sizes[i] for i in idx]
                payload = [buffer_at(p, s) for p, s in zip(sub_ptrs, sub_sizes)]
                rids.append(ch.send(P.WriteRequest([keys[i] for i in idx],
                                                   hash_many(sub_ptrs, sub_sizes)), payload))
            out = [False] * len(keys)
            for idx, rid in zip(parts, rids):
                reply = P.raise_if_error(ch.recv(rid, deadline)[0])
                self.committed(node, reply.seq)
                for i, ok in zip(idx, reply.ok):
                    out[i] = ok
            return out
        finally:
            ch.forget(rids)
