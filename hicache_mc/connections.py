"""How many connections a server keeps: past a cap, peers are refused at their handshake.

ZeroMQ has no per-port connection limit. With a token, every connection's CURVE handshake asks
ZAP (``auth.Guard``) whether the peer's key may in; the guard says no while the socket's
``Connections`` are full, except to the cluster's own keys (the nodes' and the admins'), so a
client credential that opens connections without end holds at most ``cap`` of them (each a
file descriptor and a few KiB) and never locks a node or an administrator out. Without a token
there is no ZAP and no cap: every peer is trusted.

What is counted is authenticated connections only, so that a flood of peers without a
credential (each dropped after ``auth.HANDSHAKE_MS``) never takes a credential holder's place.
ZeroMQ's monitor says when a connection is accepted and closed (by file descriptor) but not
whose handshake succeeded (that event carries no descriptor), so: a connection still open
``WINDOW_S`` after it was accepted has finished its handshake (ZeroMQ drops one that has not);
one younger than that is counted by its ZAP approval, which the guard notes as it gives it.
"""
from __future__ import annotations

import logging
import resource
import time
from collections import deque

import zmq
from zmq.utils.monitor import parse_monitor_message

from .link import monitor

log = logging.getLogger(__name__)

_EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED
FD_MARGIN = 1024        # descriptors beyond the cap: sockets, files, the metrics port
# a connection open this long after its accept has finished its handshake (auth.HANDSHAKE_MS,
# with a second for a loaded loop to hear of the drop)
WINDOW_S = 3.0


class Connections:
    """The authenticated connections a bound socket holds, and its cap."""

    def __init__(self, sock: zmq.Socket, cap: int):
        self.sock = sock
        self.cap = cap
        self.young: dict[int, float] = {}      # fd -> when accepted, within WINDOW_S
        self.old: set[int] = set()              # fds open longer: authenticated
        self._approved: deque[float] = deque()  # ZAP approvals within WINDOW_S (ZAP's thread)
        self.refused = 0
        self.monitor = monitor(sock, _EVENTS)
        self._quiet = 0.0
        _raise_fd_limit(cap + FD_MARGIN)

    def __len__(self) -> int:
        return len(self.old) + len(self._approved)

    def on_readable(self) -> None:
        """Apply the monitor's events (the service loop calls this)."""
        while self.monitor.poll(0):
            event = parse_monitor_message(self.monitor.recv_multipart())
            fd = event["value"]
            if event["event"] == zmq.EVENT_ACCEPTED:
                self.young[fd] = time.monotonic()
            else:
                self.young.pop(fd, None)
                self.old.discard(fd)

    def age(self, now: float) -> None:
        """Count the connections accepted over WINDOW_S ago as authenticated (each turn)."""
        while self.young:
            fd, at = next(iter(self.young.items()))     # (accepted in this order)
            if now - at < WINDOW_S:
                break
            del self.young[fd]
            self.old.add(fd)

    def admit(self) -> bool:
        """Whether one more peer may in (asked on ZAP's thread)."""
        now = time.monotonic()
        approved = self._approved
        while approved and now - approved[0] >= WINDOW_S:
            approved.popleft()
        if len(self.old) + len(approved) < self.cap:
            approved.append(now)
            return True
        self.refused += 1
        if now >= self._quiet:
            self._quiet = now + 10.0
            log.warning("refused a connection: %d are open (the cap); refusals counted in "
                        "connections_refused", self.cap)
        return False

    def close(self) -> None:
        """Before the socket closes: libzmq sends a monitor's events blocking, and one to a
        monitor socket already closed would hang the context's I/O thread."""
        if not self.sock.closed:
            self.sock.disable_monitor()
        self.monitor.close(0)


def _raise_fd_limit(want: int) -> None:
    """Lift the soft limit on open files towards ``want`` (as far as the hard limit allows):
    a cap the process cannot reach would refuse nothing before accept() failed."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as exc:
            log.warning("could not raise the open-file limit to %d: %s", target, exc)
