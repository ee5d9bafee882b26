"""The L3's residency as SGLang KV events, for routers.

    python -m hicache_mc.sglang.kv_events --master tcp://10.0.0.1:7370 --namespace NS \\
        --endpoint tcp://*:5557 --replay-endpoint tcp://*:5558 --block-size 64

Follows one namespace (a deployment's: the backend logs it at start) on the master's residency
publisher, keys included (topic ``<namespace>#``, master/publisher.py), and republishes what
changes in SGLang's own KV-event wire format through SGLang's ``ZmqEventPublisher``: on the PUB
endpoint, frames ``[topic = namespace, 8-byte big-endian sequence number, msgpack KVEventBatch]``
of ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` with medium ``EXTERNAL``; on the
replay endpoint (ROUTER), a request ``[b"", start seq]`` gets the buffered batches from that
number on and an end marker (seq -1), as SGLang's own publisher serves them.

A block is a page: its hash is ``hash_str_to_int64(page hash)``, what SGLang's radix cache
publishes for the same page (requests without a cache salt or extra key). It is stored once
every part of the page is (``k`` and ``v``, or ``kv`` for MLA), removed when one goes. Blocks
carry no token ids or parent (the store does not know them).

What the bridge cannot know: the master keeps key digests, not keys, so blocks stored before
the bridge subscribed are not reported (start it with the deployment; a node that registers
again, after a master restart, reports its whole inventory, which arrives as stored keys).
On a gap in either topic, a new master epoch or 3 silent beats it publishes
``AllBlocksCleared`` and starts over. It holds ~200 B per key it follows. The PUB and replay
endpoints speak SGLang's format, which has no authentication: bind them where only routers
reach them (the bridge's own connection to the master is CURVE with ``--token-file``).
"""
from __future__ import annotations

import argparse
import logging
import threading
import time
from typing import Optional

import zmq
from sglang.srt.disaggregation.kv_events import (AllBlocksCleared, BlockRemoved, BlockStored,
                                                 KVEventBatch, StorageMedium, ZmqEventPublisher)
from sglang.srt.mem_cache.utils import hash_str_to_int64

from .. import protocol as P
from .. import residency as R
from ..auth import credential, secure_client
from ..config import master_address
from ..errors import HicacheError
from ..link import Link
from ..rpc import Channel, host_of

log = logging.getLogger(__name__)

MEDIUM = StorageMedium.EXTERNAL.value
PART_BITS = {"k": 1, "v": 2, "kv": 1}
FULL = {"k": 3, "v": 3, "kv": 1}
RETRY_S = 1.0


