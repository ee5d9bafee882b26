"""StoreClient: batch exists / get / put against a hicache-mc cluster (lookups: lookups.py,
puts: writes.py).

Thread-safe: each thread gets its own sockets (ZeroMQ sockets are not thread-safe); the
transports, the node table and the counters are shared. Every call runs under one deadline.
Store failures never raise: they are misses (get/exists) or False (put). After
``circuit_failures`` failures in a row a circuit opens and calls answer misses at once for
``circuit_open_s``; the next call after that is a probe, and a success closes the circuit. The
master has one circuit and each node its own: a dead node costs the objects it holds or was
to take, never the rest of a call.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from typing import NamedTuple, Optional, Sequence

import numpy as np
import zmq

from .. import protocol as P
from ..config import ClientConfig, load_config
from ..errors import HicacheError, RemoteError
from ..rpc import Channel
from ..transport.base import Transport
from ..transport.te import MooncakeTransport
from ..transport.shm import ShmTransport, host_identity
from ..transport.tcp import TcpTransport
from .batch import check_batch
from .circuit import Circuit, NodeCircuits
from .fences import Fences
from .locations import Locations
from .rounds import ChecksumCounter, NodeRounds
from .view import ResidencyView
from .lookups import LookupPath
from .writes import Copied, Failed, WritePath

log = logging.getLogger(__name__)

class Reach(NamedTuple):
    """What a client finds at its master (``StoreClient.check``)."""
    nodes: int      # live storage nodes; -1 when the master did not answer
    why: str        # "" when it answered; else the cause, in one line


class OnNode(NamedTuple):
    """A call's share on one node."""
    ok: list[bool]      # per object: read (written)
    failed: bool        # the node failed, or its circuit is open: not a plain miss


