"""The node's stream port: one-sided reads and writes of DRAM-segment ranges over plain TCP
(the client side is ``stream_client.py``).

This is what the ``tcp`` transport moves bytes with, the way the Mooncake TE moves them over
RDMA: the client leases (or reserves) objects through the node's ZeroMQ port as for ``shm``,
then reads (writes) the byte ranges it was given through this socket, straight between the
kernel and the segment on the node and between the kernel and caller memory on the client:
no message framing, no extra copy on either side. The node's ZeroMQ loop never touches them.

Wire format (``!`` = network byte order). A connection opens with a handshake; the node
decodes nothing a peer sends before the peer has proved its credential (auth.py):

    hello     node: one byte STREAM_VERSION, then a fresh random 32-byte nonce
    answer    client: one byte n <= CLAIM_MAX, its claim "role:tenant" (n bytes of ASCII), and
              32 bytes HMAC-SHA256(key = the credential's seed, b"" without a token,
              msg = b"hicache-mc stream" + nonce)
    verdict   node: one status byte, 0 = welcome; 1 = refused (a wrong answer, or the node
              serves MAX_CONNECTIONS already), then !I length and a UTF-8 reason, and close

then requests, one at a time:

    request   !I header length (at most HEADER_MAX), then a msgpack map
              {"v": STREAM_VERSION, "op": "read" | "write", "segment": str,
               "ranges": [[offset, size], ...]}          (at most MAX_KEYS ranges)
              a write is followed by the ranges' bytes, back to back
    reply     one status byte: 0 = done; then a read's bytes, back to back, or for a write
              !I length and a msgpack list of the xxh3-64 of each range as stored
              1 = refused, then !I length and a UTF-8 reason; the node closes the connection

A range must lie inside the segment's data area and be granted to the connection's principal:
a read the ``[offset, +size)`` of an object the node leased to it, a write one of a slot it
reserved for it, until released, committed or expired (``grants.py``). A request names each
range once, and one lease or reservation carries one transfer at a time. The transfer pins its
slots (nothing reuses them until it ends), and before each CHUNK it checks that its grant still
stands: once it was released, committed or expired, the node cuts the connection
(``stream_cut``). ``segment`` is the id of the segment the client's offsets are in: a node that
restarted at the same address (and port) refuses offsets into its predecessor's segment
instead of writing them over its own.

What a peer can cost: peers that have not answered their nonce are all handled by one thread
(a selectors loop), each holding a 32-byte buffer, at most PENDING_MAX of them (a newcomer
sheds the oldest) for at most AUTH_TIMEOUT_S. Only an authenticated peer gets a thread (at
most MAX_CONNECTIONS); it is cut when idle for IDLE_S, when a header is not whole HEADER_S
after its first byte, or when a CHUNK of a body does not move within BODY_S.
"""
from __future__ import annotations

import ctypes
import hashlib
import hmac
import logging
import mmap
import os
import selectors
import socket
import struct
import threading
import time
from collections import OrderedDict
from contextlib import suppress
from typing import Callable, Optional

import msgpack

from ..auth import Principal
from ..errors import ProtocolError
from .grants import Grants
from ..protocol import MAX_KEYS
from .base import CHUNK, GrantEnded, buffer_at, recv_bytes, recv_hash

log = logging.getLogger(__name__)

STREAM_VERSION = 4   # 3: a handshake replaces the header's token; 4: the answer claims a principal
AUTH_CONTEXT = b"hicache-mc stream"   # what the answer is the HMAC of, with the nonce
NONCE_BYTES = MAC_BYTES = 32          # a nonce never repeats; an answer ends in one SHA-256 digest
CLAIM_MAX = 80                        # "client:" and a tenant of at most 64 characters
ANSWER_MAX = 1 + CLAIM_MAX + MAC_BYTES
# Limits (module-level: tests patch them smaller). Peers not yet authenticated:
PENDING_MAX = 64       # an honest client answers within a round trip (~0.1 ms on loopback): a
                       # flood must open this many connections in that time to shed it
