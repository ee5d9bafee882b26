"""Who may talk to the store, and as whom: credentials with a role and a tenant.

The cluster token is the root secret. The master and the nodes hold it; every other
credential is derived from it (BLAKE2b keyed by the token) and names a role and a tenant:

    node     the token itself: register, heartbeat, report commits and evictions
    admin    any tenant's keys, quotas, clearing any namespace, full cluster stats
    client   exists / get / put / clear of the keys of its own tenant only

``hicache-mc credential --role client --tenant teamA`` prints one (``hmc1:client:teamA:…``);
a client given the cluster token itself acts as admin (it could derive any credential).

With a token, every ZeroMQ socket speaks CURVE. Servers share one key pair derived from the
token; a credential carries the servers' public key and its own secret seed, from which the
peer's key pair follows. A peer's ZeroMQ routing id claims ``role:tenant:nonce``; before the
first message of a connection is decoded, the server derives the claimed credential from the
token and compares its public key with the one the peer proved in the CURVE handshake
(ZeroMQ's ``User-Id``). Without a matching claim nothing the peer sent is decoded. ZeroMQ
drops a peer whose handshake has not finished within ``HANDSHAKE_MS``, and ``MAXMSGSIZE`` caps
what one frame may hold. The stream port checks the same claim with an HMAC of its nonce.

Without a token, sockets use ZeroMQ's NULL mechanism: whoever reaches a port may do anything
(servers warn when they bind beyond loopback without one).

A token should be long and random (``python -c 'import secrets; print(secrets.token_hex(32))'``).
"""
from __future__ import annotations

import functools
import hashlib
import hmac
import logging
import os
from collections import OrderedDict
from typing import NamedTuple, Optional

import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

from .keys import check_tenant

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
ROLES = ("node", "client", "admin")
PREFIX = "hmc1"
KNOWN_MAX = 4096        # verified connections a server remembers (an evicted one is re-verified)


class KeyPair(NamedTuple):
    public: bytes       # Z85, 40 bytes
    secret: bytes


class Principal(NamedTuple):
    """Who a peer proved to be."""
    role: str           # node | client | admin
    tenant: str = ""    # a client's tenant ("" = the default tenant)


TRUSTED = Principal("admin")    # every peer of a store without a token (any role: no checks)


class Credential(NamedTuple):
    role: str
    tenant: str
    seed: bytes         # 32 secret bytes: the peer's CURVE secret key and stream HMAC key
    server: bytes       # Z85 public key of the cluster's servers

    @property
    def principal(self) -> Principal:
        return Principal(self.role, self.tenant)

    @property
    def claim(self) -> bytes:
        return f"{self.role}:{self.tenant}".encode()

    def keys(self) -> KeyPair:
        secret = z85.encode(self.seed)
        return KeyPair(zmq.curve_public(secret), secret)

    def text(self) -> str:
        return ":".join((PREFIX, self.role, self.tenant, self.seed.hex(), z85.decode(self.server).hex()))

    def __repr__(self) -> str:     # never the seed: credentials end up in logs and tracebacks
        return f"Credential({self.role}:{self.tenant})"


def key_pair(token: str, role: str) -> KeyPair:
    """The CURVE key pair of ``role`` ("server") for a cluster's ``token``."""
    seed = hashlib.blake2b(token.encode(), digest_size=32, person=b"hicache-mc-curve",
                           salt=role.encode()[:16]).digest()
    secret = z85.encode(seed)
    return KeyPair(zmq.curve_public(secret), secret)


def _seed(token: str, role: str, tenant: str) -> bytes:
    root = hashlib.blake2b(token.encode(), digest_size=32, person=b"hicache-mc-root").digest()
    return hashlib.blake2b(f"{role}:{tenant}".encode(), key=root, digest_size=32,
                           person=b"hicache-mc-peer").digest()


def issue(token: str, role: str, tenant: str = "") -> Credential:
    """The credential of ``role`` (and ``tenant``, for clients) in the cluster of ``token``."""
    if role not in ROLES:
        raise ValueError(f"role {role!r}: expected one of {', '.join(ROLES)}")
    if tenant and role != "client":
        raise ValueError("only a client credential names a tenant")
    check_tenant(tenant)
    return Credential(role, tenant, _seed(token, role, tenant), key_pair(token, "server").public)


@functools.lru_cache(maxsize=16)     # every channel of a client asks; the root one costs ~0.1 ms
def credential(secret: str) -> Optional[Credential]:
    """What a peer's ``token`` setting holds: a credential (``hmc1:…``) as issued, or the
    cluster token (which acts as admin), or "" (None: no authentication)."""
    if not secret:
        return None
    if not secret.startswith(PREFIX + ":"):
        return issue(secret, "admin")
    parts = secret.split(":")
    try:
        if len(parts) != 5 or parts[1] not in ROLES:
            raise ValueError
        seed, server = bytes.fromhex(parts[3]), bytes.fromhex(parts[4])
        if len(seed) != 32 or len(server) != 32:
            raise ValueError
        check_tenant(parts[2])
    except ValueError:
        raise ValueError("credential: not one that 'hicache-mc credential' prints") from None
    return Credential(parts[1], parts[2], seed, z85.encode(server))


def tenant_for(secret: str, tenant: str) -> str:
    """The tenant a peer's keys must name: a client credential's own (``tenant``, when given,
    must be the same); anyone else's keys may name ``tenant``."""
    cred = credential(secret)
    if cred is None or cred.role != "client":
        return tenant
    if tenant and tenant != cred.tenant:
        raise ValueError(f"tenant {tenant!r}: the credential is tenant {cred.tenant!r}'s")
    return cred.tenant


