"""``Service``: the stable side of the control wire (the master's and each node's one ROUTER).

One ROUTER bound to one address (secured by ``auth.Guard``), one thread, every receive under a
poll timeout, a ``tick`` hook for timers, dispatch to ``on_<Verb>Request(msg, ident, req_id)``
methods, which return the reply, None when they answer later with ``reply``, or a generator that
does the work in slices and returns the reply (see backlog.py). Before a request is decoded
its sender's principal is checked (``Guard.principal``) and ``received`` is told (the master
judges a node's liveness by what it receives from it, not by what it has handled); a request
type its role may not send (``roles``) is refused, and the handler sees the principal as
``self.peer``.

A loop turn reads every message waiting (up to ``DRAIN``) and handles the types in ``first``
at once, in the order read (the master: its nodes' reports and heartbeats); every other request
joins the backlog, admitted against its sender's caps or refused as ``busy`` before it is
decoded, and the backlog is worked on for at most ``backlog.TURN_S`` before the next turn reads
again. So the lookups read in a turn run after the node messages read with them, and a wide
lookup never keeps the node messages that arrive meanwhile unread for more than a turn.

Replies go out without blocking: past ``SNDHWM`` replies queued to one connection (a peer that
does not read) the reply is dropped and counted, as is one to a peer that has gone
(``ROUTER_MANDATORY`` says which); the bytes queued per principal are tracked (backlog.py).
Malformed messages, unknown types and wrong versions get an ``ErrorReply``; the loop keeps going.
"""
from __future__ import annotations

import inspect
import ipaddress
import logging
import threading
import time
from typing import Callable, Hashable, Optional

import zmq

from . import protocol as P
from .auth import Guard, Principal
from .backlog import Backlog, Task
from .connections import Connections
from .errors import ProtocolError
from .frame_errors import peek
from .keys import foreign_key
from .metrics import Exposition, Histogram, MetricsServer

log = logging.getLogger(__name__)

# Messages a service reads in one loop turn: enough for every peer of a busy master to have one
# request in, few enough to keep a turn short; and at most DRAIN_BYTES of them decoded (a
# MAX_KEYS lookup is ~11 MiB, ~40 ms to decode).
DRAIN = 256
DRAIN_BYTES = 16 << 20
READY_STALE_S = 10.0    # /ready fails when the loop has not said it is ready for this long
# Replies queued to one connection before the next is dropped: a client has a request or two
# in flight per connection; a peer that stops reading is then held to this many.
SNDHWM = 128
SWEEP_S = 1.0           # forget sent replies of every peer this often (backlog.sweep)

CLIENTS = ("client", "admin")
# Connections a service keeps (with a token; connections.py): an SGLang rank holds a few
# (its threads' channels, its view's), a node one.
MAX_CONNECTIONS = 4096


