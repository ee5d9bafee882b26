"""A client's residency view: which keys of its namespaces the store holds, kept locally.

``batch_exists`` / ``batch_contains`` answer the keys the view holds when it is in sync, and
ask the master for the others (client/lookups.py), as for every key when it is not. The view
follows the master's publisher (master/publisher.py) per namespace, after the ZeroMQ guide's
Clone pattern:

- snapshot: ``SnapshotRequest`` on the master's ROUTER gives the namespace's digests, its last
  update number, the master's epoch, each node's applied reports and the publisher's port;
- subscribe (``<namespace>/``) and apply the numbered updates that follow the snapshot;
- in sync only once a beat or update confirms the numbers follow on (the subscription may have
  taken effect after the snapshot); out of sync, and a new snapshot, on a gap, another epoch
  (a restarted master), a dropped connection to the publisher (a master that exited: noticed
  at once) or 3 beats (at least 1 s) of silence (a partition, a stalled publisher or view thread).

Consistency. The view says "stored" for a key the master had on a live node when it sent the
update, and a get still reads and checks the bytes, so a stale "stored" costs one miss, never a
wrong byte. "Not stored" may be stale by an update on its way (another client's commit), so
the client asks the master for those keys (``contains_cached`` does not). Read-your-writes:
the keys this client stored in the last 5-10 s (written, or found stored by its Place) count
as stored too (``own_writes.py``) until an update removes them, so a writer's probes of its
own commits need no round trip, as an SGLang backend that backs pages up while it prefetches
others would otherwise pay on every probe (a key evicted before the view hears of it: one
miss). A clear by this client takes its namespaces out of sync until a new snapshot.

All subscriber work runs on one background thread; callers only read (no lock: see
client/digests.py), so a lookup never waits for it.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Optional

import zmq

from .. import protocol as P
from .. import residency as R
from ..auth import credential, secure_client
from ..errors import HicacheError, RemoteError
from ..keydigest import key_prefixes, page_prefixes
from ..link import Link
from ..rpc import Channel, host_of
from .digests import DigestSet
from .own_writes import OwnWrites

log = logging.getLogger(__name__)

STALE_BEATS = 3         # a namespace silent for this many beats is out of sync ...
STALE_MIN_S = 1.0       # ... and for at least this long (short beats on a loaded host)
RETRY_S = 0.5           # a failed snapshot is retried after this ...
RETRY_MAX_S = 8.0       # ... doubling up to this while they keep failing
REFUSED_RETRY_S = 60.0  # a snapshot refused (forbidden, too large, no publisher) is asked again
MAX_NAMESPACES = 64     # namespaces one view follows; lookups in others ask the master
# updates queued for the view thread before ZeroMQ drops (then: a gap, and a snapshot); an
# update holds up to 2 MiB of digests, so this bounds what a stalled view thread can hold
RCVHWM = 1000
GAP_RESET_S = 10.0      # a gap this long after the last one is a first gap again (no back-off)


@dataclass
class Space:
    """One followed namespace."""
    ns: str
    keys: Optional[DigestSet] = None
    epoch: str = ""
    seq: int = 0
    synced: bool = False     # the snapshot's updates are known to follow on: answer from it
    need: bool = True        # a snapshot is due
    heard: float = 0.0       # when the last update or beat of it was applied (monotonic)
    nodes: dict = field(default_factory=dict)   # node id -> (segment, seq) applied
    retry_at: float = 0.0
    failures: int = 0
    gaps: int = 0            # gaps in a row (each within GAP_RESET_S of the last)
    gap_at: float = 0.0


class ResidencyView:
    """The view of one StoreClient. ``exists``/``contains`` return None when the master must
    answer; ``close`` stops the thread."""

    def __init__(self, ctx: zmq.Context, master: str, token: str, timeout_s: float):
        self.ctx, self.master, self.token, self.timeout_s = ctx, master, token, timeout_s
        self.spaces: dict[str, Space] = {}      # written by the view thread only
        self.stale_s = STALE_BEATS * 0.5        # from the master's beat, once known
        # view_misses_asked: answers the view gave in part, the keys it lacked asked of the master
        self.counters = {"view_answers": 0, "view_fallbacks": 0, "view_misses_asked": 0,
                         "view_snapshots": 0, "view_gaps": 0, "view_stale": 0, "view_epochs": 0}
        self._wanted: set[str] = set()
        self.own = OwnWrites()
        self._refresh: set[str] = set()     # namespaces this client cleared: snapshot anew
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._sub: Optional[zmq.Socket] = None
        self._link: Optional[Link] = None   # the SUB's connection: why it is down, if it is
        self._port = 0

    # -------------------------------------------------------------- callers

    def follow(self, ns: str) -> None:
        """Start following ``ns`` (in the background)."""
        if ns in self.spaces or ns in self._wanted or \
                len(self.spaces) + len(self._wanted) >= MAX_NAMESPACES:
            return
        with self._lock:
            if self._stop.is_set():
                return
            self._wanted.add(ns)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="hicache-mc-view", daemon=True)
                self._thread.start()

    def refresh(self, prefix: str) -> None:
        """This client removed the keys under ``prefix`` (a clear, answered once the master had
        applied it): the views of the namespaces it touched answer only after a new snapshot.
        (The removals' updates may still be on their way; a clear carries no fence.)"""
        self.own.clear()
        with self._lock:
            self._refresh.update(ns for ns in list(self.spaces)
                                 if (ns + "/").startswith(prefix) or prefix.startswith(ns + "/"))

    def _space(self, keys: list[str]) -> Optional[Space]:
        """The in-sync space of ``keys`` (one namespace)."""
        first = keys[0]
        i = first.find("/")
        if i < 0:
            return None
        prefix = first[:i + 1]
        if len(keys) > 1 and not (min(keys).startswith(prefix) and max(keys).startswith(prefix)):
            return None
        return self._synced(first[:i])

    def _synced(self, ns: str) -> Optional[Space]:
        """The space of ``ns`` when it is in sync (one not followed yet is, from now on)."""
        sp = self.spaces.get(ns)
        if sp is None:
            self.follow(ns)
            return None
        if not sp.synced or time.monotonic() - sp.heard > self.stale_s or ns in self._refresh:
            return None
        return sp

    def _mask(self, sp: Space, keys: list[str]):
        q = key_prefixes(keys, sp.ns)
        hit = sp.keys.mask(q)
        return self.own.add_to(hit, q)

    def contains(self, keys: list[str]) -> Optional[list[bool]]:
        """Per key: stored? Or None (ask the master). ``keys`` may run through several
        namespaces (a hybrid model's KV pages, then each side pool's): each run is answered by
        its own namespace's view, and all must be in sync."""
        found: list[bool] = []
        for run in _runs(keys):
            i = run[0].find("/") if run else -1     # (a run's keys share its first's namespace)
            sp = self._synced(run[0][:i]) if i >= 0 else None
            if sp is None:
                self.counters["view_fallbacks"] += 1
                return None
            found += self._mask(sp, run).tolist()
        self.counters["view_answers"] += 1
        return found

    def exists(self, keys: list[str]) -> Optional[int]:
        """The leading run of ``keys`` stored, or None (ask the master)."""
        sp = self._space(keys)
        if sp is None:
            self.counters["view_fallbacks"] += 1
            return None
        self.counters["view_answers"] += 1
        hit = self._mask(sp, keys)
        return len(keys) if hit.all() else int(hit.argmin())

    def exists_pages(self, ns: str, page_hashes: list[str], parts: tuple[str, ...]) -> Optional[int]:
        """How many pages, from the first, have every key ``<ns>/<hash>/<part>`` stored, from
        the page hashes without the keys (keydigest.page_prefixes); or None (ask the master)."""
        sp = self._synced(ns)
        try:
            q = None if sp is None else page_prefixes(ns, page_hashes, parts)
        except TypeError:       # not strings: the caller's keys are checked on the way to the master
            q = None
        if q is None:
            self.counters["view_fallbacks"] += 1
            return None
        self.counters["view_answers"] += 1
        hit = self.own.add_to(sp.keys.mask(q), q)
        first_miss = int(hit.argmin())      # (0 when every key is stored: then hit[0] holds)
        if hit[first_miss]:
            return len(page_hashes)
        # the keys are part-major: a page is stored when each part's row has it
        return int(hit.reshape(len(parts), len(page_hashes)).all(axis=0).argmin())

    def close(self) -> None:
        with self._lock:
            self._stop.set()
            thread = self._thread
        if thread is not None:
            thread.join(5)

    # -------------------------------------------------------------- the view thread

    def _run(self) -> None:
        ch = Channel(self.ctx, self.master, self.token)
        try:
            while not self._stop.is_set():
                with self._lock:
                    new, self._wanted = self._wanted, set()
                    for ns in self._refresh:
                        self._resync(self.spaces[ns], "cleared")
                    self._refresh.clear()
                    for ns in new:      # (refresh() reads the keys under the lock)
                        self.spaces.setdefault(ns, Space(ns))
                now = time.monotonic()
                for sp in list(self.spaces.values()):
                    self._check(sp, now, ch)
                self._drain()
        except Exception:       # the view is an optimisation: without it the master answers
            log.exception("residency view stopped; lookups ask the master")
            for sp in self.spaces.values():
                sp.synced = False
        finally:
            ch.close()
            self._close_sub()

    def _check(self, sp: Space, now: float, ch: Channel) -> None:
        # after a snapshot the first beat also waits for the subscription to take effect
        if not sp.need and now - sp.heard > self.stale_s * (1 if sp.synced else 2):
            # no beat: a partition, a stalled publisher or this thread (or a subscription that
            # never took effect); snapshots back off while that goes on
            self.counters["view_stale"] += 1
            problem = self._link.problem if self._link is not None else ""
            self._resync(sp, "silent for %.1f s%s", now - sp.heard,
                         f": the publish port: {problem}" if problem else "")
            sp.failures += 1
            sp.retry_at = now + min(RETRY_MAX_S, RETRY_S * 2 ** min(sp.failures, 8))
        if sp.need and now >= sp.retry_at:
            self._snapshot(sp, ch)

    def _resync(self, sp: Space, why: str, *args) -> None:
        if sp.synced:
            log.info("residency view of %s out of sync (" + why + "); asking the master meanwhile",
                     sp.ns[:40], *args)
        sp.synced = False
        sp.need = True

    def _snapshot(self, sp: Space, ch: Channel) -> None:
        try:
            reply = ch.call(P.SnapshotRequest(sp.ns), self.timeout_s)
        except (HicacheError, zmq.ZMQError) as exc:
            sp.failures += 1
            permanent = isinstance(exc, RemoteError) and exc.code in (
                "forbidden", "too_large", "unavailable", "unknown_type", "bad_request")
            wait = REFUSED_RETRY_S if permanent else min(RETRY_MAX_S, RETRY_S * 2 ** min(sp.failures, 8))
            sp.retry_at = time.monotonic() + wait
            if sp.failures == 1 or permanent:
                log.info("residency view of %s: no snapshot (%s); lookups ask the master",
                         sp.ns[:40], exc)
            return
        self.counters["view_snapshots"] += 1
        self.stale_s = max(STALE_MIN_S, STALE_BEATS * reply.beat_s)
        self._connect(reply.port)
        sp.keys = DigestSet(reply.digests)
        sp.epoch, sp.seq, sp.nodes = reply.epoch, reply.seq, dict(reply.nodes)
        sp.need, sp.synced, sp.heard = False, False, time.monotonic()
        self._sub.setsockopt(zmq.SUBSCRIBE, R.topic(sp.ns))

    def _connect(self, port: int) -> None:
        """A SUB to the publisher (anew when its port changed: a restarted master); ZeroMQ
        reconnects it by itself and subscribes it again."""
        if self._sub is not None and port == self._port:
            return
        self._close_sub()
        host = host_of(self.master)
        sub = secure_client(self.ctx.socket(zmq.SUB), credential(self.token), P.MAX_HEADER_BYTES)
        sub.setsockopt(zmq.RCVHWM, RCVHWM)
        self._link = Link(sub, credential(self.token) is not None)
        self._publisher = f"tcp://{'[' + host + ']' if ':' in host else host}:{port}"
        sub.connect(self._publisher)
        for sp in self.spaces.values():
            if sp.keys is not None:
                sub.setsockopt(zmq.SUBSCRIBE, R.topic(sp.ns))
        self._sub, self._port = sub, port

    def _close_sub(self) -> None:
        if self._sub is not None:
            self._link.close()
            self._sub.close(0)
            self._sub = self._link = None

    def _drain(self) -> None:
        if self._sub is None:
            self._stop.wait(0.05)
            return
        poller = zmq.Poller()
        poller.register(self._sub, zmq.POLLIN)
        poller.register(self._link.events, zmq.POLLIN)
        events = dict(poller.poll(50))
        if self._link.events in events:
            down = self._link.check(f"the master's publish port {self._publisher} (residency "
                                    "view: publish_port; lookups ask the master meanwhile)")
            for sp in self.spaces.values() if down is not None else ():
                self._resync(sp, "publish port: %s", down.value)   # ZeroMQ reconnects by itself
        if self._sub not in events:
            return
        for _ in range(1000):
            try:
                topic, body = self._sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            except ValueError:      # not two frames
                continue
            sp = self.spaces.get(topic[:-1].decode("ascii", "replace"))
            if sp is None or sp.need:
                continue
            update = R.decode(body)
            if update is not None:
                self._apply(sp, update)

    def _apply(self, sp: Space, u: R.Update) -> None:
        if u.epoch != sp.epoch:
            self.counters["view_epochs"] += 1
            return self._resync(sp, "master epoch %s, not %s", u.epoch, sp.epoch)
        if u.seq > sp.seq + (0 if u.beat else 1):
            self.counters["view_gaps"] += 1
            # gaps in a row (a subscriber too slow for the publisher) back off: each snapshot
            # costs the master a loop turn, and the master answers meanwhile
            now = time.monotonic()
            sp.gaps = sp.gaps + 1 if now - sp.gap_at < GAP_RESET_S else 1
            sp.gap_at = now
            if sp.gaps > 1:
                sp.retry_at = now + min(RETRY_MAX_S, RETRY_S * 2 ** (sp.gaps - 2))
            return self._resync(sp, "update %d after %d", u.seq, sp.seq)
        if u.seq < sp.seq or (not u.beat and u.seq == sp.seq):
            return      # from before the snapshot
        if u.beat:
            sp.nodes = dict(u.nodes)
        else:
            sp.keys.apply(u.added, u.removed)
            self.own.forget(u.removed)
            sp.seq = u.seq
            sp.nodes.update(u.nodes)
        sp.heard = time.monotonic()
        sp.synced = True
        sp.failures = 0


def _runs(keys: list[str]) -> list[list[str]]:
    """``keys`` cut into runs of one namespace each, in order; one run (the common case) is
    found with two C-level passes. More than MAX_NAMESPACES runs: one empty run (ask the master)."""
    ns = keys[0][:keys[0].find("/") + 1]
    if ns and min(keys).startswith(ns) and max(keys).startswith(ns):
        return [keys]
    runs, start = [], 0
    for i in range(1, len(keys) + 1):
        if i == len(keys) or not keys[i].startswith(ns):
            runs.append(keys[start:i])
            if len(runs) > MAX_NAMESPACES:
                return [[]]
            if i < len(keys):
                start, ns = i, keys[i][:keys[i].find("/") + 1]
    return runs


