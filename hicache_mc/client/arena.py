"""Arenas: room a node lends this client, in which its puts place objects themselves.

Without one, a put reserves slots on the node (one round trip) before it can copy, then
commits (another). With one, the put picks the offsets itself, copies (while the master's
Place is on its way, or with no Place at all when the node is the cluster's only one: see
``StoreClient._put_local``), and commits with the offsets: one round trip to the node. The node
checks each commit (offsets ascending from where the last one ended, inside the arena), frees
what the writer skipped, and renews the loan; unused for ``reserve_s``, the arena goes back.

A client holds arenas on the node its puts go to (on its own host), at most two: the one it
fills and the next, and only while its puts stay on that node (where the master spreads them
over several, an arena would be left behind at each move; one on a node the writer moved
away from is given back at once). A put that leaves too little room for another like it asks
for the next arena alongside its own messages (in its commit, when it skips the Place), so
no put waits for one. Asking for about one put's worth
at a time keeps the room a client cycles through small: the node lends it from the free space
it reuses first, often still in the CPU cache. One put uses the arenas at a time (a put that
finds them busy goes the usual way): commits into an arena reach the node in the order its
offsets were taken.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Optional

from .. import protocol as P
from ..errors import HicacheError, ProtocolError
from ..rpc import Channel

log = logging.getLogger(__name__)

LEFT_MIN = 0.25         # an arena with less than this share of its loan left is given back
ASK_WAIT_S = 0.25       # a put waits this long at most for the arena it asked for
MIN_ASK = 1 << 20       # an arena asked for holds the next put like the asking one, or this much
SHORT_S = 10.0          # a node that lent less than asked is not asked for more for this long


def _taken(size: int) -> int:
    return max(P.SLOT_ALIGN, -(-size // P.SLOT_ALIGN) * P.SLOT_ALIGN)


class Arena:
    """One lent region, as this client sees it."""

    def __init__(self, node: P.NodeInfo, reply: P.ArenaReply, sent: float):
        self.node, self.id, self.size = node, reply.arena, reply.size
        self.cursor, self.end = reply.offset, reply.offset + reply.size
        self.covered = reply.offset     # the node's cursor: where the last commit's places ended
        self.ttl = reply.ttl
        self.until = sent + reply.ttl   # on this client's clock (the node's may differ)

    def take(self, taken: list[int]) -> Optional[list[int]]:
        """Offsets for objects taking ``taken`` bytes each, in a row from the cursor; None when
        they do not fit."""
        out, at = [], self.cursor
        for n in taken:
            out.append(at)
            at += n
        if at > self.end:
            return None
        self.cursor = at
        return out


class Use:
    """One put's turn at the arenas: where its objects go (``arena``: None when none had
    room), and the arena it asks for and those it gives back."""

    def __init__(self, node: P.NodeInfo, ch: Channel):
        self.node, self.ch = node, ch
        self.arena: Optional[Arena] = None
        self.offsets: list[int] = []
        self.sums: Optional[list[int]] = None       # checksums once the objects are copied in
        self.want = 0                               # bytes to ask for (0: none)
        self.give_back: list[int] = []              # ids of arenas done with, partly unused
        self.asked: Optional[tuple[int, float]] = None   # (request id, when sent)


class Arenas:
    def __init__(self, limit: int, channel_for: Optional[Callable[[str], Channel]] = None):
        self.limit = limit              # the most bytes asked for per arena (0: never)
        self.lock = threading.Lock()    # held by the put using them, from begin() to end()
        self.held: list[Arena] = []
        self.puts = 0                   # puts that went through an arena
        self.most: dict[str, tuple[int, float]] = {}  # node id -> (what it lent when short, until)
        self.last = ""                  # the node the last turn was for
        self.channel_for = channel_for  # this thread's Channel to a node address

    def begin(self, node: P.NodeInfo, ch: Channel, sizes: list[int]) -> Optional[Use]:
        """A turn for a put of ``sizes`` to ``node`` (``ch``: this thread's channel to it), or
        None (arenas off, the put bigger than one, or another put using them). A turn must be
        ended with ``end``; ``ask`` sends what it asks for and gives back."""
        taken = [_taken(s) for s in sizes]
        need = sum(taken)
        most, until = self.most.get(node.node_id, (need, 0.0))
        if need > self.limit or (need > most and time.monotonic() < until) \
                or not self.lock.acquire(blocking=False):
            return None
        try:
            return self._begin(node, ch, taken, need)
        except BaseException:
            self.lock.release()     # the turn never started: end() will not be called
            raise

    def _begin(self, node: P.NodeInfo, ch: Channel, taken: list[int], need: int) -> Use:
        use = Use(node, ch)
        now = time.monotonic()
        for arena in list(self.held):
            if arena.node is not node or arena.until - now < arena.ttl * LEFT_MIN:
                self._done(arena, use if arena.node is node else None)
                if arena.node.node_id != node.node_id:
                    self._give_back_to(arena)       # the writer moved to another node
        for n, arena in enumerate(self.held):
            offsets = arena.take(taken)
            if offsets is not None:
                for full in self.held[:n]:   # older and too full for this put: done with them
                    self._done(full, use)
                use.arena, use.offsets = arena, offsets
                break
        else:
            for full in list(self.held):     # none has room for it: done with them all
                self._done(full, use)
        # ask for the next put like this one, once puts stay on this node (where the master
        # spreads a host's puts over several nodes, an arena would be left behind each time)
        steady, self.last = self.last == node.node_id, node.node_id
        if steady and len(self.held) < 2 and sum(a.end - a.cursor for a in self.held) < need:
            use.want = min(self.limit, max(need, MIN_ASK))
        return use

    def _give_back_to(self, arena: Arena) -> None:
        """Give ``arena`` back to its node right away (not awaited)."""
        if self.channel_for is None or arena.covered >= arena.end:
            return
        try:
            ch = self.channel_for(arena.node.address)
            ch.forget([ch.send(P.ArenaRequest(0, arena.id))])
        except Exception as exc:        # it lapses there
            log.debug("giving arena %d back to %s failed: %s", arena.id, arena.node.node_id, exc)

    def _done(self, arena: Arena, use: Optional[Use]) -> None:
        """Stop using ``arena``; its unused rest goes back with ``use``'s request (None: the
        node restarted, and it is gone with the old process; or the writer moved to another
        node, and ``_give_back_to`` returns it). One the node dropped itself, at the commit
        that reached its end, is not given back."""
        self.drop(arena)
        if use is not None and arena.covered < arena.end:
            use.give_back.append(arena.id)

    def ask(self, use: Use) -> None:
        """Send the turn's Arena request, unless sent or answered already, and its give-backs
        (not awaited: ``end`` takes the reply)."""
        backs, use.give_back = use.give_back, []
        want = self.lend(use)
        if want or backs:
            sent = time.monotonic()
            rid = use.ch.send(P.ArenaRequest(want, backs.pop() if backs else 0))
            if want:
                use.asked = (rid, sent)
            else:
                use.ch.forget([rid])
        for arena_id in backs:
            use.ch.forget([use.ch.send(P.ArenaRequest(0, arena_id))])

    def lend(self, use: Use) -> int:
        """Bytes the turn still has to ask for: 0 once asked (``ask``) or answered (``lent``).
        An arena commit asks with them (``CommitRequest.lend``), so the next arena costs no
        message of its own."""
        return use.want if use.asked is None else 0

    def lent(self, use: Use, values: list, sent: float, nodes: dict) -> None:
        """Take the arena the commit's reply lent (``CommitReply.lent``, ArenaReply's fields)."""
        want, use.want = use.want, 0        # answered: ``ask`` does not ask again
        try:
            reply = P.build("ArenaReply", values)
        except ProtocolError as exc:
            log.warning("node %s lent an arena this client cannot read: %s", use.node.node_id, exc)
            return
        self._keep(use, reply, want, sent, nodes)

    def end(self, use: Use, nodes: dict) -> None:
        """End the turn: take the arena it asked for (when the node answered in time and its
        record in ``nodes`` is still the one the arena is on)."""
        try:
            if use.asked is None:
                return
            rid, sent = use.asked
            try:
                # reset=False: a late answer must not cost this thread its channel
                reply = P.raise_if_error(use.ch.recv(rid, time.monotonic() + ASK_WAIT_S, reset=False)[0])
            except HicacheError as exc:
                use.ch.forget([rid])
                log.debug("no arena from %s: %s", use.node.node_id, exc)
                return
            self._keep(use, reply, use.want, sent, nodes)
        finally:
            self.lock.release()

    def _keep(self, use: Use, reply: P.ArenaReply, want: int, sent: float, nodes: dict) -> None:
        """Hold the arena lent (when the node's record in ``nodes`` is still the one asked)."""
        if reply.arena and nodes.get(use.node.node_id) is use.node \
                and reply.segment == P.segment_of(use.node):
            self.held.append(Arena(use.node, reply, sent))
        if reply.size < want:   # its cap (1/16 of its DRAM) or its free room: puts bigger
            # than that reserve as usual for a while
            self.most[use.node.node_id] = (reply.size, time.monotonic() + SHORT_S)

    def committed(self, arena: Arena, sent: float, last_offset: int, last_size: int) -> None:
        """A commit sent at ``sent``, whose last object went at ``last_offset``, renewed the
        loan; the node freed whatever of its places that commit did not fill."""
        arena.until = sent + arena.ttl
        arena.covered = last_offset + _taken(last_size)
        self.puts += 1

    def drop(self, arena: Arena) -> None:
        """Forget an arena the node no longer lends (or whose state is in doubt: it lapses)."""
        if arena in self.held:
            self.held.remove(arena)

    def drop_node(self, node: P.NodeInfo) -> None:
        """Forget every arena on ``node``."""
        self.held = [a for a in self.held if a.node is not node]

    def close(self, channel_for) -> None:
        """Give every arena back (a client that closes without this leaves them to lapse)."""
        with self.lock:
            for arena in self.held:
                if arena.covered >= arena.end:
                    continue        # the node dropped it at the commit that filled it
                try:
                    ch = channel_for(arena.node.address)
                    ch.recv(ch.send(P.ArenaRequest(0, arena.id)), time.monotonic() + ASK_WAIT_S)
                except HicacheError:
                    pass
            self.held.clear()
