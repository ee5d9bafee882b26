"""What a service holds for its peers between reading a request and its reply leaving.

A service reads what waits on its socket every loop turn, but works on clients' requests for
at most ``TURN_S`` a turn (``Backlog.run``): a handler may return a generator that does its work
in slices (``yield`` between them) and returns the reply, so a wide request is spread across
turns and the socket (with the nodes' heartbeats) is read again between its slices. Fresh
requests and requests under way take turns, one slice each, so a small request is answered
within a slice or two of arriving however many wide ones are under way.

Each principal (a role and tenant: one credential) may hold at most ``PEER_REQUESTS`` requests
and ``PEER_BYTES`` of request frames read and not yet answered, and at most ``PEER_REPLY_BYTES``
of replies ZeroMQ has not yet handed to the kernel (each reply is sent with a tracker that
says when ZeroMQ is done with it); all peers together ``REQUESTS`` and ``BYTES``. A request
over a cap is refused as ``busy`` before it is decoded. So a peer that sends faster than it is
served, or never reads its replies, costs the service a bounded amount and is told so, while
other peers are served.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Generator, Hashable, NamedTuple, Optional

import zmq

from .auth import Principal

# Work a loop turn does on requests before it reads the socket again. A lookup slice costs
# 0.3-6 ms (1,024 keys in one namespace or in as many), so a turn ends within ~15 ms and a
# node's heartbeat is read and applied within that of arriving.
TURN_S = 0.010
# Requests read and not yet answered. Per principal: an SGLang deployment's ranks and threads
# share one credential, each with a request or two in flight; a wide hybrid probe of
# MAX_KEYS keys is ~11 MiB of frame. All peers: a few honest tenants at once.
PEER_REQUESTS = 256
PEER_BYTES = 48 << 20
REQUESTS = 4096
BYTES = 192 << 20
# Reply bytes one principal may have queued in ZeroMQ: an unread snapshot of a 1M-key
# namespace is 16 MiB.
PEER_REPLY_BYTES = 48 << 20


class Refusal(NamedTuple):
    code: str
    text: str


@dataclass(eq=False)
class Task:
    """One request between its reading and its reply."""
    ident: bytes
    req_id: int
    msg: Any                # the request
    peer: Principal         # who sent it (what the handler sees as ``Service.peer``)
    who: Hashable           # whose caps it counts against (a principal; without a token, a connection)
    nbytes: int             # frame bytes held against those caps (0: none, or released)
    work: Optional[Generator] = None    # the handler's slices still to do
    spent: float = 0.0      # seconds of handling so far

    @property
    def name(self) -> str:
        return type(self.msg).__name__


@dataclass
class _Held:
    requests: int = 0
    nbytes: int = 0
    replies: dict = field(default_factory=dict)     # ident -> deque of (tracker, bytes)
    reply_bytes: int = 0


class Backlog:
    """Admission per principal, the tasks under way, and the replies ZeroMQ still holds."""

    def __init__(self):
        self._held: dict[Principal, _Held] = {}
        self.requests = 0
        self.nbytes = 0
        self.fresh: deque[Task] = deque()
        self.running: deque[Task] = deque()

    def __len__(self) -> int:
        return len(self.fresh) + len(self.running)

    def admit(self, peer: Hashable, nbytes: int) -> Optional[Refusal]:
        """Take a request of ``nbytes`` from ``peer`` on, or say why not (nothing is held then)."""
        h = self._held.get(peer) or _Held()
        if h.reply_bytes > PEER_REPLY_BYTES:
            self._sent(h)
        if h.reply_bytes > PEER_REPLY_BYTES:
            return Refusal("busy", f"{h.reply_bytes >> 20} MiB of replies to this credential "
                           "are not read yet")
        if h.requests >= PEER_REQUESTS or h.nbytes + nbytes > PEER_BYTES:
            return Refusal("busy", f"{h.requests} requests ({h.nbytes >> 20} MiB) of this "
                           "credential are waiting")
        if self.requests >= REQUESTS or self.nbytes + nbytes > BYTES:
            return Refusal("busy", f"the server holds {self.requests} requests "
                           f"({self.nbytes >> 20} MiB)")
        self._held[peer] = h
        h.requests += 1
        h.nbytes += nbytes
        self.requests += 1
        self.nbytes += nbytes
        return None

    def release(self, task: Task) -> None:
        """``task`` is answered (or dropped): what it held is free."""
        h = self._held[task.who]
        h.requests -= 1
        h.nbytes -= task.nbytes
        self.requests -= 1
        self.nbytes -= task.nbytes
        self._forget(task.who, h)

    def sending(self, peer: Hashable, ident: bytes, tracker: zmq.MessageTracker, nbytes: int) -> None:
        """A reply of ``nbytes`` to ``peer`` is queued in ZeroMQ until ``tracker`` is done."""
        h = self._held.get(peer)
        if h is None:
            h = self._held[peer] = _Held()
        q = h.replies.get(ident)
        if q is None:
            q = h.replies[ident] = deque()
        while q and q[0][0].done:       # (one connection's replies leave in order)
            h.reply_bytes -= q.popleft()[1]
        q.append((tracker, nbytes))
        h.reply_bytes += nbytes

    def sweep(self) -> None:
        """Forget the replies ZeroMQ has sent (every peer's; a second or so apart)."""
        for peer, h in list(self._held.items()):
            self._sent(h)
            self._forget(peer, h)

    @staticmethod
    def _sent(h: "_Held") -> None:
        for ident, q in list(h.replies.items()):
            while q and q[0][0].done:
                h.reply_bytes -= q.popleft()[1]
            if not q:
                del h.replies[ident]

    def _forget(self, peer: Hashable, h: _Held) -> None:
        if not h.requests and not h.replies:
            del self._held[peer]

    def run(self, step: Callable[[Task], bool], budget_s: float = TURN_S) -> None:
        """Work on the tasks for about ``budget_s``: fresh ones and ones under way take turns,
        one slice each; ``step(task)`` does one and says whether the task is done."""
        end = time.perf_counter() + budget_s
        fresh_turn = True
        while self.fresh or self.running:
            queue = self.fresh if (fresh_turn and self.fresh) or not self.running else self.running
            fresh_turn = not fresh_turn
            task = queue.popleft()
            if not step(task):
                self.running.append(task)
            if time.perf_counter() >= end:
                return
