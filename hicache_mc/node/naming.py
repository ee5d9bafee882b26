"""A storage node's name (``node_id``): the master's key for it and the ``node`` label of its
metrics. Two live nodes must never share one (the master takes the second for a restart of the
first), and a restarted node should get its old one back, so its metric series continue.

The first that applies:

1. ``node_id``, when set.
2. ``port`` set: ``HOST:PORT``, HOST the bind address (the hostname for 0.0.0.0 or ::).
3. an SSD tier: ``HOSTNAME:SSD_FOLDER``. The folder holds what survives a restart, and one node
   at a time locks it.
4. ``HOSTNAME:DATA_DIR``, for the node that holds the lock on ``DATA_DIR/node.lock``; a second
   node with the same ``data_dir`` falls back to ``HOST:PORT`` with its random port, a new name
   at each start (logged).
"""
from __future__ import annotations

import fcntl
import logging
import os
import socket
from typing import Optional

from ..config import NodeConfig

log = logging.getLogger(__name__)

WILDCARDS = ("", "0.0.0.0", "::", "*")


def node_name(config: NodeConfig, port: int) -> tuple[str, Optional[int]]:
    """The node's name, and the descriptor of the lock that keeps it to this node (the caller
    holds it while the node runs; None when no lock is needed). ``port``: the bound port."""
    if config.node_id:
        return config.node_id, None
    hostname = socket.gethostname()
    host = hostname if config.host in WILDCARDS else config.host
    if config.port:
        return f"{host}:{config.port}", None
    if config.ssd > 0:
        return f"{hostname}:{os.path.abspath(config.ssd_dir or os.path.join(config.data_dir, 'ssd'))}", None
    folder = os.path.abspath(config.data_dir)
    fd = _lock(os.path.join(folder, "node.lock"))
    if fd is not None:
        return f"{hostname}:{folder}", fd
    log.info("another node uses %s: this one is %s:%d, a name that changes at each start (set "
             "node_id, a port or a data_dir of its own for one that lasts)", folder, host, port)
    return f"{host}:{port}", None


def advertised_host(config: NodeConfig) -> str:
    """The host part of the addresses the node publishes: ``advertise_host``, else the bind
    address, else (a wildcard bind, which no client can dial) the address of this host's
    route to the master."""
    if config.advertise_host:
        return config.advertise_host
    if config.host not in WILDCARDS:
        return config.host
    from ..transport.mooncake import route_address     # plain sockets; mooncake is not imported
    return route_address(config.master)


def _lock(path: str) -> Optional[int]:
    """An exclusive lock on ``path`` (created), or None when another process holds it or the
    folder cannot be written."""
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        log.warning("cannot lock %s (%s)", path, exc)
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return fd
    except OSError:
        os.close(fd)
        return None
