"""Real processes for the conductor's tests: a fleet of stand-in SGLang workers, and
``hicache-mc conductor`` itself, both on 127.0.0.1 with free ports, always stopped."""
from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import time
from typing import Callable, Optional

import requests

HERE = os.path.dirname(os.path.abspath(__file__))
ADMIN_KEY = "test-admin-key"


def wait_for(cond: Callable[[], object], timeout_s: float, what: str, every_s: float = 0.02):
    """``cond()``'s first truthy value within ``timeout_s``; else AssertionError naming ``what``."""
    end = time.monotonic() + timeout_s
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(every_s)


class StandinFleet:
    """``python -m standin SPEC`` (tests/conductor/standin): N workers in one process."""

    def __init__(self, tmp, tokenizer: str, workers: list[dict], **defaults):
        self.tmp, self.tokenizer = tmp, tokenizer
        self.spec = {"tokenizer": tokenizer, "defaults": {"page_size": 16, **defaults},
                     "workers": workers}
        self.p: Optional[subprocess.Popen] = None
        self.workers: dict[str, dict] = {}

    def start(self, timeout_s: float = 120) -> "StandinFleet":
        path = os.path.join(str(self.tmp), f"fleet-{os.getpid()}-{id(self)}.json")
        with open(path, "w") as f:
            json.dump(self.spec, f)
        self.log = open(os.path.join(str(self.tmp), f"fleet-{id(self)}.log"), "wb")
        self.p = subprocess.Popen([sys.executable, "-m", "standin", path], cwd=HERE,
                                  stdout=subprocess.PIPE, stderr=self.log,
                                  env=dict(os.environ, PYTHONUNBUFFERED="1"))
        ready, _, _ = select.select([self.p.stdout], [], [], timeout_s)
        line = self.p.stdout.readline() if ready else b""
        if not line:
            self.stop()
            raise RuntimeError("the stand-in fleet did not start:\n" + self.log_text()[-3000:])
        self.workers = {w["name"]: w for w in json.loads(line)}
        return self

    def log_text(self) -> str:
        with open(self.log.name, errors="replace") as f:
            return f.read()

    def url(self, name: str) -> str:
        return self.workers[name]["url"]

    def control(self, name: str, action: str, **doc) -> dict:
        r = requests.post(f"{self.url(name)}/standin/{action}", json=doc, timeout=10)
        r.raise_for_status()
        return r.json()

    def stats(self, name: str) -> dict:
        return requests.get(f"{self.url(name)}/standin/stats", timeout=10).json()

    def sent(self, name: str, tag: str) -> Optional[bytes]:
        r = requests.get(f"{self.url(name)}/standin/sent/{tag}", timeout=10)
        return r.content if r.status_code == 200 else None

    def stop(self) -> None:
        """SIGKILL: the stand-ins hold nothing worth a clean shutdown (their publishers' own
        take a second each)."""
        if self.p is not None and self.p.poll() is None:
            self.p.kill()
            self.p.wait(10)
        if self.p is not None:
            self.p.stdout.close()
            self.log.close()


