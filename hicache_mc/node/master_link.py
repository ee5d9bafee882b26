"""MasterLink: a storage node's DEALER to the master: registration, heartbeats, reports.

Commits are reported to the master before the writer hears back: the node sends ``Committed``
(numbered: the node's report sequence) and then answers the writer with that number, without
waiting for the master's acknowledgement. The writer's next lookups carry the number as a
fence, which the master honours before answering (protocol.py), so a put that returns is
visible to its writer at once, and to every other client as soon as the master has read the
message the node sent before answering. A node whose messages to the master are lost
registers again with its whole inventory, so nothing it acknowledged stays unknown to the
master. Evictions are numbered in the same sequence and travel on the same connection: the
master applies a node's reports only in the node's order (one out of order is refused, and
the node registers again), and an eviction is reported only for a key the node does not hold
again by the time the report goes.

The node reports through its DEALER to the master's ROUTER, which applies reports read in the
same loop turn as lookups before them: a report that reached the master before a lookup that
the writer's answer led to (from any client) is applied first. Until it has registered with
the current master the node sends no reports: the inventory it registers with covers them.

The link never blocks the node: its DEALER queues nothing for a master that is not connected
(``IMMEDIATE``), and a message that cannot go now is dropped and the node registers again.
"""
from __future__ import annotations

import logging
import time
from typing import Callable, NamedTuple, Optional

import zmq

from .. import protocol as P
from ..auth import issue, secure_client
from ..config import NodeConfig
from ..link import WARN_EVERY_S, Link

log = logging.getLogger(__name__)

INVENTORY_CHUNK = 4096      # keys per Committed message when registering
MASTER_TIMEOUT_S = 5.0      # a client request waiting for the master's acknowledgement fails then


class Waiter(NamedTuple):
    """A client request answered once the master acknowledges a report (``ok``), or with
    ``failed`` when it refuses it, cannot be sent it, or does not answer in time."""
    ident: bytes
    req_id: int
    ok: P.Message
    failed: P.Message