def _common(sock: zmq.Socket) -> None:
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_MS)
    sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)


def secure_client(sock: zmq.Socket, cred: Optional[Credential], max_msg: int = -1) -> zmq.Socket:
    """Set up a connecting socket (before ``connect``): CURVE client with a credential, and a
    routing id that claims it."""
    _common(sock)
    sock.setsockopt(zmq.CONNECT_TIMEOUT, CONNECT_TIMEOUT_MS)
    sock.setsockopt(zmq.MAXMSGSIZE, max_msg)
    if cred is not None:
        sock.curve_serverkey = cred.server
        sock.curve_publickey, sock.curve_secretkey = cred.keys()
        sock.setsockopt(zmq.ROUTING_ID, cred.claim + b":" + os.urandom(8).hex().encode())
    return sock


def parse_claim(claim: bytes) -> Optional[Principal]:
    """``role:tenant`` as a principal, or None when it is not one."""
    role, sep, tenant = claim.partition(b":")
    try:
        p = Principal(role.decode("ascii"), check_tenant(tenant.decode("ascii")))
    except (UnicodeDecodeError, ValueError):
        return None
    return p if sep and p.role in ROLES and (not p.tenant or p.role == "client") else None


class Guard:
    """The server side: CURVE on every bound socket (``secure(sock)`` before ``bind``) and the
    check of each connection's claim (``principal``); ``stop()`` at close."""

    def __init__(self, ctx: zmq.Context, token: str):
        self.token = token
        self._auth: Optional[ThreadAuthenticator] = None
        self._known: OrderedDict[bytes, tuple[Optional[str], Principal]] = OrderedDict()
        # CURVE key (Z85) -> the principal a connection proved with it on this server's ROUTER
        self._keys: OrderedDict[str, Principal] = OrderedDict()
        self._caps: dict[str, object] = {}     # ZAP domain -> its sockets' Connections
        self._root: set[bytes] = set()          # the nodes' and admins' keys: never capped
        if token:
            # ZAP makes ZeroMQ tell us each peer's key (User-Id): a peer that completed the
            # handshake knows the servers' public key, and principal() checks its claim; and
            # it asks callback() whether one more connection may in
            self._root = {issue(token, role).keys().public for role in ("node", "admin")}
            self._auth = ThreadAuthenticator(ctx, log=logging.getLogger("hicache_mc.zap"))
            self._auth.start()
            self._auth.configure_curve_callback(domain="*", credentials_provider=self)

    def secure(self, sock: zmq.Socket, max_msg: int, domain: str = "*") -> zmq.Socket:
        """Set up a bound socket (before ``bind``); its connections count against the cap of
        ZAP ``domain`` (see ``cap``)."""
        _common(sock)
        sock.setsockopt(zmq.MAXMSGSIZE, max_msg)
        if self.token:
            sock.curve_server = True
            sock.curve_secretkey = key_pair(self.token, "server").secret
            if domain != "*":
                sock.zap_domain = domain.encode()
                self._auth.configure_curve_callback(domain=domain, credentials_provider=self)
        return sock

    def cap(self, domain: str, connections) -> None:
        """Refuse handshakes on the sockets of ``domain`` while ``connections.admit()`` says no
        (connections.py), but for the nodes' and admins' keys."""
        self._caps[domain] = connections

    def callback(self, domain: str, key: bytes) -> bool:
        """ZAP (its thread): may a peer proving ``key`` (Z85) open one more connection?"""
        if key in self._root:
            return True
        conns = self._caps.get(domain)
        return conns is None or conns.admit()

    def principal(self, ident: bytes, frame: zmq.Frame) -> Optional[Principal]:
        """Who sent ``frame`` on the connection ``ident``: the principal its routing id claims,
        when the claim's key is the one the peer proved; None otherwise."""
        if not self.token:
            return TRUSTED
        user = frame.get("User-Id")     # Z85 of the key the peer proved in the handshake
        known = self._known.get(ident)
        if known is not None and known[0] == user:
            return known[1]
        claim, _, _nonce = ident.rpartition(b":")
        p = parse_claim(claim)
        if p is None or user is None:
            return None
        expected = Credential(p.role, p.tenant, _seed(self.token, p.role, p.tenant), b"").keys().public
        if not hmac.compare_digest(expected, user.encode()):
            return None
        self._known[ident] = (user, p)
        self._keys[user] = p
        self._keys.move_to_end(user)
        if len(self._known) > KNOWN_MAX:
            self._known.popitem(last=False)
        if len(self._keys) > KNOWN_MAX:
            self._keys.popitem(last=False)
        return p

    def known(self, ident: bytes) -> Optional[Principal]:
        """The principal the connection ``ident`` proved (None: none yet, or forgotten)."""
        known = self._known.get(ident)
        return None if known is None else known[1]

    def verified(self, user: Optional[str]) -> Optional[Principal]:
        """The principal that the CURVE key ``user`` proved in a request on this server's ROUTER
        (a lookup: nothing is derived for a key never seen there), or None."""
        if not self.token:
            return TRUSTED
        return self._keys.get(user) if user else None

    def stream_key(self, claim: bytes) -> Optional[tuple[Principal, bytes]]:
        """The principal a stream-port peer claims and the key its answer must be made with."""
        if not self.token:      # no authentication: every peer is trusted, whatever it claims
            return TRUSTED, b""
        p = parse_claim(claim)
        if p is None:
            return None
        return p, _seed(self.token, p.role, p.tenant)

    def stop(self) -> None:
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
