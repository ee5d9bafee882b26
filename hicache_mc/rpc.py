"""Request/reply over ZeroMQ: the one control wire of the master and the nodes.

``Service``: the stable side. One ROUTER bound to one address (secured by ``auth.Guard``), one
thread, every receive under a poll timeout, a ``tick`` hook for timers, dispatch to
``on_<Verb>Request(msg, ident, req_id)`` methods, which return the reply (or None when they
answer later with ``reply``). Before a request is decoded its sender's principal is checked
(``Guard.principal``); a request type its role may not send (``roles``) is refused, and the
handler sees the principal as ``self.peer``. Each loop turn reads every message waiting (up to ``DRAIN``)
and handles the types in ``first`` before the others: the master applies its nodes' reports
before the lookups that arrived with them. Malformed messages, unknown types and wrong
versions get an ``ErrorReply``; the loop keeps going.

``Channel``: the volatile side (Lazy Pirate). A DEALER that tags each request with an id and
waits for the matching reply under a deadline; on a timeout or a lost connection it closes,
and the next call connects anew, so a restarted server is picked up and stale replies are
dropped. ZeroMQ's own reconnecting is off: a channel watches its socket's monitor
(``link.Link``), and a refused connect, a failed handshake or a dropped connection fails the
call at once with the cause named (``link.Down``: a wrong or missing token is not a dead
peer), so a dead peer costs one connect attempt, not the caller's deadline (and an idle
channel to a dead peer queues no events). Nothing blocks past the deadline: ``send`` never
blocks, and ``recv`` hands ZeroMQ what it could not take yet under the deadline. Several
requests may be in flight; replies are taken in any order. Not thread-safe: one per thread.
"""
from __future__ import annotations

import ipaddress
import itertools
import logging
import threading
import time
from typing import Callable, Optional

import zmq

from . import protocol as P
from .auth import Principal, Guard, credential, secure_client
from .errors import Misconfigured, ProtocolError, StoreUnavailable
from .keys import foreign_key
from .link import Down, Link, monitor  # noqa: F401  (monitor: for the view)
from .metrics import Exposition, Histogram, MetricsServer

log = logging.getLogger(__name__)

# Messages a service reads in one loop turn before handling them (node reports first): enough
# for every peer of a busy master to have one request in, few enough to keep a turn short; and
# at most DRAIN_BYTES of them held at once (a MAX_KEYS lookup is ~11 MiB).
DRAIN = 256
DRAIN_BYTES = 32 << 20
READY_STALE_S = 10.0    # /ready fails when the loop has not said it is ready for this long

CLIENTS = ("client", "admin")


