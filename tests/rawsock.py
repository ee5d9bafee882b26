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


class Forwarder:
    """A TCP forwarder from ``listen`` (host, port) to ``target``, for one port only: what a
    firewall or a port-forward that passes the master port and nothing else looks like to a
    client. ``close()`` stops it and its connections."""

    def __init__(self, listen: tuple[str, int], target: tuple[str, int]):
        import selectors
        import threading
        self.target = target
        self.server = socket.create_server(listen)
        self.server.setblocking(False)
        self.sel = selectors.DefaultSelector()
        self.sel.register(self.server, selectors.EVENT_READ, None)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            for key, _ in self.sel.select(0.05):
                if key.data is None:
                    conn, _ = self.server.accept()
                    try:
                        peer = socket.create_connection(self.target)
                    except OSError:         # nothing listens there (yet): as a refusal
                        conn.close()
                        continue
                    for a, b in ((conn, peer), (peer, conn)):
                        self.sel.register(a, 1, b)
                    continue
                try:
                    data = key.fileobj.recv(1 << 16)
                except OSError:
                    data = b""
                if data:
                    key.data.sendall(data)
                else:
                    for s in (key.fileobj, key.data):
                        self.sel.unregister(s)
                        s.close()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        for key in list(self.sel.get_map().values()):
            key.fileobj.close()
        self.sel.close()


def stream_login(address: str, cred, rcvbuf: int = 0) -> socket.socket:
    """A stream-port connection (``host:port``) that has passed the handshake as ``cred``
    (an ``auth.Credential``); ``rcvbuf``: a receive buffer this small (set before connecting,
    so the window stays small), to stall a transfer by not reading."""
    from hicache_mc.transport.stream import _answer

    host, port = address.rsplit(":", 1)
    s = socket.socket()
    if rcvbuf:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.settimeout(5)
    s.connect((host, int(port)))
    hello = recv_exact(s, 33)
    s.sendall(_answer(cred.claim, cred.seed, hello[1:]))
    verdict = recv_exact(s, 1)
    assert verdict == b"\0", verdict
    return s


def stream_header(op: str, segment: str, ranges: list) -> bytes:
    """A stream-port request header as the wire format says (length, then msgpack)."""
    import struct

    import msgpack

    from hicache_mc.transport.stream import STREAM_VERSION

    body = msgpack.packb({"v": STREAM_VERSION, "op": op, "segment": segment, "ranges": ranges})
    return struct.pack("!I", len(body)) + body


def recv_until_closed(s: socket.socket, most: int, idle_s: float = 15.0) -> bytes:
    """What ``s`` still delivers (at most ``most`` bytes) until the peer closes it or sends
    nothing for ``idle_s``."""
    out = bytearray()
    s.settimeout(idle_s)
    while len(out) < most:
        try:
            part = s.recv(min(1 << 20, most - len(out)))
        except (socket.timeout, ConnectionResetError):
            break
        if not part:
            break
        out += part
    return bytes(out)
