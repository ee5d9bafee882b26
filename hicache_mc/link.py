"""Why a connection is down, from ZeroMQ's monitor events: a dead peer is not a wrong token.

Every connecting socket (a client's channel, a node's link to its master, a residency view's or
KV-event bridge's subscription) watches its monitor through a ``Link``. The events of one
connection attempt, measured with pyzmq 27 / libzmq 4.3 on loopback:

    nothing listens                   CONNECT_DELAYED, CLOSED
    the server has a token and this   CONNECTED, HANDSHAKE_FAILED_PROTOCOL (mechanism mismatch)
      side none, or the reverse         or HANDSHAKE_FAILED_NO_DETAIL (EPIPE: the server closed
                                        first; 7 of 8 runs for a client with a token), DISCONNECTED
    another cluster's token or        CONNECTED, HANDSHAKE_FAILED_NO_DETAIL (EPIPE), DISCONNECTED
      credential                        (the server cannot open the CURVE hello and closes)
    the token is right                CONNECTED, HANDSHAKE_SUCCEEDED
    the server's connections are      CONNECTED, HANDSHAKE_FAILED_AUTH (its ZAP said no: the only
      at their cap                      thing it refuses there, connections.py), DISCONNECTED
    the peer exits later              DISCONNECTED

so ``Link.down()`` names the cause in one line (``Down``): a refused connection, a lost one, a
token missing on one side, a token or credential of another cluster, or a handshake cut short
(something that is not a hicache-mc port, or a forwarder in the way).
"""
from __future__ import annotations

import enum
import errno
import itertools
import logging
import os
import select
import socket
import time
from typing import Optional

import zmq
from zmq.utils.monitor import parse_monitor_message

log = logging.getLogger(__name__)
_ids = itertools.count(1)
WARN_EVERY_S = 60.0     # a cause that persists is logged again this often

EVENTS = (zmq.EVENT_CONNECTED | zmq.EVENT_CLOSED | zmq.EVENT_DISCONNECTED |
          zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL |
          zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH)


class Down(enum.Enum):
    """Why a connection is down. ``misconfigured`` ones will not mend by retrying."""
    REFUSED = "connection refused or timed out (is it running, and is the port open to this host?)"
    LOST = "connection lost"
    NO_TOKEN = ("it requires a token and this process has none (set token: HICACHE_MC_TOKEN, "
                "--token-file, or a credential from 'hicache-mc credential')")
    UNEXPECTED_TOKEN = ("it runs without a token and this process has one (give it the same "
                        "token, or drop this process's)")
    WRONG_TOKEN = ("it refused this process's token or credential: a wrong token, a credential "
                   "issued from another cluster's token, or a server that runs without a token")
    CUT = ("the connection closed during the handshake (not a hicache-mc port, or a forwarder "
           "that does not pass ZeroMQ through)")
    FULL = "it holds as many connections as it keeps (its max_connections); try again later"

    @property
    def misconfigured(self) -> bool:
        return self in (Down.NO_TOKEN, Down.UNEXPECTED_TOKEN, Down.WRONG_TOKEN, Down.CUT)


def monitor(sock: zmq.Socket, events: int) -> zmq.Socket:
    """A PAIR receiving ``sock``'s ``events``, named uniquely: pyzmq names it by ``sock.FD``, which
    a new socket of the shared context reuses while a collected one's name is still bound."""
    return sock.get_monitor_socket(events, f"inproc://hicache-mc-monitor-{next(_ids)}")