class Service:
    """A ROUTER service loop. Subclasses define ``on_<Verb>Request(msg, ident, req_id)``."""

    poll_ms = 50            # wakes the loop at least this often for tick() and the stop flag
    first: tuple = ()       # message types handled before the others read in the same turn
    roles: dict[str, tuple[str, ...]] = {}  # request type -> roles that may send it (CLIENTS)

    def __init__(self, bind: str, token: str = "", name: str = "service",
                 max_frame: int = P.MAX_HEADER_BYTES):
        self.ctx = zmq.Context()
        self.guard = Guard(self.ctx, token)
        self.sock = self.guard.secure(self.ctx.socket(zmq.ROUTER), max_frame)
        # a peer reconnecting under its routing id (a node after a dropped link) takes it over
        self.sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        try:
            if bind.endswith(":0"):
                port = self.sock.bind_to_random_port(bind.rsplit(":", 1)[0])
                bind = f"{bind.rsplit(':', 1)[0]}:{port}"
            else:
                self.sock.bind(bind)
        except zmq.ZMQError:
            self.sock.close(0)
            self.guard.stop()
            self.ctx.term()
            raise
        self.address = bind
        self.name = name
        self.stopping = threading.Event()
        self._extra: list[tuple[object, Callable[[], None]]] = []
        self.latency: dict[str, Histogram] = {}     # handling time per request type
        self.rejected: dict[str, int] = {}          # error replies per code
        self._poller: Optional[zmq.Poller] = None
        self._metrics: Optional[MetricsServer] = None
        self._exposition: Optional[Exposition] = None
        self.metrics_url = ""       # http://HOST:PORT/metrics while metrics are served
        self._ready = (False, "starting", time.monotonic())     # (ready, why not, when): /ready
        self._next_publish = 0.0
        self._quiet: dict[str, float] = {}
        self.peer = Principal("admin")      # who sent the request being handled
        if exposed_without_token(bind, token):
            log.warning("%s binds %s without a token: anyone who reaches it can read and write "
                        "the store (set token)", name, bind)

    def enable_metrics(self, host: str, port: int) -> None:
        """Serve Prometheus metrics on http://host:port/metrics (0 = any free port, -1 = off)."""
        if port >= 0:
            self._exposition = Exposition()
            self._metrics = MetricsServer(host, port, self._exposition.text, self._ready_now)
            self.metrics_url = f"http://{f'[{host}]' if ':' in host else host}:{self._metrics.port}/metrics"
            log.info("%s metrics on %s", self.name, self.metrics_url)

    def readiness(self) -> tuple[bool, str]:
        """Whether the service does its job now, and why not (the metrics port's /ready);
        asked on the loop thread once a second."""
        return True, ""

    def _ready_now(self) -> tuple[bool, str]:
        ok, why, at = self._ready
        if time.monotonic() - at > READY_STALE_S:
            return False, f"the {self.name}'s loop has not turned for {READY_STALE_S:.0f} s"
        return ok, why

    def metric_families(self) -> list:
        """The service's metric families (built on the loop thread); see hicache_mc/metrics.py."""
        return []

    def add_socket(self, sock, on_readable: Callable[[], None]) -> None:
        """Poll another socket or file descriptor in the same loop (the node's channel to
        the master, the SSD writer's wake-up pipe), from now on, even while the loop runs."""
        self._extra.append((sock, on_readable))
        if self._poller is not None:
            self._poller.register(sock, zmq.POLLIN)

    def tick(self, now: float) -> None:
        """Called every loop turn; timers live here."""

    def serve_forever(self) -> None:
        poller = self._poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        for sock, _ in self._extra:
            poller.register(sock, zmq.POLLIN)
        log.info("%s listening on %s", self.name, self.address)
        while not self.stopping.is_set():
            try:
                events = dict(poller.poll(self.poll_ms))
                if self.sock in events:
                    self._serve_waiting()
                for sock, handler in self._extra:
                    if sock in events:
                        handler()
                now = time.monotonic()
                self.tick(now)
                if self._metrics is not None and now >= self._next_publish:
                    self._next_publish = now + 1.0
                    self._exposition.publish(self.metric_families())
                    self._ready = (*self.readiness(), now)
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
        self.sock.close(0)
        for sock, _ in self._extra:
            if isinstance(sock, zmq.Socket):
                sock.close(0)
        self.guard.stop()
        self.ctx.term()

    def _warn(self, what: str, fmt: str, *args) -> None:
        """A log line per kind of bad request, at most once a second: a flood stays readable."""
        now = time.monotonic()
        if now >= self._quiet.get(what, 0.0):
            self._quiet[what] = now + 1.0
            log.warning(fmt, *args)

    def check_tenant(self, keys: list[str]) -> None:
        """Refuse (``forbidden``) a client's request naming keys outside its own tenant."""
        if self.peer.role == "client":
            bad = foreign_key(keys, self.peer.tenant)
            if bad is not None:
                raise ProtocolError(f"key {bad[:80]!r} is not in tenant {self.peer.tenant!r}", "forbidden")

    def reply(self, ident: bytes, req_id: int, msg: P.Message) -> None:
        """Answer the peer ``ident`` (its ZeroMQ routing id)."""
        self.sock.send_multipart([ident, P.encode(msg, req_id)], copy=False)

    def _serve_waiting(self) -> None:
        """Read what is waiting, decode it, handle the ``first`` types, then the rest."""
        batch, held = [], 0
        for _ in range(DRAIN):
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            got = self._decode(frames)
            if got is not None:
                batch.append(got)
            held += sum(len(f.buffer) for f in frames)
            if held >= DRAIN_BYTES:
                break
        if self.first and len(batch) > 1:
            batch.sort(key=lambda item: not isinstance(item[1].msg, self.first))
        for ident, decoded, peer in batch:
            try:
                self._handle(ident, decoded, peer)
            except Exception:   # one request's failure must not drop the others read with it
                log.exception("%s: request failed", self.name)

    def _decode(self, frames: list) -> Optional[tuple[bytes, P.Decoded, Principal]]:
        ident = frames[0].bytes
        try:
            if len(frames) != 2:
                raise ProtocolError(f"a request is one frame, got {len(frames) - 1}")
            peer = self.guard.principal(ident, frames[1])
            if peer is None:
                raise ProtocolError("the connection's claim does not match its credential",
                                    "unauthenticated")
            return ident, P.decode(frames[1]), peer
        except ProtocolError as exc:
            self._refuse(ident, getattr(exc, "req_id", 0), exc.code, str(exc))
            return None

    def _refuse(self, ident: bytes, req_id: int, code: str, text: str) -> None:
        self._warn(code, "%s: rejected request: %s", self.name, text)
        self.rejected[code] = self.rejected.get(code, 0) + 1
        self.reply(ident, req_id, P.ErrorReply(code, text))

    def _handle(self, ident: bytes, decoded: P.Decoded, peer: Principal) -> None:
        """One request: dispatch, time, reply."""
        msg, req_id = decoded.msg, decoded.req_id
        type_name = type(msg).__name__
        handler = getattr(self, "on_" + type_name, None)
        if handler is None or not type_name.endswith("Request"):
            self._refuse(ident, req_id, "unknown_type", f"{self.name} does not serve {type_name}")
            return
        if self.guard.token and peer.role not in self.roles.get(type_name, CLIENTS):
            self._refuse(ident, req_id, "forbidden", f"a {peer.role} may not send {type_name}")
            return
        self.peer = peer
        t0 = time.perf_counter()
        try:
            out = handler(msg, ident, req_id)
        except ProtocolError as exc:
            self._refuse(ident, req_id, exc.code, str(exc))
            return
        except Exception as exc:
            log.exception("%s: %s failed", self.name, type_name)
            self.reply(ident, req_id, P.ErrorReply("internal", f"{type(exc).__name__}: {exc}"))
            return
        hist = self.latency.get(type_name)
        if hist is None:
            hist = self.latency[type_name] = Histogram()
        hist.observe(time.perf_counter() - t0)
        if out is not None:
            self.reply(ident, req_id, out)


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


