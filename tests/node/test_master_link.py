"""The node's link to the master: a master that refuses request after request is logged once
per cause and then at most once a minute with the count, not once per refusal."""
from __future__ import annotations

import logging

import zmq

from hicache_mc import protocol as P
from hicache_mc.config import NodeConfig
from hicache_mc.node.master_link import MasterLink


def test_refusals_by_the_master_are_logged_once_per_cause_then_counted(caplog):
    ctx = zmq.Context()
    master = ctx.socket(zmq.ROUTER)
    port = master.bind_to_random_port("tcp://127.0.0.1")
    info = P.NodeInfo("n1", "tcp://127.0.0.1:1", "h", "/dev/shm/none", 1 << 20)
    link = MasterLink(ctx, NodeConfig(master=f"tcp://127.0.0.1:{port}"), info, lambda *a: None)
    try:
        for attempt in range(100):          # registers once connected: the master learns its id
            link.tick(attempt * 10.0, lambda: [], lambda: {})
            if master.poll(100):
                break
        ident = master.recv_multipart()[0]
        with caplog.at_level(logging.WARNING, logger="hicache_mc.node.master_link"):
            for i in range(200):
                code = "busy" if i % 2 else "unknown_node"
                master.send_multipart([ident, P.encode(P.ErrorReply(code, "no"), i + 1)])
                assert link.sock.poll(5000)
                link.on_readable()
        said = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
        assert len(said) == 2 and any("busy" in s for s in said) and any("unknown_node" in s for s in said)
    finally:
        link._link.close()
        link.sock.close(0)
        master.close(0)
        ctx.term()
