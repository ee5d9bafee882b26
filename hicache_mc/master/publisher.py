"""The master's residency publisher: every change of its key index, per namespace, on an XPUB.

A client keeps a view of the namespaces it uses (client/view.py) after the ZeroMQ guide's Clone
pattern: it subscribes, asks the master for a snapshot (``SnapshotRequest`` on the ROUTER),
then applies the numbered updates that follow it; a gap in the numbers, another master epoch or
a silent topic sends it back for a new snapshot.

Cost to the master: the index journals each change (``KeyIndex.journal``); once a loop turn the
publisher sends one message per changed namespace (in chunks of ``residency.CHUNK`` digests)
and, every ``beat_s``, a beat per subscribed namespace. The keys themselves (topic
``<namespace>#``, for the KV-event bridge) are journalled and sent only for namespaces someone
follows that way. Sends never block: past ``SNDHWM``
queued messages ZeroMQ drops a slow subscriber's messages, which it notices as a gap.

Authorization per topic: the socket is an XPUB with ``XPUB_MANUAL``, so a subscription takes
effect only when the publisher passes it on. With a token it does so when the subscriber's
CURVE key (the message's ``User-Id``) is one a connection proved on the master's ROUTER
(``Guard.verified``: a subscriber asks for its snapshot there first) as an admin or a client of
the namespace's tenant; other subscriptions are dropped (counted), for the price of a dict
lookup, so a flood of them costs no key derivation. Without a token every peer is trusted.
"""
from __future__ import annotations

import logging
import time
from collections import OrderedDict
from typing import Callable, Optional

import zmq

from .. import protocol as P, residency as R
from ..auth import Guard, Principal
from ..connections import Connections
from ..keys import tenant_of

log = logging.getLogger(__name__)

SNDHWM = 10000           # messages queued per subscriber before ZeroMQ drops its messages
MAX_TOPICS = 4096        # namespaces beaten (the most recently subscribed)
MAX_SNAPSHOT_KEYS = 1 << 20
# subscription messages read per loop turn: each costs a dict lookup (~2 us), so a flood costs
# the loop ~20 ms a turn at most and is read as fast as it comes
MAX_SUBSCRIPTIONS_PER_TURN = 10000
KEY_CHUNK_BYTES = 8 << 20    # key text per KeyUpdate: well under a subscriber's MAXMSGSIZE
# what a subscriber may send in one message (MAXMSGSIZE): a subscription is < residency.MAX_TOPIC
# bytes, but the CURVE handshake's messages (~300 bytes with their metadata) pass the same limit
MAX_INBOUND = 4096   # 16 MiB of digests: a reply must fit limits.MAX_HEADER_BYTES


def may_follow(principal: Optional[Principal], namespace: str) -> bool:
    """Whether ``principal`` may follow ``namespace``: an admin (or anyone, without a token),
    or a client of the namespace's tenant."""
    if principal is None:
        return False
    if principal.role == "admin":
        return True
    return principal.role == "client" and principal.tenant == tenant_of(namespace + "/")


def _user(frame: zmq.Frame) -> str:
    """The CURVE key the subscriber proved (Z85), "" when ZeroMQ has none for it."""
    try:
        return frame.get("User-Id") or ""
    except zmq.ZMQError:
        return ""


