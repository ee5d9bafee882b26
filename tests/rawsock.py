"""Raw-socket helpers for tests that speak to a port byte by byte."""
from __future__ import annotations

import socket
import time


def recv_exact(s: socket.socket, n: int) -> bytes:
    """Exactly ``n`` bytes from ``s``; ConnectionError if it closes first."""
    out = b""
    while len(out) < n:
        part = s.recv(n - len(out))
        if not part:
            raise ConnectionError(f"closed after {len(out)} of {n} bytes")
        out += part
    return out


def closed_within(s: socket.socket, seconds: float) -> bool:
    """Whether the peer closes ``s`` within ``seconds`` (whatever it sends first is skipped)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        s.settimeout(max(0.001, end - time.monotonic()))
        try:
            if not s.recv(1 << 16):
                return True
        except socket.timeout:
            return False
        except ConnectionResetError:
            return True
    return False
