"""The client side of the node's stream port (the wire format is in ``stream.py``)."""
from __future__ import annotations

import select
import socket
import threading
import time
from contextlib import contextmanager
from typing import Optional, Sequence

import msgpack

from ..auth import credential
from ..errors import ProtocolError, StoreUnavailable
from ..protocol import MAX_HEADER_BYTES
from .base import buffer_at, recv_bytes, recv_hash
from .stream import _LEN, NONCE_BYTES, OK, STREAM_VERSION, _answer


def readable(sock: socket.socket) -> bool:
    """Whether ``sock`` has bytes or an end of stream to read right now (never waits; poll,
    not select, which fails on descriptors past 1023)."""
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    return bool(poller.poll(0))


class StreamClient:
    """Per-thread connections to nodes' stream ports; any failure drops the connection."""

    def __init__(self, token: str = ""):
        cred = credential(token)        # the cluster token, a credential, or ""
        self._claim = cred.claim if cred else b"admin:"
        self._key = cred.seed if cred else b""
        self._local = threading.local()
        self._all: set[socket.socket] = set()
        self._lock = threading.Lock()

    def _conn(self, address: str, deadline: float) -> socket.socket:
        conns = getattr(self._local, "conns", None)
        if conns is None:
            conns = self._local.conns = {}
        sock = conns.get(address)
        if sock is not None and readable(sock):
            # between requests the node sends nothing: bytes or an end of stream now mean it
            # closed the connection (it restarted, dropped the socket, or it sat idle past
            # the node's IDLE_S); connect anew
            self._drop(address)
            sock = None
        if sock is None:
            sock = self._connect(address, deadline)
            conns[address] = sock
            with self._lock:
                self._all.add(sock)
        return sock

    def _connect(self, address: str, deadline: float) -> socket.socket:
        """A new connection that has passed the node's handshake, all by ``deadline``."""
        host, port = address.rsplit(":", 1)
        try:
            sock = socket.create_connection((host.strip("[]"), int(port)),
                                            timeout=max(0.001, deadline - time.monotonic()))
        except OSError as exc:
            raise StoreUnavailable(f"stream port {address}: {exc}") from None
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
            hello = recv_bytes(sock, 1 + NONCE_BYTES, deadline)
            if hello[0] != STREAM_VERSION:
                raise ProtocolError(f"stream port {address} speaks version {hello[0]}, "
                                    f"this client {STREAM_VERSION}")
            sock.settimeout(max(0.001, deadline - time.monotonic()))
            sock.sendall(_answer(self._claim, self._key, hello[1:]))
            self._status(sock, address)
        except BaseException:
            sock.close()
            raise
        return sock

    def _drop(self, address: str) -> None:
        sock = getattr(self._local, "conns", {}).pop(address, None)
        if sock is not None:
            with self._lock:
                self._all.discard(sock)
            sock.close()

    def _request(self, sock: socket.socket, op: str, segment: str, offsets, sizes) -> None:
        head = msgpack.packb({"v": STREAM_VERSION, "op": op, "segment": segment,
                              "ranges": [[o, s] for o, s in zip(offsets, sizes)]})
        sock.sendall(_LEN.pack(len(head)) + head)

    @staticmethod
    def _status(sock: socket.socket, address: str) -> None:
        status = recv_bytes(sock, 1)
        if status != OK:
            n = _LEN.unpack(recv_bytes(sock, 4))[0]
            raise ProtocolError(f"stream port {address} refused: "
                                f"{recv_bytes(sock, min(n, 1 << 16)).decode(errors='replace')}")

    @contextmanager
    def _session(self, address: str, deadline: float, what: str):
        """This thread's connection to ``address``; any failure drops it (a transfer cut
        midway leaves the stream in an unknown state) and is reported as the store's."""
        try:
            sock = self._conn(address, deadline)
            sock.settimeout(max(0.001, deadline - time.monotonic()))
            yield sock
        except (OSError, ProtocolError) as exc:
            self._drop(address)
            if isinstance(exc, ProtocolError):
                raise
            raise StoreUnavailable(f"stream {what} {address}: {exc}") from None

    def read(self, address: str, segment: str, offsets: Sequence[int], dsts: Sequence[int],
             sizes: Sequence[int], deadline: float, digest: bool) -> list[Optional[int]]:
        """Fill ``dsts[i]`` with the node's ``[offsets[i], +sizes[i])`` of ``segment``; with
        ``digest``, the xxh3-64 of each, taken chunk by chunk as it arrives (from cache)."""
        with self._session(address, deadline, "read from") as sock:
            self._request(sock, "read", segment, offsets, sizes)
            self._status(sock, address)
            return [recv_hash(sock, buffer_at(ptr, size), digest, deadline)
                    for ptr, size in zip(dsts, sizes)]

    def write(self, address: str, segment: str, offsets: Sequence[int], srcs: Sequence[int],
              sizes: Sequence[int], deadline: float) -> list[int]:
        """Send caller memory ``srcs[i]`` into the node's ``[offsets[i], +sizes[i])`` of ``segment``; the
        xxh3-64 of each as the node stored it (it hashes each chunk as it lands: on a 2-core
        loopback test this made writes ~25 % faster than hashing on the sending side)."""
        with self._session(address, deadline, "write to") as sock:
            self._request(sock, "write", segment, offsets, sizes)
            for ptr, size in zip(srcs, sizes):
                if size:
                    sock.settimeout(max(0.001, deadline - time.monotonic()))
                    sock.sendall(buffer_at(ptr, size))
            sock.settimeout(max(0.001, deadline - time.monotonic()))
            self._status(sock, address)
            n = _LEN.unpack(recv_bytes(sock, 4))[0]
            sums = msgpack.unpackb(recv_bytes(sock, n)) if n <= MAX_HEADER_BYTES else None
            if not (isinstance(sums, list) and len(sums) == len(sizes)
                    and all(type(x) is int for x in sums)):
                raise ProtocolError(f"stream port {address}: bad checksum list in its reply")
            return sums

    def close(self) -> None:
        with self._lock:
            for sock in self._all:
                sock.close()
            self._all.clear()
