"""TcpTransport: object bytes as ZeroMQ frames, sent and received without extra copies."""
from __future__ import annotations

from typing import Callable

from .. import protocol as P
from ..rpc import Channel
from .base import ChecksumCounter, Transport, buffer_at, checksum


class TcpTransport(Transport):
    name = "tcp"

    def __init__(self, channel_for: Callable[[str], Channel], checks: ChecksumCounter,
                 verify: bool = True):
        self.channel_for = channel_for      # node address -> this thread's channel
        self.checks = checks
        self.verify = verify

    def read(self, node, keys, ptrs, sizes, deadline):
        ch = self.channel_for(node.address)
        reply, frames = ch.recv(ch.send(P.ReadRequest(keys)), deadline)
        reply = P.raise_if_error(reply)
        out, it = [], iter(frames)
        for key, ptr, want, have, expected in zip(keys, ptrs, sizes, reply.sizes, reply.checksums):
            if have < 0:
                out.append(False)
                continue
            buf = next(it).buffer
            if have != want or len(buf) != have:
                out.append(False)
                continue
            if self.verify and not self.checks.check(key, expected, checksum(buf)):
                out.append(False)
                continue
            buffer_at(ptr, have)[:] = buf
            out.append(True)
        return out

    def write(self, node, keys, ptrs, sizes, checksums, deadline):
        ch = self.channel_for(node.address)
        payload = [buffer_at(p, s) for p, s in zip(ptrs, sizes)]
        reply, _ = ch.recv(ch.send(P.WriteRequest(keys, checksums), payload), deadline)
        return list(P.raise_if_error(reply).ok)
