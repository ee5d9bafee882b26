"""StoreClient: batch exists / get / put against a hicache-mc cluster.

Thread-safe: each thread gets its own sockets (ZeroMQ sockets are not thread-safe); the
transports, the node table and the counters are shared. Every call runs under one deadline.
Store failures never raise: they are misses (get/exists) or False (put). After
``circuit_failures`` failures in a row the circuit opens and calls answer misses at once for
``circuit_open_s``; the next call after that is a probe, and a success closes the circuit.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from itertools import repeat
from typing import Optional, Sequence

import numpy as np
import zmq

from .. import protocol as P
from ..config import ClientConfig, load_config
from ..errors import HicacheError, RemoteError, StoreUnavailable
from ..rpc import Channel, direct_via
from ..transport.base import ROUND_BYTES, ChecksumCounter, LeasedTransport, Transport
from ..transport.mooncake import MooncakeTransport
from ..transport.shm import ShmTransport, host_identity
from ..transport.tcp import TcpTransport
from .arena import Arenas, Use

log = logging.getLogger(__name__)

# Locations an Exists returned serve the get that usually follows (SGLang: prefetch probe, then
# the I/O thread's read), saving one master round trip. Brief, because an object may be evicted
# or moved meanwhile: then the node answers "missing" and the read is a miss, as it would be.
LOCATION_TTL_S = 1.0
LOCATION_CACHE_MAX = 1 << 16
# How long a put waits for an early Reserve's answer before it hears from the master.
EARLY_GRACE_S = 0.25
HELLO_S = 30.0              # the master is asked for its direct port this often
HELLO_RETRY_S = 5.0         # ... or this soon again when it did not answer
HELLO_TIMEOUT_S = 1.0
SPECULATE_RUN = 1 << 20     # copies made before the Place is answered go in runs of this much
FENCE_TTL_S = 5.0           # a commit is named in this client's lookups for this long at most
SOLE_S = 10.0               # puts skip the Place for this long after one named the cluster's only node


class Circuit:
    """Consecutive-failure breaker shared by all threads of one client."""

    def __init__(self, failures: int, open_s: float):
        self.limit, self.open_s = failures, open_s
        self.failures, self.open_until, self.opens = 0, 0.0, 0
        self.lock = threading.Lock()

    def allow(self) -> bool:
        return time.monotonic() >= self.open_until

    def ok(self) -> None:
        with self.lock:
            if self.failures >= self.limit:
                log.info("store reachable again; circuit closed")
            self.failures = 0

    def fail(self, exc: Exception) -> None:
        with self.lock:
            self.failures += 1
            if self.failures == 1:
                log.warning("store call failed: %s", exc)
            if self.failures >= self.limit:
                if self.failures == self.limit:
                    log.warning("%d failures in a row: answering misses for %.1fs", self.limit, self.open_s)
                    self.opens += 1
                self.open_until = time.monotonic() + self.open_s


class EarlyPut:
    """A Reserve sent to the writer's node before the master placed the keys (see _put)."""

    def __init__(self, node: P.NodeInfo, transport: LeasedTransport, ch: Channel, rid: int, sent: float):
        self.node, self.transport, self.ch, self.rid, self.sent = node, transport, ch, rid, sent
        self.reply: Optional[P.ReserveReply] = None
        self.copied: dict[int, int] = {}        # key index -> checksum of its copy in the slot
        self.lost: set[int] = set()             # key indices whose slots were given back

    @property
    def until(self) -> float:
        """When the reserved slots lapse, on this client's clock."""
        return self.sent + self.reply.ttl

    def failed(self, exc: Optional[Exception]) -> None:
        self.ch.forget([self.rid])
        self.rid = None
        if exc is not None:
            log.warning("put to %s failed: %s", self.node.node_id, exc)

    def abandon(self, keys: list[str]) -> None:
        """The put failed before the master answered: give every slot back."""
        if self.reply is None:
            self.ch.forget([self.rid])
            return
        held = [i for i, off in enumerate(self.reply.offsets) if off >= 0 and i not in self.lost]
        self.transport.cancel(self.node, [keys[i] for i in held], [self.reply.offsets[i] for i in held])


