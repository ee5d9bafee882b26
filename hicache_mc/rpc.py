"""Request/reply plumbing over ZeroMQ shared by the master, the nodes and the client.

``Service``: the stable side. A ROUTER bound to one address, one thread, every receive under a
poll timeout, a ``tick`` hook for timers, dispatch to ``on_<Verb>Request`` methods. Malformed
frames, unknown types, wrong versions and bad tokens get an ``ErrorReply``; the loop keeps going.

``Channel``: the volatile side (Lazy Pirate). A DEALER that tags each request with an id, waits
for the matching reply under a deadline, and on a timeout closes and reconnects, so a restarted
server is picked up and stale replies are dropped. Not thread-safe: one per thread.

The **direct port**: a service may also take the same messages over plain TCP (``enable_direct``),
framed by lengths: ``<u32 header bytes><u32 payload frames><u64 length per frame>`` then the
header and the frames. A Channel given the direct address uses it: the request goes from the
caller's thread straight into the kernel and the reply straight back, where ZeroMQ passes each
message through an I/O thread on both sides. Measured here: a round trip of 20-25 us against
95-115 us. A Channel that cannot connect to the direct port uses ZeroMQ (and tries again later).
"""
from __future__ import annotations

import ipaddress
import itertools
import logging
import os
import select
import socket
import struct
import threading
import time
from typing import Callable, Optional, Union

import zmq

from . import protocol as P
from .errors import ProtocolError, StoreUnavailable
from .metrics import Histogram, MetricsServer, render

log = logging.getLogger(__name__)

# Replies are sent immediately or deferred; a handler returns one of these.
Reply = Optional[tuple[P.Message, list]]

_PREFIX = struct.Struct("<II")          # direct port: header bytes, payload frames
DIRECT_RETRY_S = 30.0                   # a direct port that refused a connection: ZeroMQ meanwhile
CONNECT_TIMEOUT_S = 1.0
SEND_TIMEOUT_S = 30.0                   # a direct-port peer that takes no bytes for this long is gone
RECV_BYTES = 1 << 20                    # a service reads its direct-port peers this much at a time
CHANNEL_RECV_BYTES = 256 << 10          # ... a Channel its reply stream
IOV_MAX = min(1024, os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024)  # buffers per sendmsg
MAX_CONNECTIONS = 512                   # direct-port peers a service keeps; more are refused
OUT_LIMIT = 512 << 20                   # replies a direct-port peer may leave unread


class Frame:
    """A received payload frame of the direct port (``.buffer`` like a ZeroMQ frame's)."""
    __slots__ = ("buffer",)

    def __init__(self, buffer: memoryview):
        self.buffer = buffer

    @property
    def bytes(self) -> bytes:
        return bytes(self.buffer)


def pack_frames(frames: list) -> list:
    """The direct port's framing of [header, *payload]: a length prefix, then the frames."""
    lens = [memoryview(f).nbytes for f in frames[1:]]
    prefix = _PREFIX.pack(len(frames[0]), len(lens)) + struct.pack(f"<{len(lens)}Q", *lens)
    return [prefix, *frames]


def _sent(bufs: list, sent: int) -> list:
    """What is left of ``bufs`` after ``sent`` bytes went out."""
    i = 0
    while i < len(bufs) and sent >= len(bufs[i]):
        sent -= len(bufs[i])
        i += 1
    rest = bufs[i:]
    if rest and sent:
        rest[0] = rest[0][sent:]
    return rest


def send_all(sock: socket.socket, bufs: list) -> None:
    """``sendmsg`` of every buffer, whatever a single call could take (blocking socket; at
    most IOV_MAX buffers a call)."""
    bufs = [memoryview(b).cast("B") for b in bufs if len(b)]
    while bufs:
        bufs = _sent(bufs, sock.sendmsg(bufs[:IOV_MAX]))


def direct_via(service: str, reported: str) -> str:
    """host:port of a service's direct port: the port it reports, on the host this peer
    already reaches it by (the service may bind 0.0.0.0); "" when it reports none."""
    if not reported:
        return ""
    host, port = host_of(service), reported.rpartition(":")[2]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def dial(direct: str, timeout_s: float) -> socket.socket:
    """A TCP connection (no Nagle) to a direct port ``host:port``; OSError/ValueError if not."""
    host, _, port = direct.rpartition(":")
    conn = socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return conn


