"""Mooncake's Transfer Engine: creating engines, and the node's engine over its DRAM segment.

The only module that imports ``mooncake``, and only when a TE is wanted (the wheel is large and
needs ``libibverbs.so.1`` even for TCP).

- ``NodeEngine`` (node side): one TE per node registers the node's whole DRAM segment mapping;
  the node publishes ``te_address`` (the TE segment name), ``te_base`` (the mapping's address in
  the node process) and ``te_protocol`` in its ``NodeInfo``. The TE has no authentication, and
  its two listeners (handshake: 0.0.0.0; TCP transport: [::], dual-stack) bind every interface
  whatever address it is given: no argument or ``MC_*`` variable of the pinned version binds
  them to one (``MC_TCP_BIND_ADDRESS`` only names the address published to a metadata server).
  ``MC_MIN_RPC_PORT``/``MC_MAX_RPC_PORT`` in the environment choose their port range.
- ``SharedEngine`` (client side): one TE per process, created on first use, with the
  registrations of every client of the process; ``Staging``: a registered bounce buffer.
  The client transport over it is ``te.py``.
"""
from __future__ import annotations

import ctypes
import json
import logging
import math
import mmap
import os
import socket
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Optional

from ..errors import HicacheError

log = logging.getLogger(__name__)

INSTALL_HINT = ("install it with `pip install mooncake-transfer-engine-non-cuda` (CPU build; "
                "`mooncake-transfer-engine` on CUDA machines) and `apt-get install libibverbs1`")
TE_WORKERS = 16       # threads that may wait inside TE calls at once (a hung peer holds one)


class MooncakeUnavailable(HicacheError):
    """The mooncake package (or the libibverbs it links) is not installed."""


class TransferEngineError(HicacheError):
    """A Transfer Engine call returned a failure code, or did not finish in time."""

    def __init__(self, what: str, rc: Optional[int] = None, abandoned: bool = False):
        super().__init__(what if rc is None else f"{what}: rc={rc}")
        self.rc = rc
        self.abandoned = abandoned    # the TE call may still be running


def engine_class():
    """``mooncake.engine.TransferEngine``, or MooncakeUnavailable with the install hint."""
    try:
        from mooncake.engine import TransferEngine
    except ImportError as exc:       # also a missing libibverbs.so.1 (ImportError from dlopen)
        raise MooncakeUnavailable(f"Mooncake transfer engine not importable ({exc}); "
                                  f"{INSTALL_HINT}") from None
    return TransferEngine


def available() -> bool:
    """Whether a TE can be created in this process."""
    try:
        engine_class()
        return True
    except MooncakeUnavailable:
        return False


@contextmanager
def _env(values: dict):
    """Set environment variables only while the TE reads them (construction and initialize)."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def create_engine(hostname: str, metadata: str, protocol: str, device: str,
                  timeout_s: float = 30.0):
    """An initialised TE. ``protocol`` tcp forces TCP (``MC_FORCE_TCP``) even where HCAs exist;
    rdma refuses to start without an RDMA device (the TE would quietly fall back to TCP)."""
    cls = engine_class()
    env = {"MC_TRANSFER_TIMEOUT": os.environ.get("MC_TRANSFER_TIMEOUT") or str(max(5, math.ceil(timeout_s)))}
    if protocol == "tcp":
        env["MC_FORCE_TCP"] = "1"
    with _env(env):
        engine = cls()                      # reads MC_TRANSFER_TIMEOUT
        rc = engine.initialize(hostname, metadata, protocol, device)
    if rc != 0:
        raise TransferEngineError(f"TE initialize({hostname!r}, {metadata!r}, {protocol!r}, {device!r})", rc)
    if protocol == "rdma" and not _has_rdma_device(engine):
        raise TransferEngineError(f"te_protocol rdma: no RDMA device found (te_device={device!r}); "
                                  f"use te_protocol tcp on hosts without RDMA NICs")
    return engine


def _has_rdma_device(engine) -> bool:
    """The topology JSON maps each CPU/GPU location to [preferred HCAs, other HCAs]."""
    try:
        topo = json.loads(engine.get_local_topology())
    except (ValueError, TypeError):
        return False
    return any(hcas for lists in topo.values() for hcas in lists)


def segment_name(hostname: str, engine, metadata: str) -> str:
    """How peers address this engine: ``host:rpc_port`` under P2PHANDSHAKE."""
    return f"{hostname}:{engine.get_rpc_port()}" if metadata == "P2PHANDSHAKE" else hostname


def resolve_device(spec: str) -> str:
    """``te_device`` for this process: a NIC list as is, or the entry of a per-rank JSON map
    keyed by the local GPU index (``torch.cuda.current_device()``, else ``LOCAL_RANK``)."""
    spec = spec.strip()
    if not spec.startswith("{"):
        return spec
    try:
        table = {str(k): str(v) for k, v in json.loads(spec).items()}
    except (ValueError, AttributeError) as exc:
        raise TransferEngineError(f"te_device: not a JSON object of rank -> NIC ({exc})") from None
    rank = str(_local_rank())
    if rank not in table and "*" not in table:
        raise TransferEngineError(f"te_device: no entry for local rank {rank} (and no '*')")
    return table.get(rank, table.get("*"))


def _local_rank() -> int:
    torch = sys.modules.get("torch")    # never imported here: only used if the caller has it
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.current_device()
    return int(os.environ.get("LOCAL_RANK", "0"))


def route_address(master: str) -> str:
    """The local address of the interface that routes to the master (no packet is sent)."""
    host = master.split("://", 1)[-1].rsplit(":", 1)[0].strip("[]") or "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"


def buffer_address(buf) -> tuple[object, int]:
    """(anchor, address) of a writable buffer such as an mmap; keep the anchor while in use."""
    anchor = ctypes.c_char.from_buffer(buf)
    return anchor, ctypes.addressof(anchor)


# ------------------------------------------------------------------ node side

class NodeEngine:
    """A node's TE with its DRAM segment registered. ``close()`` unregisters and drops it."""

    def __init__(self, mm: mmap.mmap, host: str, protocol: str, device: str = "",
                 metadata: str = "P2PHANDSHAKE"):
        self.engine = create_engine(host, metadata, protocol, device)
        self._anchor, self.base = buffer_address(mm)
        self.size = len(mm)
        rc = self.engine.register_memory(self.base, self.size)
        if rc != 0:
            raise TransferEngineError(f"TE register_memory of the {self.size >> 20} MiB segment", rc)
        self.protocol = protocol
        self.address = segment_name(host, self.engine, metadata)
        log.warning("transfer engine (%s) serving the DRAM segment as %s, on every interface and "
                    "without authentication: firewall its ports (docs/operations.md, section 5)",
                    protocol, self.address)

    def close(self) -> None:
        if self.engine is None:
            return
        self.engine.unregister_memory(self.base)
        self.engine = None          # the TE's destructor closes its sockets
        self._anchor = None         # lets the segment mapping close


