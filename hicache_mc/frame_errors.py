"""Reading a frame that failed to decode, for its error reply: the request id and type name
from its first bytes (constant work), and msgspec's error text split into text and field path."""
from __future__ import annotations

import re
from typing import Optional

import msgpack
import msgspec


def peek(buf) -> tuple[Optional[int], int, str, int]:
    """(version, req_id, type name, length of the message array) from a frame's first 256
    bytes, as far as they can be read (else None, 0, "", 0): constant work, for attributing
    an error to a request."""
    unpacker = msgpack.Unpacker(raw=False, max_buffer_size=256)   # bounds every length too
    unpacker.feed(bytes(memoryview(buf)[:256]))
    got: list = []
    length = 0
    try:
        n = unpacker.read_array_header()
        while len(got) < min(n, 2):
            got.append(unpacker.unpack())
        if n >= 3:
            length = unpacker.read_array_header()
            got.append(unpacker.unpack())
    except (ValueError, TypeError, msgpack.UnpackException):
        pass
    got += [None, None, None][len(got):]
    version, req_id, name = (v if type(v) is t else d
                             for v, t, d in zip(got, (int, int, str), (None, 0, "")))
    return version, req_id, name, length


_ERROR = re.compile(r"(.*?)(?: - at (`key` in )?`\$(.*)`)?", re.S)


def split(exc: msgspec.MsgspecError) -> tuple[str, str]:
    """msgspec's error as (text, path): "Expected `str`, got `int` - at `$[2][1][0]`" gives
    ("expected str, got int", "[2][1][0]"). The text is cut short (it may quote the input)."""
    text, key, path = _ERROR.fullmatch(str(exc)).groups()
    text = text.replace("`", "")[:200]
    return text[:1].lower() + text[1:], (path or "") + (" (a key)" if key else "")
