"""A prompt encoded as far as any cache could serve it; the rest after the request has gone.

Routing needs a prompt's page chain only as far as some worker or the L3 holds it: past the
first page held nowhere, no page can be a hit (a chain is a prefix). A long piece of text
the piece cache has not seen (a conversation's new turn, a pasted document) is therefore
encoded a window at a time, and only while every page so far is held somewhere; what is
left is encoded once the request has gone to its worker, on a thread of its own (``warm``:
the next turn of the conversation will need it), and its length meanwhile estimated from
the characters per token of the part encoded.

A cold 8k-token prompt then costs one window's encoding before routing (measured in
benchmarks/bench_conductor_overhead.py), not the whole prompt's (5-15 ms on this host).
Windows start at ``WINDOW`` characters and grow 4x while their pages are held.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

from .prompts import PromptTokenizer

WINDOW = 2048          # characters: ~500 tokens of English, ~8 pages of 64


class Routed(NamedTuple):
    ids: list              # the prompt's ids, or their start when not complete
    complete: bool
    tokens: int            # the prompt's length (estimated when not complete)
    rest: list             # pieces still to encode (warm), when not complete


def encode(prompts: PromptTokenizer, pieces: list, held: Callable[[list], int],
           page_size: int) -> Routed:
    """``pieces`` (``PromptTokenizer.pieces``) encoded as far as ``held(ids)`` (the number of
    leading pages of ``ids`` some cache holds) says more could matter."""
    ids: list = []
    for i, piece in enumerate(pieces):
        if isinstance(piece, int):
            ids.append(piece)
            continue
        known = prompts.known(piece)
        if known is None and len(piece) > 2 * WINDOW and prompts.partial:
            cut = _reach(prompts, piece, ids, held, page_size)
            if cut is not None:
                head, used = cut
                rest = [piece[used:]] + pieces[i + 1:]
                return Routed(ids + head, False, len(ids) + len(head) + _estimate(rest, head, used),
                              [piece] + pieces[i + 1:])
        ids.extend(known if known is not None else prompts.ids(piece))
    return Routed(ids, True, len(ids), [])


def _reach(prompts, piece: str, ids: list, held, page_size: int):
    """(head ids, characters) of ``piece`` where its pages stop being held; None when they
    are held to the end (the caller encodes it whole)."""
    chars = WINDOW
    while chars < len(piece):
        head, used = prompts.head(piece, chars)
        if not used:
            return None
        if held(ids + head) < (len(ids) + len(head)) // page_size:
            return head, used
        chars *= 4
    return None


def _estimate(rest: list, head: list, used: int) -> int:
    """Tokens of the pieces not encoded: ids count one each, text at the head's ratio."""
    per_char = len(head) / used if used else 0.25
    return sum(1 if isinstance(p, int) else int(len(p) * per_char + 0.5) for p in rest)


def warm(prompts: PromptTokenizer, rest: list, loop=None) -> None:
    """Encode what routing skipped into the piece cache: off the loop when given one (the
    request's answer is not held up), else here."""
    if loop is not None:
        prompts.warm(rest, loop)
        return
    for piece in rest:
        if isinstance(piece, str):
            prompts.ids(piece)