class Link:
    """The monitor of one connecting socket, read for why its connection is down. Create it
    before ``connect``; read it from the socket's thread; ``close`` before closing the socket."""

    def __init__(self, sock: zmq.Socket, has_credential: bool):
        self.sock = sock
        self.events = monitor(sock, EVENTS)
        self.has_credential = has_credential
        self.up = False             # the last connection finished its handshake
        self.last: Optional[Down] = None    # why the last connection went down (sticky)
        self._connected = False     # a TCP connection is open, its handshake not done
        self._said: tuple[Optional[Down], float] = (None, 0.0)     # (cause logged, when)

    def down(self) -> Optional[Down]:
        """Read the events so far: why the connection is down now, or None while it may be up
        (connecting, or connected). Each event that ends a connection is reported once."""
        found = None
        while self.events.poll(0):
            event = parse_monitor_message(self.events.recv_multipart())
            why = self._apply(event["event"], event["value"])
            if why is not None:
                self.last = why
                found = found or why
        return found

    @property
    def problem(self) -> str:
        """Why the connection is down, "" while its last handshake stands (or none failed yet)."""
        return "" if self.up or self.last is None else self.last.value

    def check(self, what: str) -> Optional[Down]:
        """``down()``, logging a cause as ``what`` (e.g. "the master at tcp://...") sees it: a
        misconfiguration as an error, the rest as warnings; each cause once, and again every
        WARN_EVERY_S while it persists (a socket that reconnects by itself fails every 100 ms)."""
        why = self.down()
        if why is None:
            return None
        now = time.monotonic()
        said, at = self._said
        if why is not said or now - at >= WARN_EVERY_S:
            self._said = (why, now)
            log.log(logging.ERROR if why.misconfigured else logging.WARNING,
                    "cannot reach %s: %s", what, why.value)
        return why

    def _apply(self, event: int, value: int) -> Optional[Down]:
        if event == zmq.EVENT_CONNECTED:
            self._connected = True
            return None
        if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self.up, self._connected = True, False
            return None
        if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and \
                value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
            return self._end(Down.UNEXPECTED_TOKEN if self.has_credential else Down.NO_TOKEN)
        if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            return self._end(Down.FULL)
        if event in (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL):
            # without a credential the only handshake a hicache-mc server fails is CURVE's
            return self._end(Down.WRONG_TOKEN if self.has_credential else Down.NO_TOKEN)
        if event == zmq.EVENT_CLOSED:
            return self._end(Down.REFUSED)
        if event == zmq.EVENT_DISCONNECTED:
            if self.last is not None and not self.up and not self._connected:
                return None     # the disconnect that follows a failed handshake: said already
            return self._end(Down.LOST if self.up else Down.CUT)
        return None

    def _end(self, why: Down) -> Down:
        self.up = self._connected = False
        return why

    def close(self) -> None:
        self.sock.disable_monitor()
        self.events.close(0)


def reach(sock: zmq.Socket, address: str, has_credential: bool, timeout_s: float) -> Optional[Down]:
    """Connect ``sock`` (set up by ``auth.secure_client``) to ``address`` and wait for the
    handshake: None once it succeeded, or why not (a connection that neither succeeds nor
    fails in ``timeout_s`` is REFUSED: a firewall that drops it). ``sock`` is closed."""
    link = Link(sock, has_credential)
    try:
        sock.connect(address)
        end = time.monotonic() + timeout_s
        while True:
            left = end - time.monotonic()
            if left <= 0:
                return Down.REFUSED
            if link.events.poll(int(left * 1000) + 1):
                why = link.down()
                if why is not None:
                    return why
                if link.up:
                    return None
    finally:
        link.close()
        sock.close(0)


PROBE_EVERY_S = 10.0    # a service's own port is probed this often (a connection it accepts)
PROBE_WAIT_S = 2.0      # a connect not answered by then: dropped on the way (a firewall)


def local_address(host: str) -> str:
    """The address a process dials to reach its own port bound to ``host``."""
    return {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)


class PortProbe:
    """Whether a TCP port accepts connections, for a service loop that must not block: each
    ``problem()`` finishes the non-blocking connect the last one started, and starts another
    every PROBE_EVERY_S."""

    def __init__(self, host: str, port: int):
        self.address = (host, port)
        self._sock: Optional[socket.socket] = None
        self._started = 0.0
        self._next = 0.0
        self._last = ""

    def problem(self) -> str:
        """"" while the port took the last connection; else why not."""
        now = time.monotonic()
        if self._sock is not None:
            if select.select([], [self._sock], [], 0)[1]:
                err = self._sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                self._done("" if err == 0 else os.strerror(err))
            elif now - self._started > PROBE_WAIT_S:
                self._done(f"no answer in {PROBE_WAIT_S:g} s")
        if self._sock is None and now >= self._next:
            self._next, self._started = now + PROBE_EVERY_S, now
            family = socket.AF_INET6 if ":" in self.address[0] else socket.AF_INET
            self._sock = socket.socket(family, socket.SOCK_STREAM)
            self._sock.setblocking(False)
            err = self._sock.connect_ex(self.address)
            if err not in (0, errno.EINPROGRESS):
                self._done(os.strerror(err))
        return self._last

    def _done(self, problem: str) -> None:
        self._sock.close()
        self._sock = None
        self._last = problem

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
