"""Request/reply plumbing over ZeroMQ shared by the master, the nodes and the client.

``Service``: the stable side. A ROUTER bound to one address, one thread, every receive under a
poll timeout, a ``tick`` hook for timers, dispatch to ``on_<Verb>Request`` methods. Malformed
frames, unknown types, wrong versions and bad tokens get an ``ErrorReply``; the loop keeps going.

``Channel``: the volatile side (Lazy Pirate). A DEALER that tags each request with an id, waits
for the matching reply under a deadline, and on a timeout closes and reconnects, so a restarted
server is picked up and stale replies are dropped. Not thread-safe: one per thread.
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
from .errors import ProtocolError, StoreUnavailable
from .metrics import Histogram, MetricsServer, render

log = logging.getLogger(__name__)

# Replies are sent immediately or deferred; a handler returns one of these.
Reply = Optional[tuple[P.Message, list]]


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

    def add_socket(self, sock, on_readable: Callable[[], None]) -> None:
        """Poll another socket or file descriptor in the same loop (the node's channel to
        the master, the SSD writer's wake-up pipe)."""
        self._extra.append((sock, on_readable))

    def tick(self, now: float) -> None:
        """Called every loop turn; timers live here."""

    def serve_forever(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        for sock, _ in self._extra:
            poller.register(sock, zmq.POLLIN)
        log.info("%s listening on %s", self.name, self.address)
        while not self.stopping.is_set():
            try:
                events = dict(poller.poll(self.poll_ms))
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

    def reply(self, ident: bytes, req_id: int, msg: P.Message, payload: Optional[list] = None) -> None:
        self.sock.send_multipart([ident] + P.encode(msg, req_id, payload=payload), copy=False)

    def _serve_one(self) -> None:
        frames = self.sock.recv_multipart(copy=False)
        ident = frames[0].bytes
        req_id = 0
        try:
            if len(frames) < 2:
                raise ProtocolError("message has no header frame")
            type_name, req_id, token, values = P.decode_header(frames[1])
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
            out = handler(msg, frames[2:], ident, req_id)
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
    """One DEALER connection with request ids, deadlines and reconnect-on-timeout."""

    def __init__(self, ctx: zmq.Context, address: str, token: str = ""):
        self.ctx = ctx
        self.address = address
        self.token = token
        self.sock: Optional[zmq.Socket] = None
        self._waiting: set[int] = set()     # requests sent and not yet answered
        self._early: dict[int, tuple] = {}  # their replies that came before they were asked for

    def _connect(self) -> zmq.Socket:
        if self.sock is None:
            self.sock = self.ctx.socket(zmq.DEALER)
            self.sock.setsockopt(zmq.LINGER, 0)
            self.sock.connect(self.address)
        return self.sock

    def send(self, msg: P.Message, payload: Optional[list] = None) -> int:
        """Send without waiting; returns the request id to pass to ``recv``. Several requests
        may be in flight; ``recv`` them in any order."""
        req_id = next(_ids)
        self._connect().send_multipart(P.encode(msg, req_id, self.token, payload), copy=False)
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
        while req_id not in self._early and self.sock is not None and self.sock.poll(0, zmq.POLLIN):
            got = self._take(self.sock, req_id)
            if got is not None:
                self._early[req_id] = got
        return req_id in self._early

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
        """Drop the socket (and anything queued on it); the next call reconnects."""
        if self.sock is not None:
            self.sock.close(0)
            self.sock = None
        self._waiting.clear()
        self._early.clear()

    def close(self) -> None:
        self.reset()