AUTH_TIMEOUT_S = 2.0   # a round trip even on a loaded host; a silent peer holds a slot no longer
ACCEPT_BATCH = 16      # accepts per turn of the loop: answers already in are read between bursts
# Authenticated peers, a thread each:
MAX_CONNECTIONS = 256  # clients keep one per thread per node
IDLE_S = 60.0          # between requests; the client sees the close (readable()) and reconnects
HEADER_S = 5.0         # a header must be whole this long after its first byte (it is sent at once)
BODY_S = 10.0          # each CHUNK of a body must move within this (>= 25 KiB/s) or the peer is cut
SEGMENT_MAX = 64       # characters of a segment id (a node's are 8 hex digits)
# What MAX_KEYS ranges can need: four short fields (< 128 bytes with a segment id of
# SEGMENT_MAX characters) and [offset, size] pairs of at most 19 bytes (fixarray, 2 x uint64)
HEADER_MAX = 128 + 19 * MAX_KEYS
_FIELDS = frozenset(("v", "op", "segment", "ranges"))
_LEN = struct.Struct("!I")
OK, REFUSED = b"\0", b"\1"


# ------------------------------------------------------------------ shared helpers

def _answer(claim: bytes, key: bytes, nonce: bytes) -> bytes:
    return bytes((len(claim),)) + claim + hmac.new(key, AUTH_CONTEXT + nonce, hashlib.sha256).digest()


def _refusal(reason: str) -> bytes:
    body = reason.encode()
    return REFUSED + _LEN.pack(len(body)) + body


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


def _decode(raw: bytes, low: int, high: int, segment: str) -> tuple[str, list[tuple[int, int]]]:
    """A request header's op and ranges, decoded with bounded work (lists of at most
    MAX_KEYS, short strings, no binaries or extensions, a handful of fields)."""
    try:
        head = msgpack.unpackb(raw, raw=False, max_array_len=MAX_KEYS, max_map_len=2 * len(_FIELDS),
                               max_str_len=SEGMENT_MAX, max_bin_len=0, max_ext_len=0)
    except (ValueError, msgpack.UnpackException) as exc:
        raise ProtocolError(f"undecodable header: {exc}") from None
    if not isinstance(head, dict):
        raise ProtocolError("header must be a map")
    if head.get("v") != STREAM_VERSION:
        raise ProtocolError(f"stream version {head.get('v')!r}; this node speaks {STREAM_VERSION}")
    if not _FIELDS.issuperset(head):
        raise ProtocolError(f"unexpected fields {sorted(set(head) - _FIELDS)}")
    op = head.get("op")
    if op not in ("read", "write"):
        raise ProtocolError(f"op must be read or write, got {op!r}")
    ranges = _check_ranges(head.get("ranges"), low, high)
    if head.get("segment") != segment:
        raise ProtocolError(f"offsets of segment {head.get('segment')!r}, this node's is {segment} "
                            "(it restarted)")
    return op, ranges


# ------------------------------------------------------------------ node side

class _Pending:
    """An accepted peer that has not answered its nonce yet: all the node holds for it."""
    __slots__ = ("sock", "nonce", "buf", "got", "deadline")

    def __init__(self, sock: socket.socket, deadline: float):
        self.sock, self.nonce, self.deadline = sock, os.urandom(NONCE_BYTES), deadline
        self.buf, self.got = bytearray(ANSWER_MAX), 0

    @property
    def need(self) -> int:
        """Bytes of the answer: its first says how long the claim is."""
        return 1 + self.buf[0] + MAC_BYTES if self.got else 1


