"""rpc.Channel against a real master: several requests in flight, replies in any order."""
from __future__ import annotations

import time

import zmq

from hicache_mc import protocol as P
from hicache_mc.rpc import Channel
from procs import Cluster


def test_replies_to_requests_in_flight_are_taken_in_any_order(tmp_path):
    c = Cluster(tmp_path)
    c.start_master()
    ch = Channel(zmq.Context.instance(), c.master)
    try:
        c.wait_nodes(0)
        first = ch.send(P.StatsRequest())
        second = ch.send(P.ExistsRequest(["any/key"]))
        deadline = time.monotonic() + 5.0
        # the master answers in order: waiting for the second reply reads the first one
        assert isinstance(ch.recv(second, deadline), P.ExistsReply)
        assert isinstance(ch.recv(first, deadline), P.StatsReply)
    finally:
        ch.close()
        c.stop()