class Service:
    """A ROUTER service loop. Subclasses define ``on_<Verb>Request(msg, ident, req_id)``."""

    poll_ms = 50            # wakes the loop at least this often for tick() and the stop flag
    first: tuple = ()       # message types handled as soon as they are read (not in the backlog)
    roles: dict[str, tuple[str, ...]] = {}  # request type -> roles that may send it (CLIENTS)

    def __init__(self, bind: str, token: str = "", name: str = "service",
                 max_frame: int = P.MAX_HEADER_BYTES, max_connections: int = MAX_CONNECTIONS):
        self.ctx = zmq.Context()
        self.guard = Guard(self.ctx, token)
        self.sock = self.guard.secure(self.ctx.socket(zmq.ROUTER), max_frame)
        self.connections = Connections(self.sock, max_connections)
        self.guard.cap("*", self.connections)
        # a peer reconnecting under its routing id (a node after a dropped link) takes it over
        self.sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)   # a reply that cannot go raises: counted
        self.sock.setsockopt(zmq.SNDHWM, SNDHWM)
        try:
            if bind.endswith(":0"):
                port = self.sock.bind_to_random_port(bind.rsplit(":", 1)[0])
                bind = f"{bind.rsplit(':', 1)[0]}:{port}"
            else:
                self.sock.bind(bind)
        except zmq.ZMQError:
            self.connections.close()
            self.sock.close(0)
            self.guard.stop()
            self.ctx.term()
            raise
        self.address = bind
        self.name = name
        self.stopping = threading.Event()
        self._extra: list[tuple[object, Callable[[], None]]] = [
            (self.connections.monitor, self.connections.on_readable)]
        self.latency: dict[str, Histogram] = {}     # handling time per request type
        self.rejected: dict[str, int] = {}          # error replies per code
        self.unsent = {"peer_gone": 0, "peer_not_reading": 0}    # replies dropped, per reason
        self.backlog = Backlog()
        self._first_names = {t.__name__ for t in self.first}
        self._poller: Optional[zmq.Poller] = None
        self._metrics: Optional[MetricsServer] = None
        self._exposition: Optional[Exposition] = None
        self.metrics_url = ""       # http://HOST:PORT/metrics while metrics are served
        self._ready = (False, "starting", time.monotonic())     # (ready, why not, when): /ready
        self._next_publish = 0.0
        self._next_sweep = 0.0
        self._quiet: dict[str, float] = {}
        self.peer = Principal("admin")      # who sent the request being handled
        self.task: Optional[Task] = None    # the request being handled (see resume)
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

    def received(self, ident: bytes, peer: Principal, now: float) -> None:
        """A message came in on connection ``ident`` from ``peer`` (before it is decoded)."""

    def serve_forever(self) -> None:
        poller = self._poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        for sock, _ in self._extra:
            poller.register(sock, zmq.POLLIN)
        log.info("%s listening on %s", self.name, self.address)
        while not self.stopping.is_set():
            try:
                events = dict(poller.poll(0 if self.backlog else self.poll_ms))
                if self.sock in events:
                    self._serve_waiting()
                for sock, handler in self._extra:
                    if sock in events:
                        handler()
                self.backlog.run(self._step)
                now = time.monotonic()
                self.tick(now)
                self._housekeeping(now)
            except zmq.ContextTerminated:
                break
            except Exception:  # a bug in one request must not stop the service
                log.exception("%s: unexpected error in the loop", self.name)
                time.sleep(0.01)
        self.close()

    def _housekeeping(self, now: float) -> None:
        self.connections.age(now)
        if now >= self._next_sweep:
            self._next_sweep = now + SWEEP_S
            self.backlog.sweep()
        if self._metrics is not None and now >= self._next_publish:
            self._next_publish = now + 1.0
            self._exposition.publish(self.metric_families())
            self._ready = (*self.readiness(), now)

    def stop(self) -> None:
        self.stopping.set()

    def close(self) -> None:
        if self._metrics is not None:
            self._metrics.close()
        self.connections.close()
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
        """Answer the peer ``ident`` (its ZeroMQ routing id), without blocking: a reply to a
        connection that is gone or holds SNDHWM unread replies is dropped (counted)."""
        frame = P.encode(msg, req_id)
        try:
            tracker = self.sock.send_multipart([ident, frame], zmq.NOBLOCK, copy=False, track=True)
        except zmq.Again:
            self.unsent["peer_not_reading"] += 1
            return
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EHOSTUNREACH:
                raise
            self.unsent["peer_gone"] += 1
            return
        self.backlog.sending(self._who(ident), ident, tracker, len(frame))

    def _who(self, ident: bytes, peer: Optional[Principal] = None) -> Hashable:
        """Whose caps a connection's requests count against: its principal (with a token: one
        credential), else the connection itself (without one, every peer is trusted alike)."""
        if not self.guard.token:
            return ident
        return peer if peer is not None else (self.guard.known(ident) or ident)

    def _serve_waiting(self) -> None:
        """Read what is waiting: the ``first`` types are handled now, in the order read; the
        rest join the backlog (or are refused as busy before they are decoded)."""
        now, batch, decoded_bytes = time.monotonic(), [], 0
        for _ in range(DRAIN):
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            task = self._read(frames, now)
            if task is not None:
                batch.append(task)
                decoded_bytes += len(frames[1].buffer)
                if decoded_bytes >= DRAIN_BYTES:
                    break
        for task in batch:
            if isinstance(task.msg, self.first):
                self._step(task)
            else:
                self.backlog.fresh.append(task)

    def _read(self, frames: list, now: float) -> Optional[Task]:
        """One message read: a Task, or None when it was refused."""
        ident = frames[0].bytes
        try:
            if len(frames) != 2:
                raise ProtocolError(f"a request is one frame, got {len(frames) - 1}")
            peer = self.guard.principal(ident, frames[1])
            if peer is None:
                raise ProtocolError("the connection's claim does not match its credential",
                                    "unauthenticated")
        except ProtocolError as exc:
            self._refuse(ident, 0, exc.code, str(exc))
            return None
        self.received(ident, peer, now)
        who, nbytes = self._who(ident, peer), len(frames[1].buffer)
        refusal = self.backlog.admit(who, nbytes)
        if refusal is not None:
            _, req_id, name, _ = peek(frames[1].buffer)
            if name not in self._first_names:   # (a node's report is read whatever its caps)
                self._refuse(ident, req_id, *refusal)
                return None
        task = Task(ident, 0, None, peer, who, nbytes if refusal is None else 0)
        try:
            decoded = P.decode(frames[1])
        except ProtocolError as exc:
            self._refuse(ident, getattr(exc, "req_id", 0), exc.code, str(exc))
            self._done(task)
            return None
        task.req_id, task.msg = decoded.req_id, decoded.msg
        return task

    def _refuse(self, ident: bytes, req_id: int, code: str, text: str) -> None:
        self._warn(code, "%s: rejected request: %s", self.name, text)
        self.rejected[code] = self.rejected.get(code, 0) + 1
        self.reply(ident, req_id, P.ErrorReply(code, text))

    def _dispatch(self, task: Task):
        """The handler's outcome for ``task``'s request: a reply, None, or its work (a
        generator); raises ProtocolError for a type this service does not serve to its sender."""
        name = task.name
        handler = getattr(self, "on_" + name, None)
        if handler is None or not name.endswith("Request"):
            raise ProtocolError(f"{self.name} does not serve {name}", "unknown_type")
        if self.guard.token and task.peer.role not in self.roles.get(name, CLIENTS):
            raise ProtocolError(f"a {task.peer.role} may not send {name}", "forbidden")
        return self.call(handler, task.msg, task.ident, task.req_id)

    def call(self, handler: Callable, msg: P.Message, ident: bytes, req_id: int):
        """What ``handler`` makes of a request: a reply, None, or a generator doing the work in
        slices (a subclass may hand a wide request to a generator of its own)."""
        return handler(msg, ident, req_id)

    def _step(self, task: Task) -> bool:
        """One slice of ``task``: its handler's call, or the next slice of the work it returned.
        True once the task is answered (or is to be answered later, by ``reply``)."""
        self.peer, self.task = task.peer, task
        t0 = time.perf_counter()
        out, done = None, True
        try:
            if task.work is None:
                out = self._dispatch(task)
                if inspect.isgenerator(out):
                    task.work, out = out, None
            if task.work is not None:
                out, done = _advance(task.work)
        except ProtocolError as exc:
            self._refuse(task.ident, task.req_id, exc.code, str(exc))
            return self._done(task)
        except Exception as exc:
            log.exception("%s: %s failed", self.name, task.name)
            self.reply(task.ident, task.req_id, P.ErrorReply("internal", f"{type(exc).__name__}: {exc}"))
            return self._done(task)
        task.spent += time.perf_counter() - t0
        if not done:
            return False
        hist = self.latency.get(task.name)
        if hist is None:
            hist = self.latency[task.name] = Histogram()
        hist.observe(task.spent)
        if out is not None:
            self.reply(task.ident, task.req_id, out)
        return self._done(task)

    def resume(self, task: Task, work) -> None:
        """Answer a request set aside earlier (``self.task`` when its handler returned None)
        from the backlog, with ``work``: a reply, or a generator as a handler returns."""
        task.work = work if inspect.isgenerator(work) else _reply_with(work)
        self.backlog.fresh.append(task)

    def _done(self, task: Task) -> bool:
        if task.nbytes:
            self.backlog.release(task)
            task.nbytes = 0
        return True


def _advance(work) -> tuple[Optional[P.Message], bool]:
    """One slice of a handler's work: (the reply, True) once it returns, else (None, False)."""
    try:
        next(work)
    except StopIteration as stop:
        return stop.value, True
    return None, False


def _reply_with(msg):
    """A handler's work that is done already: its reply."""
    return msg
    yield   # (unreached: makes this a generator)


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
