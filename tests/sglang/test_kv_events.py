"""The KV-event bridge (hicache_mc/sglang/kv_events.py) against a real master and node: SGLang's
own event wire format, numbered batches, the replay endpoint, and blocks removed by a clear and
by a node that expired."""
from __future__ import annotations

import hashlib
import threading
import time

import msgspec
import numpy as np
import pytest
import zmq
from sglang.srt.disaggregation.kv_events import (AllBlocksCleared, BlockRemoved, BlockStored,
                                                 KVEventBatch)
from sglang.srt.mem_cache.utils import hash_str_to_int64

from hicache_mc.client import StoreClient
from hicache_mc.sglang.kv_events import L3EventBridge
from procs import Cluster, free_port

NS = "0123456789abcdef@t"
DECODE = msgspec.msgpack.Decoder(KVEventBatch)


def page(i: int) -> str:
    """A page hash as SGLang makes them (SHA-256 hex): distinct in its first 16 digits."""
    return hashlib.sha256(i.to_bytes(8, "little")).hexdigest()


@pytest.fixture
def bridged(tmp_path):
    c = Cluster(tmp_path, heartbeat_s=0.2, liveness=3)
    c.env["HICACHE_MC_MASTER_PUBLISH_BEAT_S"] = "0.2"
    c.start_master()
    c.add_node("64MiB")
    c.wait_nodes(1)
    pub, replay = free_port(), free_port()
    bridge = L3EventBridge(c.master, NS, f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}",
                           block_size=16)
    thread = threading.Thread(target=bridge.run, daemon=True)
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, NS.encode())
    sub.connect(f"tcp://127.0.0.1:{pub}")
    time.sleep(0.3)                 # the SUB connected before the first batch
    thread.start()
    assert bridge.synced.wait(10), "the bridge never followed the master"
    yield c, bridge, sub, replay
    bridge.stop()
    thread.join(5)
    bridge.close()
    sub.close(0)
    c.stop()


def receive(sub, until, timeout_s: float = 10.0) -> list[tuple[int, object]]:
    """(seq, event) of the batches received until ``until(events so far)`` holds."""
    got: list = []
    end = time.monotonic() + timeout_s
    while not until([e for _, e in got]):
        assert time.monotonic() < end, f"events so far: {got}"
        if sub.poll(50):
            topic, seq, payload = sub.recv_multipart()
            assert topic == NS.encode()
            batch = DECODE.decode(payload)
            got += [(int.from_bytes(seq, "big"), e) for e in batch.events]
    return got


def put_pages(c: StoreClient, pages: list[int], parts=("k", "v")) -> None:
    keys = [f"{NS}/{page(i)}/{p}" for i in pages for p in parts]
    buf = np.zeros(64, dtype=np.uint8)
    assert all(c.batch_put_from(keys, [buf.ctypes.data] * len(keys), [64] * len(keys)))


def test_stored_and_removed_pages_as_sglang_events_with_replay(bridged):
    cluster, bridge, sub, replay = bridged
    with StoreClient(cluster.master) as c:
        put_pages(c, [1, 2])
        put_pages(c, [3], parts=("k",))     # half a page: not a block the L3 can serve
        live = receive(sub, lambda ev: sum(isinstance(e, BlockStored) for e in ev) >= 2)
        assert isinstance(live[0][1], AllBlocksCleared)     # the bridge starts afresh
        stored = [e for _, e in live if isinstance(e, BlockStored)]
        assert sorted(h for e in stored for h in e.block_hashes) == \
            sorted([hash_str_to_int64(page(1)), hash_str_to_int64(page(2))])
        assert len({hash_str_to_int64(page(i)) for i in (1, 2, 3)}) == 3
        assert all(e.medium == "EXTERNAL" and e.block_size == 16 for e in stored)
        assert c.clear(f"{NS}/{page(1)}/") == 2
        more = receive(sub, lambda ev: any(isinstance(e, BlockRemoved) for e in ev))
        removed = [e for _, e in more if isinstance(e, BlockRemoved)]
        assert [e.block_hashes for e in removed] == [[hash_str_to_int64(page(1))]]
        seqs = [s for s, _ in live + more]
        assert seqs == sorted(seqs) and seqs[0] == 0 and len(set(seqs)) == seqs[-1] + 1
    # a router that missed them asks the replay endpoint from 0: the same batches, then the end
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(f"tcp://127.0.0.1:{replay}")
    try:
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        replayed = []
        while True:
            assert dealer.poll(5000)
            _, topic, seq, payload = dealer.recv_multipart()
            if seq == (-1).to_bytes(8, "big", signed=True):
                break
            replayed += [(int.from_bytes(seq, "big"), e) for e in DECODE.decode(payload).events]
    finally:
        dealer.close(0)
    assert replayed == live + more


def test_a_node_that_expires_takes_its_blocks_with_it(bridged):
    cluster, bridge, sub, _ = bridged
    with StoreClient(cluster.master) as c:
        put_pages(c, [7])
        receive(sub, lambda ev: any(isinstance(e, BlockStored) for e in ev))
    cluster.nodes[0].kill()
    got = receive(sub, lambda ev: any(isinstance(e, BlockRemoved) for e in ev))
    assert [e.block_hashes for _, e in got if isinstance(e, BlockRemoved)] == [[hash_str_to_int64(page(7))]]


def test_the_bridge_reads_its_master_and_secret_as_every_command_does(tmp_path, monkeypatch):
    from hicache_mc.sglang.kv_events import parse
    cred = tmp_path / "teamA.cred"
    cred.write_text("hmc1:client:teamA:" + "ab" * 32 + ":" + "cd" * 32 + "\n")
    monkeypatch.setenv("HICACHE_MC_MASTER", "127.0.0.1:7399")
    _, config = parse(["--namespace", "ns@teamA", "--token-file", str(cred)])
    assert config.master == "tcp://127.0.0.1:7399" and config.token == cred.read_text().strip()
    with pytest.raises(SystemExit):     # a secret is never an argument (argv is public)
        parse(["--namespace", "ns@teamA", "--token", "secret"])


def test_a_bridge_that_cannot_reach_the_publish_port_names_it(tmp_path, caplog):
    import logging
    from rawsock import Forwarder
    caplog.set_level(logging.INFO)
    c = Cluster(tmp_path, heartbeat_s=0.2, liveness=3)
    c.env["HICACHE_MC_MASTER_PUBLISH_BEAT_S"] = "0.2"
    c.start_master()
    c.wait_nodes(0)
    port = free_port()
    fwd = Forwarder(("127.0.0.2", port), ("127.0.0.1", c.port))     # the master port only
    bridge = L3EventBridge(f"tcp://127.0.0.2:{port}", NS, f"tcp://127.0.0.1:{free_port()}")
    thread = threading.Thread(target=bridge.run, daemon=True)
    thread.start()
    try:
        publisher = f"tcp://127.0.0.2:{c.stats()['publish_port']}"
        end = time.monotonic() + 20
        while not [r for r in caplog.records if "silent for" in r.getMessage()]:
            assert time.monotonic() < end, [r.getMessage() for r in caplog.records]
            time.sleep(0.05)
        said = [r.getMessage() for r in caplog.records]
        assert any(m.startswith(f"cannot reach the master's publish port {publisher} "
                                "(publish_port): connection refused") for m in said), said
        silent = next(m for m in said if "silent for" in m)
        assert f": the master's publish port {publisher}: connection refused" in silent, silent
        assert not bridge.synced.is_set()
    finally:
        bridge.stop()
        thread.join(5)
        bridge.close()
        fwd.close()
        c.stop()