def readable(sock: socket.socket) -> bool:
    """Whether ``sock`` has bytes or an end of stream to read right now (never waits; poll,
    not select, which fails on descriptors past 1023)."""
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    return bool(poller.poll(0))


def recv_some(sock: socket.socket, scratch: memoryview) -> memoryview:
    """What ``sock`` has, up to the scratch buffer's size, as a view of it (empty: closed).
    ``recv_into`` a buffer kept for it: ``sock.recv(n)`` allocates n bytes every call (~20 us
    for 1 MiB here, on every message)."""
    return scratch[: sock.recv_into(scratch)]


def parse_frames(buf: bytearray, max_frame: int) -> Optional[tuple[int, list]]:
    """(bytes used, [header, *payload frames]) of the first whole message in ``buf``, or None
    when it has not all arrived. Declared sizes over the limits raise ProtocolError."""
    if len(buf) < _PREFIX.size:
        return None
    hlen, n = _PREFIX.unpack_from(buf)
    if hlen > P.MAX_HEADER_BYTES or n > P.MAX_KEYS:
        raise ProtocolError(f"direct frame declares a {hlen}-byte header and {n} payload frames")
    start = _PREFIX.size + 8 * n
    if len(buf) < start:
        return None
    lens = struct.unpack_from(f"<{n}Q", buf, _PREFIX.size)
    if n and max(lens) > max_frame:
        raise ProtocolError(f"direct frame declares a {max(lens)}-byte payload (limit {max_frame})")
    end = start + hlen + sum(lens)
    if len(buf) < end:
        return None
    view = memoryview(buf)
    try:
        whole = memoryview(view[start:end].tobytes())   # one copy; the frames are views of it
    finally:
        view.release()                                  # so ``buf`` can be cut again
    frames, at = [whole[:hlen]], hlen
    for n_ in lens:
        frames.append(Frame(whole[at: at + n_]))
        at += n_
    return end, frames


class DirectConnection:
    """One peer on a service's direct port; owned by the service loop (non-blocking)."""

    def __init__(self, sock: socket.socket, service: "Service",
                 on_close: Optional[Callable[["DirectConnection"], None]] = None):
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock, self.service = sock, service
        self.on_close = on_close            # default: the service forgets the peer
        self.priority = False               # read before other peers in each loop turn
        self.fd = sock.fileno()
        self.inbuf = bytearray()
        self.out: list[memoryview] = []     # bytes the kernel would not take yet
        self.closed = False

    def read(self) -> list[list]:
        """The whole messages that arrived (each [header, *payload frames])."""
        try:
            data = recv_some(self.sock, self.service._scratch)
        except (BlockingIOError, InterruptedError):
            return []
        except OSError:
            data = b""
        if not data:
            self.close()
            return []
        self.inbuf += data
        msgs = []
        while True:
            try:
                got = parse_frames(self.inbuf, self.service.max_frame)
            except ProtocolError as exc:
                self.service._warn("direct_frame", "%s: dropped a direct connection: %s", self.service.name, exc)
                self.close()
                return msgs
            if got is None:
                return msgs
            del self.inbuf[: got[0]]
            msgs.append(got[1])

    def send(self, frames: list) -> None:
        if self.closed:
            return          # the peer went away: its reply has nowhere to go
        bufs = [memoryview(b).cast("B") for b in pack_frames(frames) if len(b)]
        while bufs and not self.out:
            try:
                bufs = _sent(bufs, self.sock.sendmsg(bufs[:IOV_MAX]))
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                self.close()
                return
        if not bufs:
            return
        # the peer is not reading fast enough: keep the rest (copied: a payload may be a
        # leased view) and send it when the socket can take it; a peer that leaves more
        # than OUT_LIMIT unread is dropped
        if sum(map(len, self.out)) + sum(map(len, bufs)) > OUT_LIMIT:
            self.service._warn("direct_slow", "%s: dropped a direct connection that left over "
                               "%d MiB of replies unread", self.service.name, OUT_LIMIT >> 20)
            self.close()
            return
        if not self.out:
            self.service._poller.modify(self.fd, zmq.POLLIN | zmq.POLLOUT)
        self.out += [memoryview(bytes(b)) for b in bufs]

    def flush(self) -> None:
        while self.out:
            try:
                sent = self.sock.send(self.out[0])
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                self.close()
                return
            self.out[0] = self.out[0][sent:]
            if not len(self.out[0]):
                self.out.pop(0)
        self.service._poller.modify(self.fd, zmq.POLLIN)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            if self.on_close is not None:
                self.on_close(self)
            else:
                self.service._drop_connection(self)
            self.sock.close()