class L3EventBridge:
    """One namespace's residency as SGLang KV events; ``run()`` until ``stop()``."""

    def __init__(self, master: str, namespace: str, endpoint: str, replay_endpoint: Optional[str] = None,
                 block_size: int = 0, token: str = "", buffer_steps: int = 10_000, timeout_s: float = 5.0):
        self.master, self.ns, self.token = master_address(master), namespace, token
        self.block_size, self.timeout_s = block_size, timeout_s
        self.publisher = ZmqEventPublisher(0, endpoint, replay_endpoint, buffer_steps=buffer_steps,
                                           topic=namespace, bind=True)
        self.ctx = zmq.Context.instance()
        self._stop = threading.Event()
        self.synced = threading.Event()         # following the master now
        self.counters = {"batches": 0, "stored": 0, "removed": 0, "resets": 0}
        self.link: Optional[Link] = None
        self.publish_address = ""
        self._reset_state()

    def _reset_state(self) -> None:
        self.pages: dict[str, int] = {}         # page hash -> parts present (bits)
        self.held: dict[bytes, tuple[str, str]] = {}   # key digest -> (page hash, part)
        self.epoch, self.dseq, self.kseq = "", 0, None
        self.heard, self.beat_s = 0.0, 0.5

    # -------------------------------------------------------------- events

    def _emit(self, events: list) -> None:
        if events:
            self.publisher.publish(KVEventBatch(ts=time.time(), events=events))
            self.counters["batches"] += 1

    def _store(self, key: str, events: list) -> None:
        parts = key.split("/")
        if len(parts) != 3 or parts[2] not in PART_BITS or len(parts[1]) < 16:
            return                      # not a KV page key (an embedding, say)
        page, part = parts[1], parts[2]
        digest = R.digests([key])
        if digest in self.held:
            return
        self.held[digest] = (page, part)
        before = self.pages.get(page, 0)
        now = before | PART_BITS[part]
        self.pages[page] = now
        if now == FULL[part] and before != now:
            self.counters["stored"] += 1
            events.append(BlockStored(block_hashes=[hash_str_to_int64(page)], parent_block_hash=None,
                                      token_ids=[], block_size=self.block_size, lora_id=None,
                                      medium=MEDIUM))

    def _remove(self, digest: bytes, events: list) -> None:
        entry = self.held.pop(digest, None)
        if entry is None:
            return
        page, part = entry
        before = self.pages.get(page, 0)
        now = before & ~PART_BITS[part]
        if now:
            self.pages[page] = now
        else:
            self.pages.pop(page, None)
        if before == FULL[part]:
            self.counters["removed"] += 1
            events.append(BlockRemoved(block_hashes=[hash_str_to_int64(page)], medium=MEDIUM))

    def _start_over(self, why: str) -> None:
        log.warning("kv-events %s: %s; AllBlocksCleared, following anew", self.ns[:40], why)
        self.counters["resets"] += 1
        self._reset_state()
        self.synced.clear()
        self._emit([AllBlocksCleared()])

    # -------------------------------------------------------------- the loop

    def _snapshot(self, ch: Channel):
        """The namespace's epoch, update number and the publisher's port (digests unused)."""
        try:
            snap = ch.call(P.SnapshotRequest(self.ns), self.timeout_s)
        except (HicacheError, zmq.ZMQError) as exc:
            log.warning("kv-events %s: no snapshot from %s (%s); retrying", self.ns[:40], self.master, exc)
            return None
        self.epoch, self.dseq, self.beat_s = snap.epoch, snap.seq, snap.beat_s
        self.heard = time.monotonic()
        return snap

    def _subscribe(self, port: int) -> zmq.Socket:
        host = host_of(self.master)
        sub = secure_client(self.ctx.socket(zmq.SUB), credential(self.token), P.MAX_HEADER_BYTES)
        sub.setsockopt(zmq.SUBSCRIBE, R.topic(self.ns))
        sub.setsockopt(zmq.SUBSCRIBE, R.key_topic(self.ns))
        self.link = Link(sub, credential(self.token) is not None)   # why it is down, if it is
        self.publish_address = f"tcp://{'[' + host + ']' if ':' in host else host}:{port}"
        sub.connect(self.publish_address)
        return sub

    def _silent(self) -> str:
        problem = self.link.problem if self.link is not None else ""
        return f"silent for {time.monotonic() - self.heard:.1f} s" + \
            (f": the master's publish port {self.publish_address}: {problem}" if problem else "")

    def run(self) -> None:
        """Snapshot, subscribe, follow. The SUB stays open across start-overs, so the
        snapshot after one is taken with the subscription in effect and the updates that
        follow it continue its numbers (a SUB opened after its snapshot may miss the first
        update: a gap, and one more start-over). Start-overs in a row back off."""
        ch = Channel(self.ctx, self.master, self.token)
        sub: Optional[zmq.Socket] = None
        port, due, resets, reset_at = 0, 0.0, 0, 0.0
        self._emit([AllBlocksCleared()])        # what a router knew of this L3 no longer holds
        try:
            while not self._stop.is_set():
                if not self.epoch:      # no snapshot since the start or the last start-over
                    if time.monotonic() < due:
                        self._stop.wait(min(0.05, due - time.monotonic()))
                        continue
                    snap = self._snapshot(ch)
                    if snap is None:
                        due = time.monotonic() + RETRY_S
                    elif sub is None or snap.port != port:
                        if sub is not None:
                            self.link.close()
                            sub.close(0)
                        sub, port = self._subscribe(snap.port), snap.port
                        self.epoch, due = "", time.monotonic() + 0.1   # again, subscribed
                    continue
                self.link.check(f"the master's publish port {self.publish_address} (publish_port)")
                if sub.poll(100):
                    topic, body = sub.recv_multipart()
                    ok = self._on_keys(body) if topic.endswith(b"#") else self._on_digests(body)
                    if ok:
                        self.heard = time.monotonic()
                        continue
                elif time.monotonic() - self.heard <= 3 * self.beat_s:
                    continue
                else:
                    self._start_over(self._silent())
                now = time.monotonic()
                resets = resets + 1 if now - reset_at < 10.0 else 1
                reset_at, due = now, now + min(8.0, 0.1 * 2 ** (resets - 1))
        finally:
            if sub is not None:
                self.link.close()
                sub.close(0)
            ch.close()

    def _on_keys(self, body: bytes) -> bool:
        u = R.decode_keys(body)
        if u is None or u.epoch != self.epoch:
            self._start_over("an update of another master epoch (or none)")
            return False
        if self.kseq is None:           # the first of this topic: changes from here on
            self.kseq = u.seq if u.beat else u.seq - 1
        if u.seq > self.kseq + (0 if u.beat else 1):
            self._start_over(f"keys update {u.seq} after {self.kseq}")
            return False
        if u.beat or u.seq <= self.kseq:
            if not self.synced.is_set():
                log.info("kv-events: following %s (master epoch %s)", self.ns, self.epoch)
            self.synced.set()
            return True
        self.kseq = u.seq
        events: list = []
        for key in u.stored:
            self._store(key, events)
        for key in u.removed:
            self._remove(R.digests([key]), events)
        self._emit(events)
        self.synced.set()
        return True

    def _on_digests(self, body: bytes) -> bool:
        """The namespace's digest updates: removals the keys topic lacks (an expired node)."""
        u = R.decode(body)
        if u is None or u.epoch != self.epoch:
            self._start_over("an update of another master epoch (or none)")
            return False
        if u.seq > self.dseq + (0 if u.beat else 1):
            self._start_over(f"update {u.seq} after {self.dseq}")
            return False
        if u.beat or u.seq <= self.dseq:
            return True
        self.dseq = u.seq
        events: list = []
        removed = u.removed
        for i in range(0, len(removed), R.DIGEST):
            self._remove(removed[i:i + R.DIGEST], events)
        self._emit(events)
        return True

    def stop(self) -> None:
        self._stop.set()

    def close(self) -> None:
        self.publisher.shutdown()


