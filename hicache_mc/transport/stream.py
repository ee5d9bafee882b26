"""The node's stream port: one-sided reads and writes of DRAM-segment ranges over plain TCP.

This is what the ``tcp`` transport moves bytes with, the way the Mooncake TE moves them over
RDMA: the client leases (or reserves) objects through the node's ZeroMQ port as for ``shm``,
then reads (writes) the byte ranges it was given through this socket, straight between the
kernel and the segment on the node and between the kernel and caller memory on the client:
no message framing, no extra copy on either side. The node's ZeroMQ loop never touches the
bytes; each connection is served by a thread that only moves them.

Wire format (one request at a time per connection; ``!`` = network byte order):

    request   !I header length, then a msgpack map
              {"v": STREAM_VERSION, "token": str, "op": "read" | "write", "segment": str,
               "ranges": [[offset, size], ...]}
              a write is followed by the ranges' bytes, back to back
    reply     one status byte: 0 = done; then a read's bytes, back to back, or for a write
              !I length and a msgpack list of the xxh3-64 of each range as stored
              1 = refused, then !I length and a UTF-8 reason; the node closes the connection

A range must lie inside the segment's data area; what it may touch is decided by the lease
or reservation the client obtained, exactly as for ``shm`` and the TE, and the token guards
the port like the ZeroMQ one. ``segment`` is the id of the segment the client's offsets are
in: a node that restarted at the same address (and port) refuses offsets into its
predecessor's segment instead of writing them over its own objects.
"""
from __future__ import annotations

import ctypes
import hmac
import logging
import mmap
import socket
import struct
import threading
import time
from contextlib import contextmanager
from typing import Optional, Sequence

import msgpack
import xxhash

from ..errors import ProtocolError, StoreUnavailable
from ..protocol import MAX_HEADER_BYTES, MAX_KEYS
from ..rpc import readable
from .base import CHUNK, buffer_at

log = logging.getLogger(__name__)

STREAM_VERSION = 2   # 2: requests name their segment
MAX_CONNECTIONS = 256
_LEN = struct.Struct("!I")
OK, REFUSED = b"\0", b"\1"


# ------------------------------------------------------------------ shared helpers

def _recv_hash(sock: socket.socket, view: memoryview, digest: bool = True,
               deadline: Optional[float] = None) -> Optional[int]:
    """Fill ``view`` from the socket (each chunk by ``deadline`` when given); with ``digest``,
    the xxh3-64 of what arrived, each chunk hashed as it lands (from cache)."""
    h, got, n = xxhash.xxh3_64() if digest else None, 0, len(view)
    while got < n:
        if deadline is not None:
            sock.settimeout(max(0.001, deadline - time.monotonic()))
        k = sock.recv_into(view[got:], min(CHUNK, n - got))
        if k == 0:
            raise ConnectionError("connection closed by the peer")
        if h is not None:
            h.update(view[got: got + k])
        got += k
    return h.intdigest() if h is not None else None