# ------------------------------------------------------------------ client side

class SharedEngine:
    """The client-side TE of this process for one set of settings, shared by every client.

    A TE holds threads and listening ports, and its destructor holds the GIL for ~1 s (measured
    with 0.3.13.post1), so it is created once and lives until the process ends. Registrations
    are counted, so clients registering the same memory (one host pool, two backends) share it.
    TE calls run on its worker threads (the binding releases the GIL while it waits).
    """
    _all: dict[tuple, "SharedEngine"] = {}
    _all_lock = threading.Lock()

    @classmethod
    def get(cls, hostname: str, metadata: str, protocol: str, device: str,
            timeout_s: float) -> "SharedEngine":
        key = (hostname, metadata, protocol, device)
        with cls._all_lock:
            if key not in cls._all:
                cls._all[key] = cls(hostname, metadata, protocol, device, timeout_s)
            return cls._all[key]

    def __init__(self, hostname, metadata, protocol, device, timeout_s):
        self.te = create_engine(hostname, metadata, protocol, device, timeout_s)
        self.address = segment_name(hostname, self.te, metadata)
        self.pool = ThreadPoolExecutor(TE_WORKERS, thread_name_prefix="hicache-te")
        self.opened: set[str] = set()     # segments this TE has handshaken with (see _transfer)
        self._regions: dict[int, list[int]] = {}      # start -> [size, users]
        self._lock = threading.Lock()
        log.info("mooncake transport: TE (%s) at %s", protocol, self.address)

    def register(self, ptr: int, size: int) -> None:
        with self._lock:
            entry = self._regions.get(ptr)
            if entry is not None and entry[0] == size:
                entry[1] += 1
                return
            if entry is not None:
                raise TransferEngineError(f"TE register_memory({ptr:#x}, {size}): already "
                                          f"registered with {entry[0]} bytes")
            rc = self.te.register_memory(ptr, size)
            if rc != 0:
                raise TransferEngineError(f"TE register_memory({ptr:#x}, {size})", rc)
            self._regions[ptr] = [size, 1]

    def unregister(self, ptr: int) -> None:
        with self._lock:
            entry = self._regions.get(ptr)
            if entry is None:
                return
            entry[1] -= 1
            if entry[1] == 0:
                del self._regions[ptr]
                self.te.unregister_memory(ptr)


class Staging:
    """A registered bounce buffer, used by one round at a time. ``held``: a transfer through it
    was abandoned and the engine may still use it; the engine's completion frees it."""

    def __init__(self, engine: SharedEngine, size: int):
        self.mm = mmap.mmap(-1, size)
        self._anchor, self.base = buffer_address(self.mm)
        self.size, self.engine = size, engine
        self.held = False
        engine.register(self.base, size)

    def close(self) -> None:
        self.engine.unregister(self.base)
        self._anchor = None
        self.mm.close()