class StreamServer:
    """A listening socket, one thread taking every new peer through the handshake, and a
    thread per authenticated connection, serving ranges of ``mm`` from ``low`` (the end of the
    segment header) to its end."""

    def __init__(self, mm: mmap.mmap, host: str, port: int, low: int, segment: str,
                 key_for: Callable[[bytes], Optional[tuple[Principal, bytes]]], grants: Grants):
        """``key_for(claim)``: the principal a claim names and the key its answer is made with
        (``auth.Guard.stream_key``); ``grants``: the ranges each principal may move."""
        self._anchor = ctypes.c_char.from_buffer(mm)
        self.base, self.size, self.low = ctypes.addressof(self._anchor), len(mm), low
        self.segment, self._key_for, self.grants = segment, key_for, grants
        # a deep backlog: the handshake thread drains it fast, shedding the oldest
        self.listener = socket.create_server((host, port), backlog=1024)
        self.listener.setblocking(False)
        self.address = f"{host}:{self.listener.getsockname()[1]}"
        self._pending: OrderedDict[socket.socket, _Pending] = OrderedDict()   # oldest first
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()    # close() ends the selector's wait
        self._sel.register(self.listener, selectors.EVENT_READ)
        self._sel.register(self._wake_r, selectors.EVENT_READ)
        self._conns: dict[socket.socket, threading.Thread] = {}
        self._lock = threading.Lock()
        self._stopping = False
        self._warned: dict[str, float] = {}
        self.counters = {"stream_reads": 0, "stream_writes": 0, "stream_refused": 0,
                         "stream_cut": 0, "stream_auth_failed": 0, "stream_auth_timeout": 0,
                         "stream_shed": 0}
        self._gate = threading.Thread(target=self._handshakes, name="hicache-mc-stream", daemon=True)
        self._gate.start()
        log.info("stream port on %s", self.address)

    def _handshakes(self) -> None:
        """The one thread for every peer not yet authenticated: accept, send the hello, collect
        answers into their ANSWER_MAX-byte buffers, shed and expire."""
        try:
            while not self._stopping:
                for key, _ in self._sel.select(self._expire()):
                    try:
                        if key.fileobj is self.listener:
                            self._accept_some()
                        elif isinstance(key.data, _Pending):
                            self._on_answer(key.data)
                    except Exception:       # a bug must not take the port down for everyone
                        log.exception("stream port: handshake step failed")
                        if isinstance(key.data, _Pending):
                            self._forget(key.data)
        finally:
            for p in list(self._pending.values()):
                self._forget(p)
            self._sel.close()
            self.listener.close()

    def _expire(self) -> Optional[float]:
        """Close the pending peers past their deadline (oldest first: deadlines follow
        arrival); seconds until the next is due, None when none waits."""
        now = time.monotonic()
        while self._pending:
            p = next(iter(self._pending.values()))
            if p.deadline > now:
                return p.deadline - now
            self.counters["stream_auth_timeout"] += 1
            self._forget(p)
        return None

    def _forget(self, p: _Pending) -> None:
        if self._pending.pop(p.sock, None) is not None:
            self._sel.unregister(p.sock)
        p.sock.close()

    def _accept_some(self) -> None:
        for _ in range(ACCEPT_BATCH):
            try:
                conn, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:      # out of descriptors: they wait in the backlog
                self._warn("accept", "stream port: accept failed: %s", exc)
                time.sleep(0.01)
                return
            if len(self._pending) >= PENDING_MAX:
                self.counters["stream_shed"] += 1
                self._forget(next(iter(self._pending.values())))
            p = _Pending(conn, time.monotonic() + AUTH_TIMEOUT_S)
            hello = bytes((STREAM_VERSION,)) + p.nonce
            try:
                conn.setblocking(False)
                if conn.send(hello) != len(hello):   # a fresh socket's buffer takes 33 bytes
                    raise OSError("short send of the hello")
            except OSError:
                conn.close()
                continue
            self._pending[conn] = p
            self._sel.register(conn, selectors.EVENT_READ, p)

    def _on_answer(self, p: _Pending) -> None:
        try:    # never past the answer's length (at most ANSWER_MAX)
            k = p.sock.recv_into(memoryview(p.buf)[p.got:p.need])
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            k = 0
        if k == 0 or p.buf[0] > CLAIM_MAX:
            self._forget(p)
            return
        p.got += k
        if p.got < p.need:
            return
        del self._pending[p.sock]
        self._sel.unregister(p.sock)
        claim = bytes(p.buf[1: 1 + p.buf[0]])
        known = self._key_for(claim)
        if known is None or not hmac.compare_digest(bytes(p.buf[:p.got]),
                                                    _answer(claim, known[1], p.nonce)):
            self.counters["stream_auth_failed"] += 1
            self._warn("auth", "stream port: a peer failed the handshake (wrong credential)")
            self._turn_away(p.sock, "wrong credential")
            return
        with self._lock:
            full = self._stopping or len(self._conns) >= MAX_CONNECTIONS
            if not full:
                t = self._conns[p.sock] = threading.Thread(
                    target=self._serve, args=(p.sock, known[0]), daemon=True,
                    name="hicache-mc-stream-conn")
        if full:
            self.counters["stream_shed"] += 1
            self._turn_away(p.sock, f"the node serves {MAX_CONNECTIONS} connections already")
        else:
            t.start()

    @staticmethod
    def _turn_away(conn: socket.socket, reason: str) -> None:
        """The verdict 'refused' without waiting (a fresh socket's buffer takes it whole)."""
        with suppress(OSError):
            conn.send(_refusal(reason))
        conn.close()

    def _warn(self, kind: str, msg: str, *args) -> None:
        """Log at most every 10 s per kind: a flood must not flood the log as well."""
        now = time.monotonic()
        if now - self._warned.get(kind, -10.0) >= 10.0:
            self._warned[kind] = now
            log.warning(msg, *args)

    def _serve(self, conn: socket.socket, who: Principal) -> None:
        """An authenticated connection's requests, until it closes, idles, stalls or errs."""
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
            conn.settimeout(BODY_S)
            conn.sendall(OK)                # the verdict: welcome
            while not self._stopping:
                try:
                    raw = self._header(conn)
                    if raw is None:
                        return              # the client went away, or idled past IDLE_S
                    op, ranges = _decode(raw, self.low, self.size, self.segment)
                    transfer = self.grants.open(who, ranges, op == "write", time.monotonic())
                except ProtocolError as exc:
                    self.counters["stream_refused"] += 1
                    self._warn("refused", "stream port: refused a request: %s", exc)
                    conn.settimeout(BODY_S)
                    conn.sendall(_refusal(str(exc)))
                    return
                try:
                    self._move(conn, op, ranges, transfer)
                finally:
                    transfer.close()
        except GrantEnded as exc:
            self.counters["stream_cut"] += 1
            self._warn("cut", "stream port: cut a transfer: %s", exc)
        except OSError:
            pass            # the client vanished mid-transfer, or stalled: its lease lapses
        finally:
            with self._lock:
                self._conns.pop(conn, None)
            conn.close()

    def _move(self, conn: socket.socket, op: str, ranges: list[tuple[int, int]], transfer) -> None:
        """Send (read) or take in (write) the ranges of one request, checking before each
        CHUNK that its grant still stands (GrantEnded when not)."""
        conn.settimeout(BODY_S)     # each sendall: one CHUNK within BODY_S
        # counted before the reply: a client that has its answer sees it in the stats
        if op == "read":
            self.counters["stream_reads"] += len(ranges)
            conn.sendall(OK)
            for i, (off, size) in enumerate(ranges):
                view = buffer_at(self.base + off, size)
                for at in range(0, size, CHUNK):
                    if not transfer.live(i):
                        raise GrantEnded(f"the lease of {[off, size]} ended mid-transfer")
                    conn.sendall(view[at: at + CHUNK])
            return
        sums = []       # each chunk hashed right after it lands (from cache)
        for i, (off, size) in enumerate(ranges):
            sums.append(recv_hash(conn, buffer_at(self.base + off, size), stall=BODY_S,
                                  live=lambda i=i: transfer.live(i)))
        body = msgpack.packb(sums)
        self.counters["stream_writes"] += len(ranges)
        conn.settimeout(BODY_S)
        conn.sendall(OK + _LEN.pack(len(body)) + body)

    def _header(self, conn: socket.socket) -> Optional[bytes]:
        """The next request's header (None: the peer closed, or sent nothing for IDLE_S), its
        length checked before anything is allocated for it."""
        conn.settimeout(IDLE_S)
        try:
            first = conn.recv(_LEN.size)
        except socket.timeout:
            return None
        if not first:
            return None
        deadline = time.monotonic() + HEADER_S
        n = _LEN.unpack(first + recv_bytes(conn, _LEN.size - len(first), deadline))[0]
        if n > HEADER_MAX:
            raise ProtocolError(f"header of {n} bytes is over the {HEADER_MAX}-byte limit")
        return recv_bytes(conn, n, deadline)

    def close(self) -> None:
        """Stop the handshakes, cut every connection, wait for their threads (they touch the
        segment: it must outlive them)."""
        self._stopping = True
        with suppress(OSError):
            self._wake_w.send(b"x")
        self._gate.join(2.0)
        if self._gate.is_alive():
            log.warning("the stream port's handshake thread did not stop")
        self._wake_r.close()
        self._wake_w.close()
        with self._lock:
            conns = list(self._conns.items())
        for conn, _ in conns:
            with suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        for _, t in conns:
            t.join(2.0)
            if t.is_alive():
                log.warning("a stream connection thread did not stop")
        self._anchor = None