class MasterLink:
    def __init__(self, ctx: zmq.Context, config: NodeConfig, info: P.NodeInfo,
                 reply: Callable[[bytes, int, P.Message], None]):
        """``reply(ident, req_id, msg)`` answers a client of the node (for ``Waiter``s)."""
        self.config, self.info, self._reply = config, info, reply
        self.sock = secure_client(ctx.socket(zmq.DEALER),
                                  issue(config.token, "node") if config.token else None)
        # nothing is queued for a master that is not connected: a send fails at once (and the
        # node registers again later) instead of piling reports up or blocking the loop
        self.sock.setsockopt(zmq.IMMEDIATE, 1)
        self._link = Link(self.sock, bool(config.token))     # why it cannot reach the master
        self.events = self._link.events         # (the node polls it: ``check``)
        self.sock.connect(config.master)
        self._announced = False     # registered (with the inventory) on the current connection
        self._req = 0
        self._register_req = 0      # request id of the latest RegisterRequest
        self._seq = 0               # reports numbered (see the module docstring)
        self._pending: dict[int, tuple[float, Waiter]] = {}     # req id -> (deadline, waiter)
        self.epoch: Optional[str] = None    # the master's, once it took the registration
        self._next_heartbeat = 0.0
        self._next_register = 0.0
        self._last_reply = time.monotonic()
        self._refusals: dict[str, tuple[float, int]] = {}   # code -> (last logged, since then)

    @property
    def registered(self) -> bool:
        return self.epoch is not None

    @property
    def problem(self) -> str:
        """Why the master cannot be reached now ("" while it can, or none is known yet)."""
        return self._link.problem

    def check(self) -> None:
        """Read the connection's events (``events`` is readable); a cause is logged."""
        self._link.check(f"the master at {self.config.master}")

    @property
    def seq(self) -> int:
        """The number of the latest report (a fence for the writers' lookups)."""
        return self._seq

    # -------------------------------------------------------------- reports

    def committed(self, keys: list[str], sizes: list[int], sums: list[int]) -> int:
        """Report new objects (numbered, sent unless the node is not registered: its
        inventory will cover them); their number."""
        self._seq += 1
        if self._announced:
            self._send(P.CommittedRequest(self.info.node_id, keys, sizes, sums, self._seq))
        return self._seq

    def evicted(self, keys: list[str], waiter: Optional[Waiter] = None,
                cleared: bool = False) -> bool:
        """Report keys that left the node (evicted, or ``cleared`` on purpose: counted apart),
        numbered like commits; False (nothing sent, the waiter not answered) while the node is
        not registered: the inventory it registers with leaves them out."""
        if not self._announced:
            return False
        self._seq += 1
        self._send(P.EvictedRequest(self.info.node_id, keys, self._seq, cleared), waiter)
        return True

    def _send(self, msg: P.Message, waiter: Optional[Waiter] = None) -> None:
        """Send to the master; ``waiter`` is answered once the master acknowledges. A message
        that cannot go now (no master connected, or one that does not read) is dropped, and
        the node registers again: its inventory covers every report."""
        self._req += 1
        try:
            self.sock.send(P.encode(msg, self._req), zmq.NOBLOCK, copy=False)
        except zmq.Again:
            self._announced, self.epoch = False, None
            if waiter is not None:
                self._reply(waiter.ident, waiter.req_id, waiter.failed)
            return
        if waiter is not None:
            self._pending[self._req] = (time.monotonic() + MASTER_TIMEOUT_S, waiter)

    # -------------------------------------------------------------- registration

    def _register(self, now: float, inventory: list) -> None:
        """Announce this node and its whole inventory, (key, size, checksum) per object."""
        self._next_register = now + self.config.heartbeat_interval_s
        self._announced = True
        self._send(P.RegisterRequest(self.info.to_dict()))
        self._register_req = self._req
        for i in range(0, len(inventory), INVENTORY_CHUNK):
            chunk = inventory[i: i + INVENTORY_CHUNK]
            self._send(P.CommittedRequest(self.info.node_id, [c[0] for c in chunk],
                                          [c[1] for c in chunk], [c[2] for c in chunk]))
        # the inventory covers every commit so far: fences up to the current seq hold now
        self._send(P.CommittedRequest(self.info.node_id, [], [], [], self._seq))
        self._next_heartbeat = 0.0      # the master has its stats at once
        if self._announced:         # else a send failed: the master is not there (yet)
            log.info("registering with the master at %s (%d objects)", self.config.master,
                     len(inventory))

    def on_readable(self) -> Optional[dict[str, int]]:
        """Take one reply from the master; the quotas (tenant -> bytes on this node) when it
        is a heartbeat's answer, else None."""
        frame = self.sock.recv(copy=False)
        try:
            msg, req_id = P.decode(frame, request=False)
        except Exception as exc:
            log.warning("bad frame from the master: %s", exc)
            return None
        self._last_reply = time.monotonic()
        quotas = None
        if isinstance(msg, P.RegisterReply):
            # only the answer to the latest registration, and only while it stands: a send
            # that failed since (or a refused report) means registering again, and a late
            # answer must not mark the node registered while its reports are held back
            if req_id == self._register_req and self._announced:
                self.epoch = msg.epoch
        elif isinstance(msg, P.HeartbeatReply):
            quotas = {t: int(q) for t, q in msg.quotas.items()}
            # (while registering, epoch is None and tick retries: no second registration here;
            # nor for a heartbeat sent before this registration, e.g. queued over ZeroMQ while
            # the master was down, that reached it before the registration did)
            if self.epoch is not None and req_id > self._register_req and \
                    (not msg.known or msg.epoch != self.epoch):
                log.info("master epoch %s (was %s): registering again", msg.epoch, self.epoch)
                self._announced, self.epoch = False, None   # tick registers again
                self._next_register = 0.0
        elif isinstance(msg, P.ErrorReply):
            self._refused(msg)
            if req_id >= self._register_req:
                # the registration, a heartbeat or a report the master did not take, whatever
                # the reason (it does not know the node, one before was lost, a limit, a
                # fault): register again, with the whole inventory, which covers them, once
                # the last registration is a heartbeat interval old
                self._announced, self.epoch = False, None
        pending = self._pending.pop(req_id, None)
        if pending is not None:
            w = pending[1]
            self._reply(w.ident, w.req_id, w.ok if isinstance(msg, P.OkReply) else w.failed)
        return quotas

    def _refused(self, msg: P.ErrorReply) -> None:
        """Log a refusal: each code once, then once every WARN_EVERY_S with the count."""
        now = time.monotonic()
        said, since = self._refusals.get(msg.code, (-WARN_EVERY_S, 0))
        if now - said < WARN_EVERY_S:
            self._refusals[msg.code] = (said, since + 1)
            return
        self._refusals[msg.code] = (now, 0)
        more = f" ({since} more since it was last said)" if since else ""
        log.warning("master refused a request: %s %s%s", msg.code, msg.message, more)

    def tick(self, now: float, inventory: Callable[[], list], stats: Callable[[], dict]) -> None:
        """Register when not registered, heartbeat when due, fail waiters past their time.
        ``inventory()`` and ``stats()`` are asked only when needed."""
        if self.epoch is None and now >= self._next_register:
            self._register(now, inventory())
        if now >= self._next_heartbeat:
            self._next_heartbeat = now + self.config.heartbeat_interval_s
            if now - self._last_reply > 3 * self.config.heartbeat_interval_s:
                # Lazy Pirate: a silent master may have restarted; drop queued frames (the
                # registration that follows covers them), reconnect
                self.sock.disconnect(self.config.master)
                self.sock.connect(self.config.master)
                self._last_reply = now
                self._announced, self.epoch = False, None
            self._send(P.HeartbeatRequest(self.info.node_id, stats()))
        for req_id in [r for r, (deadline, _) in self._pending.items() if deadline < now]:
            w = self._pending.pop(req_id)[1]
            log.warning("the master did not acknowledge a request in %.0fs", MASTER_TIMEOUT_S)
            self._reply(w.ident, w.req_id, w.failed)