class Service:
    """A ROUTER service loop. Subclasses define ``on_<Verb>Request(msg, payload, ident)``."""

    poll_ms = 50  # wakes the loop at least this often for tick() and the stop flag

    def __init__(self, bind: str, token: str = "", name: str = "service",
                 max_frame: int = P.MAX_HEADER_BYTES):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        # a frame over this is refused by ZeroMQ (the peer is disconnected) before it is buffered
        self.sock.setsockopt(zmq.MAXMSGSIZE, max_frame)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        if bind.endswith(":0"):
            port = self.sock.bind_to_random_port(bind.rsplit(":", 1)[0])
            bind = f"{bind.rsplit(':', 1)[0]}:{port}"
        else:
            self.sock.bind(bind)
        self.address = bind
        self.token = token
        self.name = name
        self.stopping = threading.Event()
        self._extra: list[tuple[zmq.Socket, Callable[[], None]]] = []
        self.latency: dict[str, Histogram] = {}     # handling time per request type
        self.rejected: dict[str, int] = {}          # error replies per code
        self.max_frame = max_frame
        self._listener: Optional[socket.socket] = None
        self.direct_address = ""                        # host:port of the direct port, if any
        self._conns: dict[int, DirectConnection] = {}
        self._scratch = memoryview(bytearray(RECV_BYTES))   # every peer is read into it in turn
        self._poller: Optional[zmq.Poller] = None
        self._metrics: Optional[MetricsServer] = None
        self._metrics_text = ""
        self._next_publish = 0.0
        self._quiet: dict[str, float] = {}
        if exposed_without_token(bind, token):
            log.warning("%s binds %s without a token: anyone who reaches it can read and write "
                        "the store (set token)", name, bind)

    def enable_metrics(self, host: str, port: int) -> None:
        """Serve Prometheus metrics on http://host:port/metrics (port 0 = off)."""
        if port:
            self._metrics = MetricsServer(host, port, lambda: self._metrics_text)

    def metric_families(self) -> list:
        """The service's metric families (built on the loop thread); see hicache_mc/metrics.py."""
        return []

    def enable_direct(self, host: str, port: int) -> str:
        """Also take requests on a plain TCP port (0 = any free one); returns host:port."""
        ls = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            ls.bind((host, port))
            ls.listen(128)
        except OSError:
            ls.close()
            raise
        ls.setblocking(False)
        self._listener = ls
        self.direct_address = f"{host}:{ls.getsockname()[1]}"
        return self.direct_address

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:     # e.g. out of file descriptors: try again next turn
                self._warn("accept", "%s: accept on the direct port failed: %s", self.name, exc)
                time.sleep(0.01)
                return
            if len(self._conns) >= MAX_CONNECTIONS:
                self._warn("conns", "%s: %d direct connections already; refused one",
                           self.name, MAX_CONNECTIONS)
                sock.close()
                continue
            conn = DirectConnection(sock, self)
            self._conns[conn.fd] = conn
            self._poller.register(conn.fd, zmq.POLLIN)

    def _drop_connection(self, conn: DirectConnection) -> None:
        if self._conns.pop(conn.fd, None) is not None and self._poller is not None:
            self._poller.unregister(conn.fd)

    def _on_direct(self, events: dict) -> None:
        ready = []
        for fd, ev in events.items():
            if not isinstance(fd, int):
                continue
            if self._listener is not None and fd == self._listener.fileno():
                self._accept()
                continue
            conn = self._conns.get(fd)
            if conn is not None:
                ready.append((conn, ev))
        if len(ready) > 1:      # peers marked priority first (the master: its nodes' reports)
            ready.sort(key=lambda item: not item[0].priority)
        for conn, ev in ready:
            if ev & zmq.POLLOUT:
                conn.flush()
            if ev & zmq.POLLIN:
                for frames in conn.read():
                    try:
                        self._handle(frames, conn)
                    except Exception:   # one request's failure must not drop the others read with it
                        log.exception("%s: request on the direct port failed", self.name)

    def add_socket(self, sock, on_readable: Callable[[], None]) -> None:
        """Poll another socket or file descriptor in the same loop (the node's channels to
        the master, the SSD writer's wake-up pipe), from now on, even while the loop runs."""
        self._extra.append((sock, on_readable))
        if self._poller is not None:
            self._poller.register(sock, zmq.POLLIN)

    def remove_socket(self, sock) -> None:
        self._extra = [(s, h) for s, h in self._extra if s != sock]
        if self._poller is not None:
            self._poller.unregister(sock)

    def tick(self, now: float) -> None:
        """Called every loop turn; timers live here."""

    def serve_forever(self) -> None:
        poller = self._poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        for sock, _ in self._extra:
            poller.register(sock, zmq.POLLIN)
        if self._listener is not None:
            poller.register(self._listener.fileno(), zmq.POLLIN)
        log.info("%s listening on %s%s", self.name, self.address,
                 f" (direct port {self.direct_address})" if self.direct_address else "")
        while not self.stopping.is_set():
            try:
                events = dict(poller.poll(self.poll_ms))
                if self._listener is not None:
                    self._on_direct(events)
                if self.sock in events:
                    self._serve_one()
                for sock, handler in self._extra:
                    if sock in events:
                        handler()
                now = time.monotonic()
                self.tick(now)
                if self._metrics is not None and now >= self._next_publish:
                    self._next_publish = now + 1.0
                    self._metrics_text = render(self.metric_families())
            except zmq.ContextTerminated:
                break
            except Exception:  # a bug in one request must not stop the service
                log.exception("%s: unexpected error in the loop", self.name)
                time.sleep(0.01)
        self.close()

    def stop(self) -> None:
        self.stopping.set()

    def close(self) -> None:
        if self._metrics is not None:
            self._metrics.close()
        for conn in list(self._conns.values()):
            conn.close()
        if self._listener is not None:
            self._listener.close()
        self.sock.close(0)
        for sock, _ in self._extra:
            if isinstance(sock, zmq.Socket):
                sock.close(0)
        self.ctx.term()

    def _warn(self, what: str, fmt: str, *args) -> None:
        """A log line per kind of bad request, at most once a second: a flood stays readable."""
        now = time.monotonic()
        if now >= self._quiet.get(what, 0.0):
            self._quiet[what] = now + 1.0
            log.warning(fmt, *args)

    def reply(self, ident: Union[bytes, DirectConnection], req_id: int, msg: P.Message,
              payload: Optional[list] = None) -> None:
        """Answer the peer ``ident`` (a ZeroMQ identity, or a direct-port connection)."""
        frames = P.encode(msg, req_id, payload=payload)
        if isinstance(ident, bytes):
            self.sock.send_multipart([ident] + frames, copy=False)
        else:
            ident.send(frames)

    def _serve_one(self) -> None:
        frames = self.sock.recv_multipart(copy=False)
        self._handle(frames[1:], frames[0].bytes)

    def _handle(self, frames: list, ident) -> None:
        """One request ([header, *payload]) from ``ident``: check, dispatch, reply."""
        req_id = 0
        try:
            if len(frames) < 1:
                raise ProtocolError("message has no header frame")
            type_name, req_id, token, values = P.decode_header(frames[0])
            if self.token and token != self.token:
                self._warn("bad_token", "%s: refused a request with a missing or wrong token", self.name)
                self.rejected["bad_token"] = self.rejected.get("bad_token", 0) + 1
                self.reply(ident, req_id, P.ErrorReply("bad_token", "missing or wrong token"))
                return
            msg = P.build(type_name, values)
            handler = getattr(self, "on_" + type_name, None)
            if handler is None or not type_name.endswith("Request"):
                raise ProtocolError(f"{self.name} does not serve {type_name}", code="unknown_type")
            t0 = time.perf_counter()
            out = handler(msg, frames[1:], ident, req_id)
            hist = self.latency.get(type_name)
            if hist is None:
                hist = self.latency[type_name] = Histogram()
            hist.observe(time.perf_counter() - t0)
        except ProtocolError as exc:
            self._warn(exc.code, "%s: rejected request: %s", self.name, exc)
            self.rejected[exc.code] = self.rejected.get(exc.code, 0) + 1
            self.reply(ident, req_id, P.ErrorReply(exc.code, str(exc)))
            return
        except Exception as exc:
            log.exception("%s: request failed", self.name)
            self.reply(ident, req_id, P.ErrorReply("internal", f"{type(exc).__name__}: {exc}"))
            return
        if out is not None:
            msg, payload = out
            self.reply(ident, req_id, msg, payload)