class StoreClient:
    """A client of one hicache-mc cluster. ``StoreClient(master=..., **ClientConfig fields)``."""

    def __init__(self, master: Optional[str] = None, *, config: Optional[ClientConfig] = None,
                 config_file: Optional[str] = None, **options):
        self.config = config or load_config(ClientConfig, file=config_file, section="client",
                                            master=master, **options)
        self.ctx = zmq.Context()
        self._local = threading.local()
        self._channels: list[Channel] = []
        self._channels_lock = threading.Lock()
        self._nodes: dict[str, P.NodeInfo] = {}
        self._node_records: dict[str, dict] = {}
        self._where: dict[str, tuple[float, tuple]] = {}  # key -> (expiry, location) from Exists
        self._direct: dict[str, str] = {}     # service address -> its direct port (host:port)
        self._next_hello = 0.0                # when to ask the master for its direct port (again)
        self._writer: Optional[str] = None    # the node on this host the last put went to
        self._reader: Optional[str] = None    # the node that held every key of the last get or put
        self._sole = ("", 0.0)                # (the cluster's only node, on this host; until when)
        self.host = host_identity()
        self.checks = ChecksumCounter()
        verify = self.config.verify_checksums
        self.tcp = TcpTransport(self._channel, self.checks, verify, token=self.config.token)
        frames = self.tcp.stream     # SSD-only objects the node cannot stage: read as frames
        self.shm = ShmTransport(self._channel, self.checks, verify, stream=frames)
        cfg = self.config
        self.te = MooncakeTransport(self._channel, self.checks, verify, stream=frames,
                                    master=cfg.master, protocol=cfg.te_protocol,
                                    device=cfg.te_device, metadata=cfg.te_metadata,
                                    hostname=cfg.te_hostname, staging_bytes=cfg.te_staging,
                                    timeout_s=cfg.timeout_s)
        # node id -> (until, [segment, seq]): this client's latest commit on each node, named
        # in its lookups so the master answers them only after applying it (read-your-writes)
        self._fences: dict[str, tuple[float, list]] = {}
        for t in (self.tcp, frames, self.shm, self.te):
            t.committed = self._note_commit
        self._arenas = Arenas(self.config.arena, self._channel)
        self._warned: set[str] = set()
        self.circuit = Circuit(self.config.circuit_failures, self.config.circuit_open_s)
        self.counters = defaultdict(int)
        self._closed = False

    # -------------------------------------------------------------- plumbing

    def _channel(self, address: str) -> Channel:
        if self.config.direct and address == self.config.master and time.monotonic() >= self._next_hello:
            self._hello()
        chans = getattr(self._local, "chans", None)
        if chans is None:
            chans = self._local.chans = {}
        ch = chans.get(address)
        if ch is None:
            ch = chans[address] = Channel(self.ctx, address, self.config.token,
                                          self._direct.get(address, ""), self.config.timeout_s)
            with self._channels_lock:
                self._channels.append(ch)
        return ch

    def _hello(self) -> None:
        """Ask the master (over ZeroMQ) where its direct port is; again every HELLO_S, so a
        restarted master's new port is found (meanwhile requests go through ZeroMQ)."""
        self._next_hello = time.monotonic() + HELLO_S
        ch = Channel(self.ctx, self.config.master, self.config.token)
        try:
            reply = ch.call(P.HelloRequest(), min(HELLO_TIMEOUT_S, self.config.timeout_s))[0]
        except HicacheError:
            self._next_hello = time.monotonic() + HELLO_RETRY_S
            return
        finally:
            ch.close()
        self._set_direct(self.config.master, direct_via(self.config.master, reply.direct_address))

    def _set_direct(self, address: str, direct: str) -> None:
        """Requests to ``address`` go through ``direct`` from now on ("" = ZeroMQ)."""
        if self._direct.get(address, "") == direct:
            return
        self._direct[address] = direct
        with self._channels_lock:
            for ch in self._channels:
                if ch.address == address:
                    ch.direct = direct

    def _note_commit(self, node: P.NodeInfo, seq: int) -> None:
        if seq > 0:
            mark = [P.segment_of(node), seq]
            old = self._fences.get(node.node_id)
            if old is None or old[1][0] != mark[0] or old[1][1] < seq:   # (threads race here)
                self._fences[node.node_id] = (time.monotonic() + FENCE_TTL_S, mark)

    def _after(self) -> dict:
        """The fence for a lookup: this client's recent commits, per node."""
        if not self._fences:
            return {}
        now, after = time.monotonic(), {}
        for node_id, (until, mark) in list(self._fences.items()):
            if until > now:
                after[node_id] = mark
            else:
                self._fences.pop(node_id, None)
        return after

    def _master(self, msg: P.Message, deadline: float) -> P.Message:
        ch = self._channel(self.config.master)
        reply, _ = ch.recv(ch.send(msg), deadline)
        return P.raise_if_error(reply)

    def _deadline(self) -> float:
        return time.monotonic() + self.config.timeout_s

    def _learn(self, nodes: dict) -> None:
        for node_id, d in nodes.items():
            if self._node_records.get(node_id) != d:   # decode (and type-check) a record once
                info = self._nodes[node_id] = P.NodeInfo.from_dict(d)
                self._node_records[node_id] = d
                self._set_direct(info.address, info.direct_address if self.config.direct else "")

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

    def batch_exists(self, keys: Sequence[str]) -> int:
        """How many keys, from the first, are stored (0 when the store is unreachable)."""
        keys = _check_keys(keys)
        if not keys:
            return 0
        return self._guard(lambda: self._exists(keys), 0)

    def _exists(self, keys: list[str]) -> int:
        reply = self._master(P.ExistsRequest(keys, self._after()), self._deadline())
        self._learn(reply.nodes)
        if len(self._where) > LOCATION_CACHE_MAX:
            self._where.clear()
        self._where.update(zip(keys, zip(repeat(time.monotonic() + LOCATION_TTL_S), reply.located())))
        return reply.count

    def _cached_locations(self, keys: list[str]) -> Optional[list]:
        """The entries an Exists just returned for all of ``keys``, or None (then Locate)."""
        now, where = time.monotonic(), self._where
        entries = []
        for key in keys:
            hit = where.pop(key, None)
            if hit is None or hit[0] < now:
                return None
            entries.append(hit[1])
        self.counters["locate_saved"] += 1
        return entries

    def batch_contains(self, keys: Sequence[str]) -> list[bool]:
        """Per key: is it stored? (``batch_exists`` answers the leading run only.)"""
        keys = _check_keys(keys)
        if not keys:
            return []
        return self._guard(lambda: list(self._master(P.ContainsRequest(keys, self._after()), self._deadline()).present),
                           [False] * len(keys))

    def batch_get_into(self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int]) -> list[bool]:
        """Copy each object into ``ptrs[i]`` (``sizes[i]`` bytes). False = miss."""
        keys, ptrs, sizes = _check_batch(keys, ptrs, sizes)
        n = len(keys)
        result = self._guard(lambda: self._get(keys, ptrs, sizes), [False] * n)
        hits = sum(result)
        self.counters["get_keys"] += n
        self.counters["get_hits"] += hits
        self.counters["bytes_read"] += sum(s for s, ok in zip(sizes, result) if ok)
        return result

    def _get(self, keys, ptrs, sizes) -> list[bool]:
        if not keys:
            return []
        deadline = self._deadline()
        result = [False] * len(keys)
        entries = self._cached_locations(keys)
        asked, again = None, set()      # the node an early Lease asked; its keys to ask again
        if entries is None:
            early = self._lease_early(keys, sizes)
            if early is not None:
                asked, left, again = self._read_early(early, keys, ptrs, sizes, deadline, result)
                if not left:
                    self.counters["lease_early"] += 1
                    return result
                self._reader = None     # it did not hold them all: ask the master first next time
            located = self._master(P.LocateRequest(keys, self._after()), deadline)
            self._learn(located.nodes)
            entries = located.located()
        by_node: dict[str, list[int]] = defaultdict(list)
        for i, entry in enumerate(entries):
            if entry and entry[1] == sizes[i] and (entry[0] != asked or i in again):
                by_node[entry[0]].append(i)
        if asked is None:
            self._reader = next(iter(by_node)) if len(by_node) == 1 else None
        for node_id, idx in by_node.items():
            node = self._nodes[node_id]
            ok = self.transport_for(node).read(node, [keys[i] for i in idx], [ptrs[i] for i in idx],
                                               [sizes[i] for i in idx], deadline)
            for i, good in zip(idx, ok):
                result[i] = good
        return result

    # A get without locations from an Exists asks the master where the keys are (Locate) and
    # then leases them from their node: two round trips. When one node held every key of this
    # client's last get (or took its last put), the Lease goes to that node first: a single
    # round trip when it holds them all (the node is the truth about what it holds). Keys it
    # does not hold are then located as usual, and the next get asks the master first.

    def _early(self, node_id: Optional[str], sizes) -> Optional[tuple]:
        """(node, its leased transport) for a Lease or Reserve sent before the master is
        asked; None when there is no such node or the batch needs more than one round."""
        node = self._nodes.get(node_id) if node_id else None
        if node is None or sum(sizes) > ROUND_BYTES:
            return None
        transport = self.transport_for(node)
        if not isinstance(transport, LeasedTransport) or (transport is self.tcp and not node.data_address):
            return None
        return node, transport

    def _lease_early(self, keys, sizes) -> Optional[tuple]:
        """(node, transport, request id, when sent) of a Lease sent to the likely node, or None."""
        early = self._early(self._reader, sizes)
        if early is None:
            return None
        sent = time.monotonic()
        return (*early, early[1].lease(early[0], keys), sent)

    def _read_early(self, early, keys, ptrs, sizes, deadline, result) -> tuple:
        """Read what the early Lease got: (the node's id, or None when it did not answer in
        time; the key indices it did not serve; of those, the ones it holds only on SSD)."""
        node, transport, rid, sent = early
        ch = self._channel(node.address)
        try:
            reply = P.raise_if_error(ch.recv(rid, min(deadline, time.monotonic() + EARLY_GRACE_S))[0])
        except HicacheError:    # unanswered leases lapse on the node
            ch.forget([rid])
            return None, range(len(keys)), set()
        if not transport.same_segment(node, reply, keys):
            return None, range(len(keys)), set()
        done, streamed = transport.read_leased(node, range(len(keys)), keys, ptrs, sizes, reply,
                                               sent + reply.ttl, deadline, result)
        done = set(done)
        return node.node_id, [i for i in range(len(keys)) if i not in done], set(streamed)

    def batch_put_from(self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int]) -> list[bool]:
        """Store each object from ``ptrs[i]``; True once stored (or stored already). A stored
        object is visible to this client's next lookup at once, to other clients as soon as
        the master has the node's report of it (sent before the node answers)."""
        keys, ptrs, sizes = _check_batch(keys, ptrs, sizes)
        n = len(keys)
        result = self._guard(lambda: self._put(keys, ptrs, sizes), [False] * n)
        self.counters["put_keys"] += n
        self.counters["put_ok"] += sum(result)
        return result

    def _put(self, keys, ptrs, sizes) -> list[bool]:
        if not keys:
            return []
        deadline = self._deadline()
        writer = self._early(self._writer, sizes)
        # arenas over shm and tcp: a copy into an arena of a node that restarted at the same
        # address lands in the dead segment (shm's mapping) or is refused (the stream port
        # checks the segment); a TE write is one-sided, and no node would check it
        use = None if writer is None or writer[1] is self.te else \
            self._arenas.begin(writer[0], self._channel(writer[0].address), sizes)
        try:
            if use is not None and use.arena is not None and self._may_skip_place(use):
                result = self._put_local(use, writer[1], keys, ptrs, sizes, deadline)
                if result is not None:
                    return result
            mch = self._channel(self.config.master)
            place_rid = mch.send(P.PlaceRequest(keys, sizes, self.host))
            return self._put_placed(mch, place_rid, writer, use, keys, ptrs, sizes, deadline)
        finally:
            if use is not None:
                self._arenas.end(use, self._nodes)

    def _may_skip_place(self, use: Use) -> bool:
        """Whether a put into this arena may go without a Place: the master named its node as
        the cluster's only one, on this host, less than SOLE_S ago (a node added since is found
        at the next Place), and this thread's connection to it is up (a node process that died
        closed it: the Place then learns where to go instead)."""
        node_id, until = self._sole
        return node_id == use.node.node_id and time.monotonic() < until and use.ch.alive()

    def _put_local(self, use: Use, transport: LeasedTransport, keys, ptrs, sizes,
                   deadline: float) -> Optional[list[bool]]:
        """A put into an arena of the cluster's only node, on this host, without asking the
        master where to: there is nowhere else to place it, that node knows what it holds
        already (stored keys are acknowledged, not rewritten), and it lends arenas only while
        it has room. The node tells the master about the objects before it answers, as for
        every commit. None when nothing was committed (the arena lapsed, or its node
        restarted or took it back): then the put asks the master, the usual way."""
        self._copy_arena(use, transport, ptrs, sizes, deadline)
        result = None if use.sums is None else \
            self._commit_arena(use, range(len(keys)), keys, sizes, deadline)
        if result is None:
            use.arena, use.sums = None, None
            return None
        try:
            self._arenas.ask(use)   # its give-backs (the next arena came with the commit)
        except Exception as exc:    # the put is stored: what is not given back lapses
            log.debug("giving arenas back to %s failed: %s", use.node.node_id, exc)
        self._reader = use.node.node_id
        self.counters["put_local"] += 1
        return result

    def _put_placed(self, mch, place_rid, writer, use: Optional[Use], keys, ptrs, sizes, deadline):
        """The put once the Place is sent: objects go into an arena of the writer's node, or
        into slots reserved there early, or the ordinary way (see the notes below)."""
        early = None
        try:
            if use is not None and use.arena is not None:
                self._copy_arena(use, writer[1], ptrs, sizes, deadline)   # while the Place travels
            elif writer is not None:
                early = self._reserve_early(writer, keys, sizes)   # overlaps the Place round trip
                self._copy_early(early, mch, place_rid, keys, ptrs, sizes, deadline)
            if use is not None:
                self._arenas.ask(use)       # for the next put, while this one waits for the Place
            placed = P.raise_if_error(mch.recv(place_rid, deadline)[0])
            self._learn(placed.nodes)
            self._sole = (placed.sole, time.monotonic() + SOLE_S)
        except Exception:
            mch.forget([place_rid])
            if early is not None:
                early.abandon(keys)
            raise
        result = [t is None for t in placed.targets]      # None: already stored
        by_node: dict[str, list[int]] = defaultdict(list)
        for i, target in enumerate(placed.targets):
            if target:
                by_node[target].append(i)
        self._remember_writer(by_node)
        if use is not None and use.sums is not None:
            self._put_arena(use, by_node, keys, sizes, deadline, result)
        if early is not None:
            self._put_early(early, by_node, keys, ptrs, sizes, deadline, result)
        for node_id, idx in by_node.items():
            node = self._nodes[node_id]
            sub_ptrs, sub_sizes = [ptrs[i] for i in idx], [sizes[i] for i in idx]
            ok = self.transport_for(node).write(node, [keys[i] for i in idx], sub_ptrs, sub_sizes,
                                                deadline)
            for i, good in zip(idx, ok):
                result[i] = good
            self.counters["bytes_written"] += sum(s for s, g in zip(sub_sizes, ok) if g)
        return result

    # A put asks the master where each object goes (Place) and then reserves room on that node.
    # Placement puts a writer's objects on its own host first, so after one put the node is
    # known: later puts copy into an arena it lends while the Place is on its way (or, when
    # it is the cluster's only node, with no Place at all: ``_put_local``), or, where arenas
    # are not used (the TE, puts over the ``arena`` limit, no arena lent), send the Reserve
    # to it alongside the Place and start copying into the slots it gives while the Place is
    # still on its way (bounded: the copy stops as soon as the Place is answered). Then the
    # master decides: only keys it placed on that node are committed; the places of keys it
    # deduplicated or placed elsewhere are skipped or given back.

    def _remember_writer(self, by_node: dict[str, list[int]]) -> None:
        if len(by_node) == 1:
            node = self._nodes.get(next(iter(by_node)))
            self._writer = node.node_id if node is not None and node.host == self.host else None
            self._reader = node.node_id if node is not None else None
        elif by_node:
            self._writer = None

    def _copy_arena(self, use: Use, transport: LeasedTransport, ptrs, sizes, deadline: float) -> None:
        """Copy the put's objects into the places it took in an arena; their checksums go in
        ``use.sums`` (None, and the arena dropped, when the copy failed)."""
        arena = use.arena
        try:
            use.sums = transport.store(arena.node, use.offsets, ptrs, sizes, min(deadline, arena.until))
        except Exception as exc:    # e.g. the node restarted and its segment is gone
            log.debug("copy into an arena failed: %s", exc)
            self._arenas.drop(arena)

    def _put_arena(self, use: Use, by_node, keys, sizes, deadline, result) -> None:
        """After the Place: commit the objects it placed on the arena's node (the places of
        keys it deduplicated or placed elsewhere are skipped); when the arena is gone, they
        go the ordinary way."""
        mine = by_node.pop(use.arena.node.node_id, [])
        if not mine:
            return
        ok = self._commit_arena(use, mine, keys, sizes, deadline)
        if ok is None:
            by_node[use.arena.node.node_id] = mine
            return
        for i, good in zip(mine, ok):
            result[i] = good

    def _commit_arena(self, use: Use, idx, keys, sizes, deadline) -> Optional[list[bool]]:
        """Commit objects ``idx`` of the put, copied into the arena at the offsets it chose
        (and ask for the next arena with them); per object, whether it is stored. None when
        the node no longer lends the arena (it restarted, or took it back) or it lapsed:
        nothing was committed."""
        arena, node = use.arena, use.arena.node
        sent = time.monotonic()
        if self._nodes.get(node.node_id) is not node or sent >= arena.until:
            self._arenas.drop(arena)        # a new record for the node came: it restarted
            return None
        ch = self._channel(node.address)
        lend = self._arenas.lend(use)
        offsets, sub = [use.offsets[i] for i in idx], [sizes[i] for i in idx]
        msg = P.CommitRequest([keys[i] for i in idx], [use.sums[i] for i in idx], offsets,
                              arena.id, sub, lend)
        try:
            reply = P.raise_if_error(ch.recv(ch.send(msg), deadline)[0])
        except RemoteError as exc:
            self._arenas.drop(arena)
            if exc.code != "unknown_arena":
                raise
            log.info("node %s no longer lends arena %d; writing the ordinary way", node.node_id, arena.id)
            return None
        except Exception:
            # no answer: its arenas' state there is in doubt (they lapse), and the next put
            # asks the master (the node may be gone)
            self._arenas.drop_node(node)
            self._sole = ("", 0.0)
            raise
        self._arenas.committed(arena, sent, offsets[-1], sub[-1])
        if lend:
            self._arenas.lent(use, reply.lent, sent, self._nodes)
        self._note_commit(node, reply.seq)
        self.counters["bytes_written"] += sum(s for s, ok in zip(sub, reply.ok) if ok)
        return list(reply.ok)

    def _reserve_early(self, writer, keys, sizes) -> "EarlyPut":
        """A Reserve sent to the node the last put went to (``writer``: see ``_early``)."""
        node, transport = writer
        sent = time.monotonic()
        rid = transport.reserve(node, keys, sizes, evict=False)
        return EarlyPut(node, transport, self._channel(node.address), rid, sent)

    def _copy_early(self, early: "EarlyPut", mch: Channel, place_rid: int, keys, ptrs, sizes,
                    deadline: float) -> None:
        """While the Place is unanswered: take the early Reserve's reply (waiting at most
        EARLY_GRACE_S: the node may be dead) and copy into its slots, a run at a time."""
        try:
            early.reply = P.raise_if_error(early.ch.recv(early.rid, min(deadline, time.monotonic() + EARLY_GRACE_S),
                                                         reset=False)[0])
        except StoreUnavailable:
            return                  # not answered yet: decided once the Place is back
        except RemoteError as exc:
            early.failed(exc)
            return
        if not early.transport.same_segment(early.node, early.reply, keys):
            early.reply, early.rid = None, None     # the keys go the ordinary way
            return
        offsets, run, run_bytes = early.reply.offsets, [], 0
        todo = [i for i, off in enumerate(offsets) if off >= 0]
        for n, i in enumerate(todo):
            run.append(i)
            run_bytes += sizes[i]
            if run_bytes < SPECULATE_RUN and n + 1 < len(todo):
                continue
            if mch.ready(place_rid) or time.monotonic() >= min(deadline, early.until):
                return
            try:
                sums = early.transport.store_slots(early.node, run, keys, ptrs, sizes,
                                                   [offsets[j] for j in run],
                                                   min(deadline, early.until))
            except Exception as exc:    # e.g. the node restarted and its segment is gone
                log.debug("copy ahead of the Place failed: %s", exc)
                early.lost.update(run)  # those slots were given back: written the ordinary way
                return
            early.copied.update(zip(run, sums))
            run, run_bytes = [], 0

    def _put_early(self, early: "EarlyPut", by_node, keys, ptrs, sizes, deadline, result) -> None:
        """Finish the objects placed on the early-reserved node; give back the other slots."""
        node, transport = early.node, early.transport
        if self._nodes.get(node.node_id) is not node:
            # the Place brought a new record for that node (it restarted: new segment, new
            # stream port): give the early slots back, and write the ordinary way
            mine = []
        else:
            mine = by_node.pop(node.node_id, [])
        reply = early.reply
        if reply is None and early.rid is not None:
            # Placed elsewhere: the answer is not needed to go on (the node was given
            # EARLY_GRACE_S already); unanswered, its reservations lapse after reserve_s.
            try:
                reply = P.raise_if_error(early.ch.recv(early.rid, deadline if mine else 0)[0])
                if not transport.same_segment(node, reply, keys):
                    reply = None
            except HicacheError as exc:
                early.failed(exc if mine else None)
        early.reply = reply
        if reply is None:
            self._writer = None
            if mine and time.monotonic() < deadline:
                by_node[node.node_id] = mine    # try them the ordinary way (a node restarted
            return                              # meanwhile has no early slots: it will take them)
        self.counters["reserve_early"] += 1
        offsets, taken, lost = reply.offsets, set(mine), early.lost
        spare = [i for i, off in enumerate(offsets) if off >= 0 and i not in taken and i not in lost]
        transport.cancel(node, [keys[i] for i in spare], [offsets[i] for i in spare])
        # no free room there now (the ordinary path may evict to make some), or slots lost
        redo = [i for i in mine if offsets[i] == P.RESERVE_FULL or i in lost]
        if redo:
            by_node[node.node_id] = redo
        for i in mine:
            if offsets[i] == P.RESERVE_STORED:
                result[i] = True
        copied = [i for i in mine if i in early.copied]
        rest = [i for i in mine if offsets[i] >= 0 and i not in early.copied and i not in lost]
        sums = [early.copied[i] for i in copied]
        try:
            if rest:
                sums += transport.store_slots(node, rest, keys, ptrs, sizes, [offsets[i] for i in rest],
                                              min(deadline, early.until))
        except Exception:
            transport.cancel(node, [keys[i] for i in copied], [offsets[i] for i in copied])
            raise
        if copied or rest:
            transport.commit(node, copied + rest, keys, sums, [offsets[i] for i in copied + rest],
                             early.until, deadline, result)
            self.counters["bytes_written"] += sum(sizes[i] for i in copied + rest if result[i])

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
            entry = self._master(P.LocateRequest([key], self._after()), self._deadline()).located()[0]
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
            for node in self._master(P.StatsRequest(), deadline).stats["nodes"]:
                ch = self._channel(node["address"])
                reply, _ = ch.recv(ch.send(P.ClearRequest(prefix)), deadline)
                removed += P.raise_if_error(reply).removed
            return removed
        return self._guard(run, 0)

    def stats(self) -> dict:
        """Cluster stats from the master plus this client's own counters."""
        cluster = self._guard(lambda: self._master(P.StatsRequest(), self._deadline()).stats, None)
        own = dict(self.counters, checksum_failures=self.checks.failures, arena_puts=self._arenas.puts,
                   circuit_opens=self.circuit.opens,
                   **{f"te_{k}": v for k, v in self.te.counters.items()})
        return {"cluster": cluster, "client": own}

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._arenas.close(self._channel)
        with self._channels_lock:
            for ch in self._channels:
                ch.close()
            self._channels.clear()
        self.shm.close()
        self.tcp.close()
        self.te.close()
        self.ctx.term()

    def __enter__(self) -> "StoreClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _check_keys(keys: Sequence[str]) -> list[str]:
    keys = list(keys)
    if set(map(type, keys)) <= {str} and all(keys):   # the usual case, checked in C
        return keys
    for k in keys:
        if not isinstance(k, str) or not k:
            raise ValueError(f"keys must be non-empty strings, got {k!r}")
    return keys


def _check_batch(keys, ptrs, sizes):
    keys, ptrs, sizes = _check_keys(keys), list(ptrs), list(sizes)
    if not len(keys) == len(ptrs) == len(sizes):
        raise ValueError(f"{len(keys)} keys, {len(ptrs)} pointers and {len(sizes)} sizes: lengths differ")
    if (set(map(type, ptrs)) | set(map(type, sizes))) <= {int} and (not sizes or min(sizes) >= 0) \
            and (not ptrs or min(ptrs) > 0):
        return keys, ptrs, sizes        # the usual batch, checked in C
    for p, s in zip(ptrs, sizes):
        if not isinstance(p, (int, np.integer)) or not isinstance(s, (int, np.integer)) or s < 0 or (p == 0 and s > 0):
            raise ValueError(f"bad pointer/size pair ({p!r}, {s!r})")
    return keys, [int(p) for p in ptrs], [int(s) for s in sizes]
