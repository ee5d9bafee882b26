"""The tcp transport: bytes through the node's stream port.

``TcpTransport`` (a ``LeasedTransport``) leases or reserves objects through the node's ZeroMQ
port and moves their bytes through the node's stream port (transport/stream.py): straight
between kernel and segment on the node, kernel and caller memory on the client.
"""
from __future__ import annotations

from typing import Callable

from .. import protocol as P
from ..rpc import Channel
from .base import ChecksumCounter, LeasedTransport
from .stream_client import StreamClient


class TcpTransport(LeasedTransport):
    name = "tcp"

    def __init__(self, channel_for: Callable[[str], Channel], checks: ChecksumCounter,
                 verify: bool = True, token: str = ""):
        super().__init__(channel_for, checks, verify)
        self.streams = StreamClient(token)

    def fetch(self, node, offsets, dsts, sizes, until):
        return self.streams.read(node.data_address, P.segment_of(node), offsets, dsts, sizes, until, self.verify)

    def store(self, node, offsets, srcs, sizes, until):
        return self.streams.write(node.data_address, P.segment_of(node), offsets, srcs, sizes, until)

    def close(self) -> None:
        self.streams.close()