class ConductorProc:
    """``hicache-mc conductor`` as a subprocess on a free port, its log in a file."""

    def __init__(self, tmp, port: int, args: list[str], env: Optional[dict] = None):
        self.tmp, self.port, self.args, self.env = tmp, port, args, env or {}
        self.url = f"http://127.0.0.1:{port}"
        key = os.path.join(str(tmp), "admin.key")
        with open(key, "w") as f:
            f.write(ADMIN_KEY)
        self.key = key
        self.p: Optional[subprocess.Popen] = None
        self.log_path = os.path.join(str(tmp), f"conductor-{port}.log")

    def start(self, ready: bool = True, timeout_s: float = 60) -> "ConductorProc":
        log = open(self.log_path, "ab")
        self.p = subprocess.Popen(
            [sys.executable, "-m", "hicache_mc.cli", "-v", "conductor", "--port", str(self.port),
             "--admin-key-file", self.key, *self.args], stdout=log, stderr=subprocess.STDOUT,
            env=dict(os.environ, PYTHONUNBUFFERED="1", HICACHE_MC_CONDUCTOR_SHUTDOWN_GRACE_S="2",
                     **self.env))
        log.close()
        path = "/ready" if ready else "/health"
        try:
            wait_for(lambda: self.p.poll() is not None or self._ok(path), timeout_s,
                     f"the conductor's {path}")
        except AssertionError:
            self.stop()
            raise AssertionError("the conductor did not start:\n" + self.log()[-3000:]) from None
        if self.p.poll() is not None:
            raise AssertionError("the conductor exited:\n" + self.log()[-3000:])
        return self

    def _ok(self, path: str) -> bool:
        try:
            return requests.get(self.url + path, timeout=1).status_code == 200
        except requests.RequestException:
            return False

    def admin(self, method: str, path: str, **kw) -> requests.Response:
        return requests.request(method, self.url + path, timeout=10,
                                headers={"Authorization": f"Bearer {ADMIN_KEY}"}, **kw)

    def workers(self) -> dict:
        return {w["name"]: w for w in self.admin("GET", "/workers").json()["workers"]}

    def metrics(self) -> dict:
        """The conductor's metrics as {name{labels}: value}."""
        out = {}
        for line in requests.get(self.url + "/metrics", timeout=10).text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                out[name] = float(value)
        return out

    def post(self, path: str, doc: dict, **kw) -> requests.Response:
        return requests.post(self.url + path, json=doc, timeout=kw.pop("timeout", 60), **kw)

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def kill(self, sig=signal.SIGKILL) -> None:
        if self.p is not None and self.p.poll() is None:
            self.p.send_signal(sig)
            self.p.wait(15)

    def stop(self) -> None:
        self.kill(signal.SIGTERM)


class Cuttable:
    """A TCP relay from a local port to ``target`` (host, port) that a test can cut: every
    connection through it closes and the port refuses new ones, until ``mend()``."""

    def __init__(self, target: tuple, record: bool = False):
        import threading
        self.target = target
        self.lock = threading.Lock()
        self.conns: list = []
        self.lsock = None
        self.port = 0
        self.record = record
        self.recorded: list[bytearray] = []    # per connection: what the target sent back
        self.mend()

    def mend(self) -> None:
        import socket
        import threading
        lsock = socket.socket()
        lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        lsock.bind(("127.0.0.1", self.port))
        self.port = lsock.getsockname()[1]
        lsock.listen(16)
        self.lsock = lsock
        threading.Thread(target=self._accept, args=(lsock,), daemon=True).start()

    def _accept(self, lsock) -> None:
        import socket
        import threading
        while True:
            try:
                client, _ = lsock.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target)
            except OSError:                      # the target is gone: so is this connection
                client.close()
                continue
            tape = bytearray() if self.record else None
            with self.lock:
                self.conns += [client, upstream]
                if tape is not None:
                    self.recorded.append(tape)
            threading.Thread(target=self._pipe, args=(client, upstream), daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, client, tape), daemon=True).start()

    @staticmethod
    def _pipe(src, dst, tape=None) -> None:
        import socket
        try:
            while data := src.recv(65536):
                if tape is not None:
                    tape += data
                dst.sendall(data)
        except OSError:
            return
        finally:
            for s in (src, dst):     # shutdown first: it wakes the other direction's recv
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
                s.close()

    def cut(self) -> None:
        import socket
        with contextlib.suppress(OSError):            # wakes the thread blocked in accept()
            self.lsock.shutdown(socket.SHUT_RDWR)
        self.lsock.close()
        with self.lock:
            for c in self.conns:
                try:
                    c.shutdown(socket.SHUT_RDWR)
                except OSError:
                    continue
            self.conns.clear()

    def close(self) -> None:
        self.cut()


def http_bodies(raw: bytes) -> list[bytes]:
    """The bodies of the HTTP/1.1 responses one after another in ``raw`` (chunked bodies
    de-chunked), as a client reads them."""
    out, i = [], 0
    while i < len(raw):
        end = raw.index(b"\r\n\r\n", i)
        head = raw[i:end].lower()
        i = end + 4
        if b"transfer-encoding: chunked" in head:
            body = bytearray()
            while True:
                line_end = raw.index(b"\r\n", i)
                size = int(raw[i:line_end].split(b";")[0], 16)
                body += raw[line_end + 2:line_end + 2 + size]
                i = line_end + 2 + size + 2
                if size == 0:
                    break
            out.append(bytes(body))
        else:
            length = next((int(h.split(b":")[1]) for h in head.split(b"\r\n")
                           if h.startswith(b"content-length:")), 0)
            out.append(raw[i:i + length])
            i += length
    return out