class StoreClient(LookupPath, WritePath):
    """A client of one hicache-mc cluster. ``StoreClient(master=..., **ClientConfig fields)``."""

    def __init__(self, master: Optional[str] = None, *, config: Optional[ClientConfig] = None,
                 config_file: Optional[str] = None, **options):
        self.config = config or load_config(ClientConfig, file=config_file, section="client",
                                            master=master, **options)
        # the process's shared context, never terminated here: a client dropped without close()
        # is cyclic garbage, and a context of its own collected with its sockets would wait in
        # term() for sockets whose finalizers have not run yet, blocking the collector for good
        self.ctx = zmq.Context.instance()
        self._local = threading.local()
        self._channels: list[Channel] = []
        self._channels_lock = threading.Lock()
        self._nodes: dict[str, P.NodeInfo] = {}
        self._node_records: dict[str, dict] = {}
        self._where = Locations()       # from Exists, for the get that follows
        self.host = host_identity()
        self.checks = ChecksumCounter()
        verify = self.config.verify_checksums
        self.rounds = NodeRounds(self.checks, verify)      # lease / reserve / commit around a copy
        self.tcp = TcpTransport(verify, token=self.config.token)
        self.shm = ShmTransport(verify)
        cfg = self.config
        self.te = MooncakeTransport(verify, master=cfg.master, protocol=cfg.te_protocol,
                                    device=cfg.te_device, metadata=cfg.te_metadata,
                                    hostname=cfg.te_hostname, staging_bytes=cfg.te_staging,
                                    timeout_s=cfg.timeout_s)
        self.fences = Fences()          # read-your-writes (client/fences.py)
        self._warned: set[str] = set()
        self.circuit = Circuit(self.config.circuit_failures, self.config.circuit_open_s,
                               "the master")
        self.node_circuits = NodeCircuits(self.config.circuit_failures, self.config.circuit_open_s)
        self.counters = defaultdict(int)
        self.copied = Copied()      # keys whose copies this client asked for (replicate_reads)
        # "auto" is on where the SGLang backend asks for it (it replaces the setting)
        self.view = ResidencyView(self.ctx, cfg.master, cfg.token, cfg.timeout_s) \
            if cfg.view == "on" else None
        self._closed = False

    # -------------------------------------------------------------- plumbing

    def _channel(self, address: str) -> Channel:
        """This thread's channel to ``address`` (ZeroMQ sockets are not thread-safe)."""
        chans = getattr(self._local, "chans", None)
        if chans is None:
            chans = self._local.chans = {}
        ch = chans.get(address)
        if ch is None:
            ch = chans[address] = Channel(self.ctx, address, self.config.token)
            with self._channels_lock:
                self._channels.append(ch)
        return ch

    def _master(self, msg: P.Message, deadline: float) -> P.Message:
        ch = self._channel(self.config.master)
        return P.raise_if_error(ch.recv(ch.send(msg), deadline))

    def _deadline(self) -> float:
        return time.monotonic() + self.config.timeout_s

    def _learn(self, nodes: dict) -> None:
        for node_id, d in nodes.items():
            if self._node_records.get(node_id) != d:   # decode (and type-check) a record once
                self._nodes[node_id] = P.NodeInfo.from_dict(d)
                self._node_records[node_id] = d

    def transport_for(self, node: P.NodeInfo) -> Transport:
        """auto: shm for a node on this host whose segment maps, mooncake for a remote node that
        publishes a TE address, else tcp. shm / mooncake as configured, tcp where they can't."""
        mode = self.config.transport
        if mode in ("auto", "shm") and node.host == self.host and self.shm.segment(node):
            return self.shm
        if mode == "mooncake" or (mode == "auto" and node.te_address and node.host != self.host):
            if self.te.usable(node):
                return self.te
            if mode == "mooncake" and not node.te_address:
                self._warn_once("te:" + node.node_id, "transport=mooncake but node %s runs no "
                                "transfer engine (start it with te_protocol); using tcp", node.node_id)
        elif mode == "shm":
            self._warn_once("shm", "transport=shm but node %s is not mappable from here; using tcp",
                            node.node_id)
        return self.tcp

    def _warn_once(self, what: str, fmt: str, *args) -> None:
        if what not in self._warned:
            self._warned.add(what)
            log.warning(fmt, *args)

    # -------------------------------------------------------------- registered memory

    def register_buffer(self, ptr: int, size: int) -> bool:
        """Register caller memory (e.g. SGLang's host pool) with transports that need it (the
        Mooncake TE: one-sided transfers straight into it instead of via a staging buffer).
        True when registered (or kept for a TE created later); False with a log line when not."""
        if not isinstance(ptr, (int, np.integer)) or ptr <= 0 or size <= 0:
            raise ValueError(f"bad pointer/size pair ({ptr!r}, {size!r})")
        if self.config.transport not in ("auto", "mooncake"):
            return False
        try:
            self.te.register_buffer(int(ptr), int(size), eager=self.config.transport == "mooncake")
            return True
        except HicacheError as exc:
            self._warn_once("register", "register_buffer: %s; transfers will go through tcp or "
                            "a staging buffer", exc)
            return False

    def unregister_buffer(self, ptr: int) -> None:
        """Undo ``register_buffer`` (before the memory is freed)."""
        self.te.unregister_buffer(int(ptr))

    def _guard(self, fn, miss):
        """Run ``fn`` unless the circuit is open; failures become ``miss``."""
        if self._closed:
            raise HicacheError("StoreClient is closed")
        if not self.circuit.allow():
            self.counters["circuit_rejects"] += 1
            return miss
        try:
            result = fn()
        except RemoteError as exc:
            if exc.code != "forbidden":
                self.counters["errors"] += 1
                self.circuit.fail(exc)
                return miss
            # the store is fine: this call named keys outside this client's tenant
            self.counters["forbidden"] += 1
            if self.counters["forbidden"] == 1:
                log.warning("the store refused a call: %s", exc.message)
            return miss
        except (HicacheError, zmq.ZMQError, OSError) as exc:
            self.counters["errors"] += 1
            self.circuit.fail(exc)
            return miss
        except Exception as exc:   # a reply this client cannot interpret (e.g. another version)
            log.exception("unexpected store reply; treated as a store failure")
            self.counters["errors"] += 1
            self.circuit.fail(exc)
            return miss
        self.circuit.ok()
        return result

    # -------------------------------------------------------------- batch API

    def batch_get_into(self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int]) -> list[bool]:
        """Copy each object into ``ptrs[i]`` (``sizes[i]`` bytes). False = miss."""
        keys, ptrs, sizes = check_batch(keys, ptrs, sizes)
        n = len(keys)
        result = self._guard(lambda: self._get(keys, ptrs, sizes), [False] * n)
        hits = sum(result)
        self.counters["get_keys"] += n
        self.counters["get_hits"] += hits
        self.counters["bytes_read"] += sum(s for s, ok in zip(sizes, result) if ok)
        return result

    def _get(self, keys, ptrs, sizes) -> list[bool]:
        """Where the keys are (from the Exists just made, else a Locate), then per node a
        Lease, the copy and a Release (the transport's ``read``). Keys on a node that fails
        meanwhile are located once more, elsewhere: a copy on a live node serves them."""
        if not keys:
            return []
        deadline = self._deadline()
        entries = self._where.take(keys, self.node_circuits.open_ids())
        if entries is not None:
            self.counters["locate_saved"] += 1
        else:
            entries = self._locate(keys, deadline)
        result = [False] * len(keys)
        failed = self._read(entries, list(range(len(keys))), keys, ptrs, sizes, deadline, result)
        if failed.keys:
            again = failed.keys
            entries = self._locate([keys[i] for i in again], deadline, failed.nodes)
            self._read(entries, again, keys, ptrs, sizes, deadline, result)
        self.copy_reads([i for i, ok in enumerate(result) if ok], keys, ptrs, sizes, deadline)
        return result

    def _locate(self, keys: list[str], deadline: float, down: Sequence[str] = ()) -> list:
        """Where each key is: (node id, size), or None; never on a node this client cannot
        reach now (an open circuit, or ``down``), and on this host first."""
        avoid = [*self.node_circuits.open_ids(), *down]
        located = self._master(P.LocateRequest(keys, self.fences.after(), self.host, avoid), deadline)
        self._learn(located.nodes)
        return located.located()

    def _read(self, entries: list, which: list[int], keys, ptrs, sizes, deadline: float,
              result: list[bool]) -> "Failed":
        """Read keys ``which`` (``entries``: their locations, in that order) into ``result``;
        the keys and the nodes of the nodes that failed."""
        by_node: dict[str, list[int]] = defaultdict(list)
        for i, entry in zip(which, entries):
            if entry and entry[1] == sizes[i]:
                by_node[entry[0]].append(i)
        failed = Failed([], [])
        for node_id, idx in by_node.items():
            node = self._nodes[node_id]
            got = self._on_node(node, len(idx), lambda t: self.rounds.read(
                self._channel(node.address), t, node, [keys[i] for i in idx], [ptrs[i] for i in idx],
                [sizes[i] for i in idx], deadline))
            for i, good in zip(idx, got.ok):
                result[i] = good
            if got.failed:
                failed.keys.extend(idx)
                failed.nodes.append(node_id)
        return failed

    def _on_node(self, node: P.NodeInfo, n: int, move) -> "OnNode":
        """``move(transport)`` for ``n`` objects on one node, under that node's circuit: a node
        that fails costs its own objects (misses, False), never the rest of the call."""
        circuit = self.node_circuits.of(node.node_id)
        if not circuit.allow():
            self.counters["circuit_rejects"] += 1
            return OnNode([False] * n, True)
        try:
            ok = move(self.transport_for(node))
        except RemoteError as exc:
            if exc.code == "forbidden":     # a refusal of the keys, not a failing node
                raise
            self._node_failed(circuit, exc)
            return OnNode([False] * n, True)
        except (HicacheError, zmq.ZMQError, OSError) as exc:
            self._node_failed(circuit, exc)
            return OnNode([False] * n, True)
        circuit.ok()
        return OnNode(ok, False)

    def _write_on(self, mover: Transport, node: P.NodeInfo, keys: list[str], ptrs: list[int],
                  sizes: list[int], deadline: float) -> list[bool]:
        """The Reserve, copy and Commit rounds on one node; its commits fence this client's
        next lookups (read-your-writes)."""
        written = self.rounds.write(self._channel(node.address), mover, node, keys, ptrs, sizes,
                                    deadline)
        self.fences.committed(node, written.seq)
        return written.ok

    def _node_failed(self, circuit: Circuit, exc: Exception) -> None:
        self.counters["node_errors"] += 1
        circuit.fail(exc)

    # -------------------------------------------------------------- single-key API

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def put(self, key: str, data) -> bool:
        """Store ``data`` (bytes-like) under ``key``."""
        arr = np.frombuffer(memoryview(data).cast("B"), dtype=np.uint8)
        return self.batch_put_from([key], [arr.ctypes.data], [arr.nbytes])[0]

    def get(self, key: str) -> Optional[bytes]:
        """The object's bytes, or None on a miss."""
        def locate():
            entry = self._locate([key], self._deadline())[0]
            return entry[1] if entry else -1
        size = self._guard(locate, -1)
        if size < 0:
            return None
        buf = np.empty(size, dtype=np.uint8)
        ok = self.batch_get_into([key], [buf.ctypes.data], [size])[0]
        return buf.tobytes() if ok else None

    # -------------------------------------------------------------- admin

    def clear(self, prefix: str = "") -> int:
        """Remove every key starting with ``prefix`` from every node; returns how many."""
        if not isinstance(prefix, str):
            raise TypeError(f"prefix must be a str, got {type(prefix).__name__}")

        def run():
            deadline = self._deadline()
            removed = 0
            try:
                for node in self._master(P.StatsRequest(), deadline).stats["nodes"]:
                    ch = self._channel(node["address"])
                    removed += P.raise_if_error(ch.recv(ch.send(P.ClearRequest(prefix)), deadline)).removed
            finally:    # (some nodes may have cleared)
                if self.view is not None:
                    self.view.refresh(prefix)
            return removed
        return self._guard(run, 0)

    def check(self) -> Reach:
        """Ask the master for its stats once, outside the circuit: how many nodes are live, or
        why it did not answer (a dead master is not a wrong token: ``link.Down``)."""
        try:
            stats = self._master(P.StatsRequest(), self._deadline()).stats
        except (HicacheError, zmq.ZMQError) as exc:
            master = self.config.master
            return Reach(-1, f"the master at {master}: {str(exc).removeprefix(master + ': ')}")
        return Reach(len(stats.get("nodes", ())), "")

    def stats(self) -> dict:
        """Cluster stats from the master plus this client's own counters."""
        cluster = self._guard(lambda: self._master(P.StatsRequest(), self._deadline()).stats, None)
        own = dict(self.counters, checksum_failures=self.checks.failures,
                   circuit_opens=self.circuit.opens + self.node_circuits.opens,
                   **(self.view.counters if self.view is not None else {}),
                   **{f"te_{k}": v for k, v in self.te.counters.items()})
        return {"cluster": cluster, "client": own}

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.view is not None:
            self.view.close()
        with self._channels_lock:
            for ch in self._channels:
                ch.close()
            self._channels.clear()
        self.shm.close()
        self.tcp.close()
        self.te.close()

    def __enter__(self) -> "StoreClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

