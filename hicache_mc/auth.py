"""Who may talk to a ZeroMQ port of the store: CURVE keys derived from the token, checked by ZAP.

With a token, every ZeroMQ socket of the store speaks CURVE: the master's and the nodes'
ROUTERs are CURVE servers, every peer (clients, and nodes towards the master) a CURVE client.
Both key pairs are derived from the token (BLAKE2b, one label per role), so one secret sets up
a cluster, the traffic is encrypted, and a peer without the token cannot finish the handshake:
it does not know the server's public key, and the server's ZAP handler (pyzmq's
``ThreadAuthenticator``) admits only the client key derived from the same token. ZeroMQ drops
a peer that has not finished its handshake within ``HANDSHAKE_MS``; nothing it sent reaches
the service loop, and ``MAXMSGSIZE`` caps what an admitted peer may send in one frame.

Without a token, sockets use ZeroMQ's NULL mechanism: whoever reaches the port may talk
(servers warn when they bind beyond loopback without one).

A token should be long and random (``python -c 'import secrets; print(secrets.token_hex(32))'``):
anyone who learns it, or guesses it offline, is a full member of the cluster.
"""
from __future__ import annotations

import hashlib
import hmac
import logging
from typing import NamedTuple, Optional

import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

log = logging.getLogger(__name__)

# ZeroMQ drops a connection whose ZMTP/CURVE handshake has not finished by then (default 30 s):
# an idle or stalled unauthenticated peer holds its few KiB for at most this long. A loopback
# CURVE handshake takes well under a millisecond; 2 s leaves room for a loaded host.
HANDSHAKE_MS = 2000
# ZMTP heartbeats: a peer that answers no PING for HEARTBEAT_TIMEOUT_MS is disconnected, so a
# host that vanished without closing its connections (power loss, a cut link) is noticed.
HEARTBEAT_MS = 1000
HEARTBEAT_TIMEOUT_MS = 5000
# A TCP connect that gets no answer (a host that is down) fails after this; a refused one at once.
CONNECT_TIMEOUT_MS = 1000


class KeyPair(NamedTuple):
    public: bytes       # Z85, 40 bytes
    secret: bytes


def key_pair(token: str, role: str) -> KeyPair:
    """The CURVE key pair of ``role`` ("server" or "client") for a cluster's ``token``."""
    seed = hashlib.blake2b(token.encode(), digest_size=32, person=b"hicache-mc-curve",
                           salt=role.encode()[:16]).digest()
    secret = z85.encode(seed)
    return KeyPair(zmq.curve_public(secret), secret)


def _common(sock: zmq.Socket) -> None:
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_MS)
    sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)


def secure_client(sock: zmq.Socket, token: str, max_msg: int = -1) -> zmq.Socket:
    """Set up a connecting socket (before ``connect``): CURVE client when there is a token."""
    _common(sock)
    sock.setsockopt(zmq.CONNECT_TIMEOUT, CONNECT_TIMEOUT_MS)
    sock.setsockopt(zmq.MAXMSGSIZE, max_msg)
    if token:
        server, client = key_pair(token, "server"), key_pair(token, "client")
        sock.curve_serverkey = server.public
        sock.curve_publickey, sock.curve_secretkey = client
    return sock


class Guard:
    """The server side: a ZAP handler in the service's context (with a token) and the
    options every bound socket gets. ``secure(sock)`` before ``bind``; ``stop()`` at close."""

    def __init__(self, ctx: zmq.Context, token: str):
        self.token = token
        self._auth: Optional[ThreadAuthenticator] = None
        if token:
            self._client = key_pair(token, "client").public
            self._auth = ThreadAuthenticator(ctx, log=logging.getLogger("hicache_mc.zap"))
            self._auth.start()
            self._auth.configure_curve_callback("*", credentials_provider=self)

    def callback(self, domain: str, client_key: bytes) -> bool:
        """ZAP: admit the client key derived from the token, nothing else."""
        return hmac.compare_digest(client_key, self._client)

    def secure(self, sock: zmq.Socket, max_msg: int) -> zmq.Socket:
        _common(sock)
        sock.setsockopt(zmq.MAXMSGSIZE, max_msg)
        if self.token:
            sock.curve_server = True
            sock.curve_secretkey = key_pair(self.token, "server").secret
        return sock

    def stop(self) -> None:
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