def _recv_bytes(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    _recv_hash(sock, memoryview(buf), digest=False)
    return bytes(buf)


def _check_ranges(ranges, low: int, high: int) -> list[tuple[int, int]]:
    if not isinstance(ranges, list) or len(ranges) > MAX_KEYS:
        raise ProtocolError(f"ranges must be a list of at most {MAX_KEYS} [offset, size] pairs")
    out = []
    for r in ranges:
        if (not isinstance(r, list) or len(r) != 2 or not all(type(x) is int for x in r)
                or r[1] < 0 or r[0] < low or r[0] + r[1] > high):
            raise ProtocolError(f"bad range {r!r}: must be [offset, size] inside [{low}, {high})")
        out.append((r[0], r[1]))
    return out


# ------------------------------------------------------------------ node side

class StreamServer:
    """A listening socket and one thread per connection, serving ranges of ``mm`` from
    ``low`` (the end of the segment header) to its end."""

    def __init__(self, mm: mmap.mmap, host: str, port: int, token: str, low: int, segment: str):
        self._anchor = ctypes.c_char.from_buffer(mm)
        self.base, self.size, self.low = ctypes.addressof(self._anchor), len(mm), low
        self.token, self.segment = token, segment
        self.listener = socket.create_server((host, port), backlog=128)
        self.address = f"{host}:{self.listener.getsockname()[1]}"
        self._conns: dict[socket.socket, threading.Thread] = {}
        self._lock = threading.Lock()
        self._stopping = False
        self.counters = {"stream_reads": 0, "stream_writes": 0, "stream_refused": 0}
        self._acceptor = threading.Thread(target=self._accept, name="hicache-mc-stream", daemon=True)
        self._acceptor.start()
        log.info("stream port on %s", self.address)

    def _accept(self) -> None:
        while not self._stopping:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                if self._stopping:
                    return
                time.sleep(0.05)
                continue
            with self._lock:
                if self._stopping or len(self._conns) >= MAX_CONNECTIONS:
                    conn.close()
                    continue
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
                t = threading.Thread(target=self._serve, args=(conn,), daemon=True,
                                     name="hicache-mc-stream-conn")
                self._conns[conn] = t
            t.start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            while not self._stopping:
                try:
                    head = _recv_bytes(conn, 4)
                except ConnectionError:
                    return      # the client went away between requests
                try:
                    op, ranges = self._parse(conn, _LEN.unpack(head)[0])
                except ProtocolError as exc:
                    self.counters["stream_refused"] += 1
                    log.warning("stream port: refused a request: %s", exc)
                    reason = str(exc).encode()
                    conn.sendall(REFUSED + _LEN.pack(len(reason)) + reason)
                    return
                # counted before the reply: a client that has its answer sees it in the stats
                if op == "read":
                    self.counters["stream_reads"] += len(ranges)
                    conn.sendall(OK)
                    for off, size in ranges:
                        if size:
                            conn.sendall(buffer_at(self.base + off, size))
                else:   # each chunk hashed right after it lands (from cache)
                    sums = [_recv_hash(conn, buffer_at(self.base + off, size)) for off, size in ranges]
                    body = msgpack.packb(sums)
                    self.counters["stream_writes"] += len(ranges)
                    conn.sendall(OK + _LEN.pack(len(body)) + body)
        except OSError:
            pass            # the client vanished mid-transfer: its lease or reservation lapses
        finally:
            with self._lock:
                self._conns.pop(conn, None)
            conn.close()

    def _parse(self, conn: socket.socket, n: int) -> tuple[str, list[tuple[int, int]]]:
        if n > MAX_HEADER_BYTES:
            raise ProtocolError(f"header of {n} bytes is over the {MAX_HEADER_BYTES}-byte limit")
        try:
            head = msgpack.unpackb(_recv_bytes(conn, n), raw=False)
        except (ValueError, msgpack.UnpackException) as exc:
            raise ProtocolError(f"undecodable header: {exc}") from None
        if not isinstance(head, dict):
            raise ProtocolError("header must be a map")
        if head.get("v") != STREAM_VERSION:
            raise ProtocolError(f"stream version {head.get('v')!r}; this node speaks {STREAM_VERSION}")
        token = head.get("token", "")
        if self.token and not (isinstance(token, str) and hmac.compare_digest(token, self.token)):
            raise ProtocolError("missing or wrong token")
        op = head.get("op")
        if op not in ("read", "write"):
            raise ProtocolError(f"op must be read or write, got {op!r}")
        ranges = _check_ranges(head.get("ranges"), self.low, self.size)
        if head.get("segment") != self.segment:
            raise ProtocolError(f"offsets of segment {head.get('segment')!r}, this node's is {self.segment} "
                                "(it restarted)")
        return op, ranges

    def close(self) -> None:
        """Stop accepting, cut every connection, wait for their threads (they touch the
        segment: it must outlive them)."""
        self._stopping = True
        try:
            self.listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.listener.close()
        self._acceptor.join(2.0)
        with self._lock:
            conns = list(self._conns.items())
        for conn, _ in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for _, t in conns:
            t.join(2.0)
            if t.is_alive():
                log.warning("a stream connection thread did not stop")
        self._anchor = None


# ------------------------------------------------------------------ client side

class StreamClient:
    """Per-thread connections to nodes' stream ports; any failure drops the connection."""

    def __init__(self, token: str = ""):
        self.token = token
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
            # closed the connection (it restarted, or dropped the socket); connect anew
            self._drop(address)
            sock = None
        if sock is None:
            host, port = address.rsplit(":", 1)
            try:
                sock = socket.create_connection((host.strip("[]"), int(port)),
                                                timeout=max(0.001, deadline - time.monotonic()))
            except OSError as exc:
                raise StoreUnavailable(f"stream port {address}: {exc}") from None
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
            conns[address] = sock
            with self._lock:
                self._all.add(sock)
        return sock

    def _drop(self, address: str) -> None:
        sock = getattr(self._local, "conns", {}).pop(address, None)
        if sock is not None:
            with self._lock:
                self._all.discard(sock)
            sock.close()

    def _request(self, sock: socket.socket, op: str, segment: str, offsets, sizes) -> None:
        head = msgpack.packb({"v": STREAM_VERSION, "token": self.token, "op": op, "segment": segment,
                              "ranges": [[o, s] for o, s in zip(offsets, sizes)]})
        sock.sendall(_LEN.pack(len(head)) + head)

    @staticmethod
    def _status(sock: socket.socket, address: str) -> None:
        status = _recv_bytes(sock, 1)
        if status != OK:
            n = _LEN.unpack(_recv_bytes(sock, 4))[0]
            raise ProtocolError(f"stream port {address} refused: "
                                f"{_recv_bytes(sock, min(n, 1 << 16)).decode(errors='replace')}")

    @contextmanager
    def _session(self, address: str, deadline: float, what: str):
        """This thread's connection to ``address``; any failure drops it (a transfer cut
        midway leaves the stream in an unknown state) and is reported as the store's."""
        sock = self._conn(address, deadline)
        try:
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
            return [_recv_hash(sock, buffer_at(ptr, size), digest, deadline)
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
            n = _LEN.unpack(_recv_bytes(sock, 4))[0]
            sums = msgpack.unpackb(_recv_bytes(sock, n)) if n <= MAX_HEADER_BYTES else None
            if not (isinstance(sums, list) and len(sums) == len(sizes)
                    and all(type(x) is int for x in sums)):
                raise ProtocolError(f"stream port {address}: bad checksum list in its reply")
            return sums

    def close(self) -> None:
        with self._lock:
            for sock in self._all:
                sock.close()
            self._all.clear()