def parse(argv=None):
    """(args, ClientConfig): the master and token as every hicache-mc command reads them
    (file < HICACHE_MC_* < flags; the secret from ``--token-file``, never an argument)."""
    from ..admin import client_config
    ap = argparse.ArgumentParser(description="hicache-mc L3 residency as SGLang KV events",
                                 allow_abbrev=False)
    ap.add_argument("--master", help="tcp://HOST:PORT (default: HICACHE_MC_MASTER, else the "
                    "config file, else tcp://127.0.0.1:7370)")
    ap.add_argument("--config", help="TOML or JSON config file (its [client] section)")
    ap.add_argument("--token-file", metavar="FILE",
                    help="a client credential or the cluster token (else HICACHE_MC_TOKEN)")
    ap.add_argument("--namespace", required=True, help="the deployment's key namespace (the backend logs it)")
    ap.add_argument("--endpoint", default="tcp://127.0.0.1:5557", help="PUB endpoint for routers")
    ap.add_argument("--replay-endpoint", default="tcp://127.0.0.1:5558", help="replay ROUTER endpoint")
    ap.add_argument("--block-size", type=int, default=0, help="tokens per page (the deployment's page size)")
    args = ap.parse_args(argv)
    return args, client_config(args)


def main(argv=None) -> int:
    args, config = parse(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    bridge = L3EventBridge(config.master, args.namespace, args.endpoint, args.replay_endpoint,
                           args.block_size, config.token)
    try:
        bridge.run()
    except KeyboardInterrupt:
        pass
    finally:
        bridge.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