_ids = itertools.count(1)     # request ids, unique in the process


class Channel:
    """One DEALER connection to a service, with request ids, deadlines, reconnect-on-failure
    and fail-fast on a dead peer (see the module docstring). Not thread-safe: one per thread."""

    def __init__(self, ctx: zmq.Context, address: str, token: str = ""):
        self.ctx = ctx
        self.address = address
        self.cred = credential(token)       # the cluster token, a credential, or ""
        self.sock: Optional[zmq.Socket] = None
        self.link: Optional[Link] = None
        self._poller: Optional[zmq.Poller] = None
        self._waiting: set[int] = set()     # requests sent (or to send) and not yet answered
        self._unsent: dict[int, bytes] = {}     # requests ZeroMQ has not taken yet, by id
        self._replies: dict[int, P.Message] = {}    # replies taken while waiting for another
        self.last_down: Optional[Down] = None   # why the last connection went down

    def _connect(self) -> zmq.Socket:
        if self.sock is None:
            sock = secure_client(self.ctx.socket(zmq.DEALER), self.cred)
            sock.setsockopt(zmq.RECONNECT_IVL, -1)      # the channel reconnects itself
            self.link = Link(sock, self.cred is not None)
            sock.connect(self.address)
            self._poller = zmq.Poller()
            self._poller.register(self.link.events, zmq.POLLIN)
            self.sock = sock
        return self.sock

    def _watch(self) -> None:
        """A connection that is gone resets the channel and raises StoreUnavailable (or
        Misconfigured, when no retry will mend it): the replies awaited on it will not come."""
        down = self.link.down() if self.link is not None else None
        if down is not None:
            self.last_down = down
            self.reset()
            raise (Misconfigured if down.misconfigured else StoreUnavailable)(
                f"{self.address}: {down.value}", down)

    def send(self, msg: P.Message) -> int:
        """Queue a request and return its id for ``recv``; never blocks. ZeroMQ takes the frame
        now when it can, else ``recv`` hands it over under its deadline (ZeroMQ holds nothing
        for a connection that failed its handshake: a blocking send would wait for good). An
        idle channel whose connection dropped (the server restarted) connects anew; one with
        requests in flight raises StoreUnavailable."""
        self._connect()
        if self._waiting:
            self._watch()
        elif self.link.down() is not None:
            self.reset()
        sock = self._connect()
        req_id = next(_ids)
        frame = P.encode(msg, req_id)
        self._waiting.add(req_id)
        if self._unsent or not self._hand_over(sock, frame):
            self._unsent[req_id] = frame
        return req_id

    @staticmethod
    def _hand_over(sock: zmq.Socket, frame: bytes) -> bool:
        try:
            sock.send(frame, zmq.NOBLOCK, copy=False)
            return True
        except zmq.Again:
            return False

    def _flush(self) -> None:
        """Hand ZeroMQ the queued requests it takes now, in order."""
        for rid in list(self._unsent):
            if not self._hand_over(self.sock, self._unsent[rid]):
                return
            del self._unsent[rid]

    def recv(self, req_id: int, deadline: float) -> P.Message:
        """The reply to ``req_id``, or StoreUnavailable (the channel reset) at ``deadline``
        (monotonic seconds) or as soon as the connection drops. Replies to other requests
        still awaited are kept for their own ``recv``."""
        got = self._replies.pop(req_id, None)
        if got is not None:
            self._waiting.discard(req_id)
            return got
        if req_id not in self._waiting or self.sock is None:
            raise StoreUnavailable(f"request to {self.address} was dropped (the channel was reset)")
        while True:
            if self._unsent:
                self._flush()
            self._poller.register(self.sock, zmq.POLLIN | (zmq.POLLOUT if self._unsent else 0))
            left = deadline - time.monotonic()
            events = dict(self._poller.poll(int(left * 1000) + 1 if left > 0 else 0))
            if events.get(self.sock, 0) & zmq.POLLIN:   # (a reply that came before a drop)
                got = self._take(req_id)
                if got is not None:
                    self._waiting.discard(req_id)
                    return got
            elif self.link.events in events:
                self._watch()
            elif not events:
                self.reset()
                raise StoreUnavailable(f"no reply from {self.address} in time")

    def _take(self, req_id: int) -> Optional[P.Message]:
        """Receive one reply: the message when it answers ``req_id``; one answering another
        awaited request is kept for it, one to a request not awaited (a Release) dropped."""
        frame = self.sock.recv(copy=False)
        try:
            msg, rid = P.decode(frame, request=False)
        except ProtocolError as exc:
            log.warning("bad reply from %s: %s", self.address, exc)
            return None
        if rid == req_id:
            return msg
        if rid in self._waiting:
            self._replies[rid] = msg
        return None

    def forget(self, req_ids) -> None:
        """Stop waiting for these requests (their replies are dropped when they come)."""
        for rid in req_ids:
            self._waiting.discard(rid)
            self._replies.pop(rid, None)
            self._unsent.pop(rid, None)

    def call(self, msg: P.Message, timeout_s: float) -> P.Message:
        """Send and wait; ErrorReply becomes RemoteError."""
        rid = self.send(msg)
        return P.raise_if_error(self.recv(rid, time.monotonic() + timeout_s))

    def reset(self) -> None:
        """Drop the connection (and anything queued on it); the next call reconnects."""
        if self.link is not None:
            self.link.close()
            self.link = None
        if self.sock is not None:
            self.sock.close(0)
            self.sock = None
        self._poller = None
        self._waiting.clear()
        self._unsent.clear()
        self._replies.clear()

    def close(self) -> None:
        self.reset()
