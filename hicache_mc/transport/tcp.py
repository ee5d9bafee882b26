"""The tcp transport: bytes through the node's stream port.

``TcpTransport`` moves the bytes of the objects the client leased or reserved (through the
node's ZeroMQ port) through the node's stream port (transport/stream.py): straight between
kernel and segment on the node, kernel and caller memory on the client.
"""
from __future__ import annotations

from .. import protocol as P
from .base import Transport
from .stream_client import StreamClient


class TcpTransport(Transport):
    name = "tcp"

    def __init__(self, verify: bool = True, token: str = ""):
        super().__init__(verify)
        self.streams = StreamClient(token)

    def fetch(self, node, offsets, dsts, sizes, until):
        return self.streams.read(node.data_address, P.segment_of(node), offsets, dsts, sizes, until, self.verify)

    def store(self, node, offsets, srcs, sizes, until):
        return self.streams.write(node.data_address, P.segment_of(node), offsets, srcs, sizes, until)

    def close(self) -> None:
        self.streams.close()
