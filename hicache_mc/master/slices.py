"""A wide request to the master, worked in slices of keys across loop turns.

Exists, Contains, Locate and Place name up to MAX_KEYS keys, in as many namespaces: one such
request cost the master's loop ~1 s in one go (131,072 keys, a namespace each). ``run`` cuts
it into requests of ``SLICE`` keys, has the handler answer each, yields between them (the
service's backlog runs one slice a step and reads its socket, with the nodes' heartbeats and
reports, between steps: server.py, backlog.py) and merges the answers into the reply the
whole request would have had. The handlers do not know: each slice is checked (tenant) and
answered as a request of its own, from the index and live nodes of that moment; an error
answers the whole request, and an Exists stops at the first slice whose run ends early. A
Place's slices after the first start chains of their own (an SGLang backup is 256 keys at most:
only a Place of more than SLICE keys, which no SGLang batch is, is cut).
"""
from __future__ import annotations

from typing import Callable, Generator

import msgspec

from .. import protocol as P

# Keys a slice handles. Measured on the 2-core VM: ~0.3 ms a slice for keys of one namespace,
# ~8 ms for keys in as many namespaces (a request's turn is then about one slice).
SLICE = 1024
# the fields cut per key, per request type
SLICED = {P.ExistsRequest: ("keys",), P.ContainsRequest: ("keys",), P.LocateRequest: ("keys",),
          P.PlaceRequest: ("keys", "sizes")}

Work = Generator[None, None, P.Message]


def wide(msg: P.Message) -> bool:
    """Whether ``msg`` is a request to work in slices."""
    return type(msg) in SLICED and len(msg.keys) > SLICE


def run(msg: P.Message, answer: Callable[[P.Message], P.Message]) -> Work:
    """The reply to ``msg``, from ``answer(part)`` of each slice of it, one slice a step."""
    fields = SLICED[type(msg)]
    merged = _Merged(type(msg))
    for start in range(0, len(msg.keys), SLICE):
        if start:
            yield
        part = msgspec.structs.replace(msg, **{f: getattr(msg, f)[start:start + SLICE] for f in fields})
        if isinstance(msg, P.PlaceRequest):     # (a Place of > SLICE keys is no SGLang batch)
            part = msgspec.structs.replace(part, hot=max(0, msg.hot - start),
                                           parent=msg.parent if not start else "")
        reply = answer(part)
        if isinstance(reply, P.ErrorReply):
            return reply
        if not merged.add(reply, len(part.keys)):
            break
    return merged.reply()


class _Merged:
    """The slices' replies so far, as one (column-wise, like the replies themselves)."""

    def __init__(self, kind: type):
        self.kind = kind
        self.count = 0
        self.pos: dict[str, int] = {}     # node id -> its index in the merged held_by
        self.holders: list[int] = []
        self.sizes: list[int] = []
        self.nodes: dict = {}
        self.flags: list = []             # ContainsReply.present / PlaceReply.targets

    def add(self, r: P.Message, asked: int) -> bool:
        """Take a slice's reply to ``asked`` keys; False when the whole answer is complete
        (an Exists whose run ended in this slice)."""
        if isinstance(r, P.ContainsReply):
            self.flags += r.present
            return True
        if isinstance(r, P.PlaceReply):
            self.flags += r.targets
            self.nodes.update(r.nodes)
            return True
        remap = [self.pos.setdefault(n, len(self.pos)) for n in r.held_by]
        if remap == list(range(len(remap))):
            self.holders += r.holders       # (the usual slices: the same nodes, in order)
        else:
            self.holders += [remap[h] if h >= 0 else -1 for h in r.holders]
        self.sizes += r.sizes
        self.nodes.update(r.nodes)
        if isinstance(r, P.ExistsReply):
            self.count += r.count
            return r.count == asked
        return True

    def reply(self) -> P.Message:
        if self.kind is P.ContainsRequest:
            return P.ContainsReply(self.flags)
        if self.kind is P.PlaceRequest:
            return P.PlaceReply(self.flags, self.nodes)
        held_by = list(self.pos)
        if self.kind is P.ExistsRequest:
            return P.ExistsReply(self.count, held_by, self.holders, self.sizes, self.nodes)
        return P.LocateReply(held_by, self.holders, self.sizes, self.nodes)