def host_of(address: str) -> str:
    """'127.0.0.1' of 'tcp://127.0.0.1:7370'."""
    return address.split("://", 1)[-1].rsplit(":", 1)[0].strip("[]")


def exposed_without_token(bind: str, token: str) -> bool:
    """True when a server would listen beyond loopback with no token to check."""
    if token:
        return False
    host = host_of(bind)
    if host == "localhost":
        return False
    try:
        return not ipaddress.ip_address(host).is_loopback
    except ValueError:      # a host name or interface name: not provably loopback
        return True


_ids = itertools.count(1)


class Channel:
    """One connection to a service, with request ids, deadlines and reconnect-on-timeout:
    through the service's direct port when ``direct`` names one that takes connections, else
    a ZeroMQ DEALER. Not thread-safe: one per thread."""

    def __init__(self, ctx: zmq.Context, address: str, token: str = "", direct: str = "",
                 timeout_s: float = SEND_TIMEOUT_S):
        self.ctx = ctx
        self.address = address
        self.token = token
        self.direct = direct                # host:port of the service's direct port, or ""
        self.timeout_s = timeout_s          # longest a direct connect or send may block
        self.sock: Optional[zmq.Socket] = None
        self.conn: Optional[socket.socket] = None
        self._inbuf = bytearray()
        self._scratch: Optional[memoryview] = None      # replies are read into it
        self._direct_down_until = 0.0
        self._waiting: set[int] = set()     # requests sent and not yet answered
        self._early: dict[int, tuple] = {}  # their replies that came before they were asked for

    def _connect(self) -> zmq.Socket:
        if self.sock is None:
            self.sock = self.ctx.socket(zmq.DEALER)
            self.sock.setsockopt(zmq.LINGER, 0)
            self.sock.connect(self.address)
        return self.sock

    def _direct_conn(self) -> Optional[socket.socket]:
        """The direct connection, opened when there may be one (and no ZeroMQ request of this
        channel is still unanswered); None: use ZeroMQ."""
        if self.conn is not None:
            if self._waiting or self._peer_open():
                return self.conn
            self.reset()        # the service restarted: nothing was in flight, connect anew
        if not self.direct or self._waiting or time.monotonic() < self._direct_down_until:
            return None
        try:
            conn = dial(self.direct, min(CONNECT_TIMEOUT_S, self.timeout_s))
        except (OSError, ValueError) as exc:
            self._direct_down_until = time.monotonic() + DIRECT_RETRY_S
            log.warning("direct port %s of %s: %s; using ZeroMQ for %.0fs", self.direct,
                        self.address, exc, DIRECT_RETRY_S)
            return None
        if self.sock is not None:           # nothing is awaited on it: late replies go with it
            self.sock.close(0)
            self.sock = None
        self.conn, self._inbuf = conn, bytearray()
        return conn

    def alive(self) -> bool:
        """Whether this channel holds a direct connection the service has not closed: its
        process is up, or was when the last bytes came (a process that dies closes it)."""
        return self.conn is not None and (bool(self._waiting) or self._peer_open())

    def _peer_open(self) -> bool:
        """False when the idle direct connection was closed by the service (restarted). Late
        replies to forgotten requests (a Release's, say) are read on the way and dropped:
        left in the socket, they would hide the end of the stream behind them."""
        while readable(self.conn):
            try:
                if not self._read_direct(0.0):
                    return True
                self._take_direct(0)        # no request has id 0: keeps only awaited replies
            except StoreUnavailable:        # closed (the channel is reset)
                return False
        return True

    def send(self, msg: P.Message, payload: Optional[list] = None) -> int:
        """Send without waiting; returns the request id to pass to ``recv``. Several requests
        may be in flight; ``recv`` them in any order."""
        req_id = next(_ids)
        frames = P.encode(msg, req_id, self.token, payload)
        conn = self._direct_conn()
        if conn is not None:
            try:
                conn.settimeout(self.timeout_s)
                send_all(conn, pack_frames(frames))
            except OSError as exc:
                self.reset()
                raise StoreUnavailable(f"sending to {self.direct} failed: {exc}") from None
        else:
            self._connect().send_multipart(frames, copy=False)
        self._waiting.add(req_id)
        return req_id

    def recv(self, req_id: int, deadline: float, reset: bool = True) -> tuple[P.Message, list]:
        """The reply to ``req_id``, or StoreUnavailable at ``deadline`` (monotonic seconds).
        A timeout resets the channel, unless ``reset`` is False: then the request is still
        awaited and a later ``recv`` may get its reply (``deadline=0``: only if it is here)."""
        early = self._early.pop(req_id, None)
        if early is not None:
            self._waiting.discard(req_id)
            return early
        if req_id not in self._waiting:
            raise StoreUnavailable(f"request to {self.address} was dropped (the channel was reset)")
        if self.conn is not None:
            got = self._take_direct(req_id)
            while got is None:
                if not self._read_direct(deadline - time.monotonic()):
                    if reset:
                        self.reset()
                    raise StoreUnavailable(f"no reply from {self.direct} in time")
                got = self._take_direct(req_id)
            self._waiting.discard(req_id)
            return got
        sock = self._connect()
        while True:
            left = deadline - time.monotonic()
            if not sock.poll(int(left * 1000) + 1 if left > 0 else 0, zmq.POLLIN):
                if reset:
                    self.reset()
                raise StoreUnavailable(f"no reply from {self.address} in time")
            got = self._take(sock, req_id)
            if got is not None:
                self._waiting.discard(req_id)
                return got

    def ready(self, req_id: int) -> bool:
        """Whether the reply to ``req_id`` is here, so ``recv`` would not wait (never waits)."""
        if self.conn is not None:
            while req_id not in self._early:
                got = self._take_direct(req_id)
                if got is not None:
                    self._early[req_id] = got
                elif self.conn is None or not self._read_direct(0.0):
                    break
            return req_id in self._early
        while req_id not in self._early and self.sock is not None and self.sock.poll(0, zmq.POLLIN):
            got = self._take(self.sock, req_id)
            if got is not None:
                self._early[req_id] = got
        return req_id in self._early

    def _read_direct(self, timeout: float) -> bool:
        """Read what the direct connection has within ``timeout`` seconds; False when nothing
        came. A broken connection resets the channel and raises StoreUnavailable."""
        if self._scratch is None:
            self._scratch = memoryview(bytearray(CHANNEL_RECV_BYTES))
        try:
            self.conn.settimeout(max(0.0, timeout))
            data = recv_some(self.conn, self._scratch)
        except (socket.timeout, BlockingIOError, InterruptedError):
            return False
        except OSError as exc:
            self.reset()
            raise StoreUnavailable(f"connection to {self.direct} failed: {exc}") from None
        if not data:
            self.reset()
            raise StoreUnavailable(f"{self.direct} closed the connection")
        self._inbuf += data
        return True

    def _take_direct(self, req_id: int) -> Optional[tuple]:
        """Like ``_take``, from the bytes the direct connection has delivered so far."""
        while self.conn is not None:
            try:
                got = parse_frames(self._inbuf, 1 << 62)
            except ProtocolError as exc:
                self.reset()
                raise StoreUnavailable(f"bad reply from {self.direct}: {exc}") from None
            if got is None:
                return None
            del self._inbuf[: got[0]]
            try:
                msg, rid, _, payload = P.decode(got[1])
            except ProtocolError as exc:
                log.warning("bad reply from %s: %s", self.direct, exc)
                continue
            if rid == req_id:
                return msg, payload
            if rid in self._waiting:
                self._early[rid] = (msg, payload)
        return None

    def _take(self, sock: zmq.Socket, req_id: int) -> Optional[tuple]:
        """Receive one reply: (message, payload) when it answers ``req_id``; another awaited
        one is kept for its own ``recv``; a late reply to a forgotten request is dropped."""
        frames = sock.recv_multipart(copy=False)
        try:
            msg, rid, _, payload = P.decode(frames)
        except ProtocolError as exc:
            log.warning("bad reply from %s: %s", self.address, exc)
            return None
        if rid == req_id:
            return msg, payload
        if rid in self._waiting:
            self._early[rid] = (msg, payload)
        return None

    def forget(self, req_ids) -> None:
        """Stop waiting for these requests (their replies are dropped when they come)."""
        for rid in req_ids:
            self._waiting.discard(rid)
            self._early.pop(rid, None)

    def call(self, msg: P.Message, timeout_s: float, payload: Optional[list] = None) -> tuple[P.Message, list]:
        """Send and wait; ErrorReply becomes RemoteError."""
        rid = self.send(msg, payload)
        reply, frames = self.recv(rid, time.monotonic() + timeout_s)
        P.raise_if_error(reply)
        return reply, frames

    def reset(self) -> None:
        """Drop the connection (and anything queued on it); the next call reconnects."""
        if self.sock is not None:
            self.sock.close(0)
            self.sock = None
        if self.conn is not None:
            self.conn.close()
            self.conn = None
            self._inbuf = bytearray()
        self._waiting.clear()
        self._early.clear()

    def close(self) -> None:
        self.reset()
