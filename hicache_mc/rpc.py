"""Request/reply over ZeroMQ: the volatile side of the control wire (the stable side, the
master's and each node's ``Service``, is in server.py).

``Channel`` (Lazy Pirate): a DEALER that tags each request with an id and
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

import itertools
import logging
import time
from typing import Optional

import zmq

from . import protocol as P
from .auth import credential, secure_client
from .errors import Misconfigured, ProtocolError, StoreUnavailable
from .link import Down, Link, monitor  # noqa: F401  (monitor: for the view)
from .server import CLIENTS, Service, exposed_without_token, host_of  # noqa: F401

log = logging.getLogger(__name__)

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