class Publisher:
    """The XPUB of one master; ``flush(journal, nodes)`` once a loop turn."""

    def __init__(self, ctx: zmq.Context, guard: Guard, host: str, port: int, epoch: str,
                 beat_s: float, max_connections: int = 4096,
                 size: Callable[[str], int] = lambda ns: 0):
        self.sock = guard.secure(ctx.socket(zmq.XPUB), MAX_INBOUND, "residency")
        self.connections = Connections(self.sock, max_connections)
        guard.cap("residency", self.connections)
        self.sock.setsockopt(zmq.XPUB_MANUAL, 1)
        self.sock.setsockopt(zmq.SNDHWM, SNDHWM)
        try:
            if port == 0:
                self.port = self.sock.bind_to_random_port(f"tcp://{host}")
            else:
                self.sock.bind(f"tcp://{host}:{port}")
                self.port = port
        except zmq.ZMQError:
            self.connections.close()
            self.sock.close(0)
            raise
        self.guard = guard
        self._quiet = 0.0       # no refusal logged before this (monotonic): a flood stays readable
        self.epoch = epoch
        self.beat_s = beat_s
        self.size = size                        # keys the index holds in a namespace
        self.seq: dict[str, int] = {}           # namespace -> its last update number
        # The number a namespace without an entry in seq is at. A namespace with no keys and no
        # subscriber is forgotten (its entry would outlive it: one per namespace ever used), and
        # its numbers go on above every number ever given out, so a view that took a snapshot
        # before that sees the next update follow on or leave a gap, never repeat a number.
        self.floor = 0
        self._dropped = 0       # namespaces forgotten since seq was last rebuilt
        self.topics: OrderedDict[str, None] = OrderedDict()  # subscribed namespaces (beats)
        # namespaces whose keys someone follows (an event bridge) ...
        self.key_topics: OrderedDict[str, None] = OrderedDict()
        self.key_seq: dict[str, int] = {}
        self.key_floor = 0      # as floor, for key_seq
        self.key_spaces: set[str] = set()   # ... shared with KeyIndex.key_spaces: it journals them
        self.counters = {"residency_updates": 0, "residency_beats": 0, "residency_dropped": 0,
                         "residency_refused": 0, "residency_subscriptions": 0}
        self._next_beat = 0.0

    def on_readable(self) -> None:
        """Subscriptions: pass on those the subscriber may have (see the module docstring)."""
        for _ in range(MAX_SUBSCRIPTIONS_PER_TURN):
            try:
                frame = self.sock.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            data = frame.bytes
            if not data or data[0] not in (0, 1):
                continue
            named = R.namespace_of_topic(data[1:])
            if named is None:
                self.counters["residency_refused"] += 1
                continue
            ns, keys = named
            if data[0] == 0:        # (the subscriber's own pipe: it only ever had its own)
                self.sock.setsockopt(zmq.UNSUBSCRIBE, data[1:])
                continue
            if not may_follow(self.guard.verified(_user(frame) if self.guard.token else ""), ns):
                self.counters["residency_refused"] += 1
                now = time.monotonic()
                if now >= self._quiet:
                    self._quiet = now + 10.0
                    log.warning("refused a residency subscription to namespace %r (not the "
                                "subscriber's tenant, or no request of its key on the master's "
                                "port yet); refusals counted in residency_refused", ns[:80])
                continue
            # applies to the pipe of the message just received (XPUB_MANUAL)
            self.sock.setsockopt(zmq.SUBSCRIBE, data[1:])
            self.counters["residency_subscriptions"] += 1
            topics = self.key_topics if keys else self.topics
            topics[ns] = None
            topics.move_to_end(ns)
            if len(topics) > MAX_TOPICS:
                self._unfollowed(topics.popitem(last=False)[0], keys)
            if keys:
                self.key_spaces.clear()
                self.key_spaces.update(self.key_topics)

    def close(self) -> None:
        self.connections.close()
        self.sock.close(0)

    def snapshot(self, ns: str, index, marks: dict) -> P.Message:
        """A view's start: the namespace's digests and last update number, with the nodes'
        applied reports (``marks``), all as of now. Refused for a namespace no subscription
        could name (the view would ask again and again) and past MAX_SNAPSHOT_KEYS."""
        if R.namespace_of_topic(R.topic(ns)) is None:
            return P.ErrorReply("bad_request", "Snapshot: not a namespace a subscription can "
                                "name (ASCII, no '/' or '#', at most "
                                f"{R.MAX_TOPIC - 1} characters)")
        if index.namespace_size(ns) > MAX_SNAPSHOT_KEYS:
            return P.ErrorReply("too_large", f"namespace holds over {MAX_SNAPSHOT_KEYS} keys")
        return P.SnapshotReply(self.epoch, self.seq.get(ns, self.floor), index.digests(ns), marks,
                               self.port, self.beat_s)

    def _send(self, ns: str, update) -> None:
        topic = R.key_topic(ns) if isinstance(update, R.KeyUpdate) else R.topic(ns)
        try:
            self.sock.send_multipart([topic, R.encode(update)], zmq.NOBLOCK)
        except zmq.Again:   # (an XPUB drops rather than blocks; NOBLOCK makes sure)
            self.counters["residency_dropped"] += 1

    def flush(self, journal: dict, nodes: Callable[[], dict], moved: dict, now: float,
              key_journal: Optional[dict] = None) -> None:
        """Send the turn's changes (``journal``: namespace -> {digest: present}; emptied) with
        the nodes whose reports moved (``moved``), the keys of the followed namespaces
        (``key_journal``: namespace -> {key: present}; emptied), and the beats that are due."""
        for ns, changes in (key_journal or {}).items():
            for part in _key_chunks(list(changes.items())):
                seq = self.key_seq[ns] = self.key_seq.get(ns, self.key_floor) + 1
                self._send(ns, R.KeyUpdate(self.epoch, seq, [k for k, p in part if p],
                                           [k for k, p in part if not p]))
        if key_journal:
            key_journal.clear()
        for ns, changes in journal.items():
            items = list(changes.items())
            for i in range(0, len(items), R.CHUNK):
                part = items[i:i + R.CHUNK]
                seq = self.seq[ns] = self.seq.get(ns, self.floor) + 1
                # the report marks go with the last chunk only: a view that has applied an
                # earlier one has not yet seen every key of the reports they name
                last = i + R.CHUNK >= len(items)
                self._send(ns, R.Update(self.epoch, seq,
                                        b"".join(d for d, present in part if present),
                                        b"".join(d for d, present in part if not present),
                                        moved if last else {}))
                self.counters["residency_updates"] += 1
            self._prune(ns)
        journal.clear()
        if now >= self._next_beat and self.topics:
            self._next_beat = now + self.beat_s
            every = nodes()
            for ns in self.topics:
                self._send(ns, R.Update(self.epoch, self.seq.get(ns, self.floor), b"", b"", every, True))
                self.counters["residency_beats"] += 1
            for ns in self.key_topics:
                self._send(ns, R.KeyUpdate(self.epoch, self.key_seq.get(ns, self.key_floor), [], [], True))

    def _prune(self, ns: str) -> None:
        """Forget the numbering of a namespace with no keys that nobody follows (see floor)."""
        if ns in self.seq and ns not in self.topics and not self.size(ns):
            self.floor = max(self.floor, self.seq.pop(ns))
            self._dropped += 1
            if self._dropped > len(self.seq):   # a dict's table never shrinks: rebuild it
                self.seq, self._dropped = dict(self.seq), 0

    def _unfollowed(self, ns: str, keys: bool) -> None:
        """A namespace no longer beaten (MAX_TOPICS newer ones are): forget what it needs no more."""
        if keys:
            if ns in self.key_seq:     # (at most MAX_TOPICS are followed at once)
                self.key_floor = max(self.key_floor, self.key_seq.pop(ns))
        else:
            self._prune(ns)

    @property
    def namespaces(self) -> int:
        """Namespaces whose numbering the publisher keeps."""
        return len(self.seq) + len(self.key_seq)


def _key_chunks(items: list) -> list:
    """``(key, present)`` items cut into runs of at most ``residency.CHUNK`` keys and
    ``KEY_CHUNK_BYTES`` of key text (keys of up to MAX_KEY_BYTES would make a run of CHUNK
    keys larger than a subscriber accepts)."""
    out, start, size = [], 0, 0
    for i, (key, _) in enumerate(items):
        if i > start and (i - start >= R.CHUNK or size + len(key) > KEY_CHUNK_BYTES):
            out.append(items[start:i])
            start, size = i, 0
        size += len(key)
    if start < len(items):
        out.append(items[start:])
    return out
