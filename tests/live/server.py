"""One live SGLang server on CPU (a process group of its own), and N of them started together.

See the package docstring (tests/live/__init__.py) for the API and an example.
"""
from __future__ import annotations

import ctypes
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Mapping, NamedTuple, Optional, Sequence

import requests

from procs import lasting_port

HERE = Path(__file__).resolve().parent
# The stand-ins every server process imports (tests only): the torchvision stub of the
# in-process SGLang tests, an sgl_kernel placeholder and the cpu_hicache plugin.
SERVER_PATH = (HERE.parent / "stubs", HERE / "server_path")
# Imported by SGLang's HTTP server and scheduler, beyond the light list of the in-process
# tests (requirements/sglang-cpu.txt installs both); import name, not distribution name.
SERVER_MODULES = ("fastapi", "uvicorn", "uvloop", "setproctitle", "jsonschema", "xgrammar",
                  "multipart", "interegular", "einops", "soundfile")
PR_SET_PDEATHSIG = 1
# SGLang hashes pages with a torch C++ extension that it compiles on first use (about 30 s
# here). Built once per environment, not in the directory every checkout of the machine shares,
# where their differing sources rebuild it in turn.
TORCH_EXTENSIONS = os.path.join(sys.prefix, "torch_extensions")
_page_hash_built = False


@dataclass(frozen=True)
class ServerOptions:
    """How a server is started. The defaults give HiCache with the L3 on the zero-copy path,
    deterministic enough for byte-exact tests: prefetches wait for every L3 hit, lookups are
    answered by the backend's residency view (its default: the pages it lacks are asked of the
    master, so a page another server wrote just before is found), and the backend gives up on
    a dead store after ``timeout_s``."""
    page_size: int = 16
    mem_layout: str = "page_first_direct"     # or layer_first: what cpu_hicache can move
    prefetch_policy: str = "wait_complete"
    backend_config: Mapping[str, object] = field(
        default_factory=lambda: {"timeout_s": 2.0})
    max_total_tokens: int = 4096              # device (L1) tokens; the host pool holds 2x
    kv_events: bool = False                   # --kv-events-config on two free ports
    metrics: bool = False                     # --enable-metrics: GET /metrics
    extra_args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)


class KVEventsEndpoints(NamedTuple):
    """Where a server publishes its KV events (a ZeroMQ PUB, msgpack ``KVEventBatch``) and
    answers replay requests (a ROUTER), both bound on 127.0.0.1."""
    publisher: str
    replay: str
    topic: str


class Generation(NamedTuple):
    """One ``/generate`` answer, with what the tests read from its ``meta_info``."""
    output_ids: list[int]
    prompt_tokens: int
    cached_tokens: int
    storage_tokens: int                 # of cached_tokens, loaded from the L3
    storage_backend: Optional[str]      # "HiCacheMC" once the L3 served a page
    input_logprobs: list[float]         # from logprob_start_len on (None for position 0)
    output_logprobs: list[float]
    meta: dict


class FirstToken(NamedTuple):
    """One streamed request: time to its first token, and its prompt's cache hits."""
    seconds: float
    cached_tokens: int
    storage_tokens: int


def check_server_modules() -> None:
    """Raise, naming them, when SGLang's server dependencies are not installed."""
    missing = [m for m in SERVER_MODULES if importlib.util.find_spec(m) is None]
    if missing:
        raise RuntimeError(f"SGLang's server needs {', '.join(missing)}: run `make setup` "
                           "(requirements/sglang-cpu.txt)")


def build_page_hash() -> None:
    """Compile SGLang's page hash before the servers start (once per process; a no-op when the
    environment has it): else each server compiles it in its first L3 lookup, the servers of
    a test in turn, while that lookup's request waits."""
    global _page_hash_built
    if _page_hash_built:
        return
    subprocess.run([sys.executable, "-c", "from sglang.srt.mem_cache.utils import get_hash_str; "
                    "get_hash_str([1, 2, 3])"], check=True, timeout=900,
                   env=dict(os.environ, TORCH_EXTENSIONS_DIR=TORCH_EXTENSIONS))
    _page_hash_built = True


def _die_with_parent() -> None:
    """In the child before exec: a SIGKILL when the test process dies, so a crashed or killed
    pytest leaves no server behind (SGLang's own workers follow their launcher)."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


class SGLangServer:
    """``python -m sglang.launch_server`` for ``model`` on CPU with HiCache, the L3 being the
    hicache-mc store at ``master``. Its output goes to ``<workdir>/<name>.log``."""

    def __init__(self, name: str, model: Path, master: str, workdir: Path,
                 options: ServerOptions = ServerOptions()):
        self.name, self.model, self.master, self.options = name, Path(model), master, options
        self.port = lasting_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(workdir) / f"{name}.log"
        self.kv_events: Optional[KVEventsEndpoints] = None
        if options.kv_events:
            self.kv_events = KVEventsEndpoints(f"tcp://127.0.0.1:{lasting_port()}",
                                               f"tcp://127.0.0.1:{lasting_port()}", "kv")
        self.proc: Optional[subprocess.Popen] = None
        self.http = requests.Session()

    def command(self) -> list[str]:
        o = self.options
        config = {"master": self.master, **o.backend_config}
        args = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(self.model),
                "--host", "127.0.0.1", "--port", str(self.port), "--device", "cpu",
                "--attention-backend", "torch_native", "--cuda-graph-backend-decode", "disabled",
                "--cuda-graph-backend-prefill", "disabled", "--random-seed", "0",
                "--max-total-tokens", str(o.max_total_tokens), "--page-size", str(o.page_size),
                "--enable-hierarchical-cache", "--hicache-ratio", "2",
                "--hicache-io-backend", "direct", "--hicache-mem-layout", o.mem_layout,
                "--hicache-storage-backend", "hicache_mc",
                "--hicache-storage-backend-extra-config", json.dumps(config),
                "--hicache-storage-prefetch-policy", o.prefetch_policy, "--enable-cache-report"]
        if self.kv_events:
            args += ["--kv-events-config", json.dumps({
                "publisher": "zmq", "endpoint": self.kv_events.publisher, "bind": True,
                "replay_endpoint": self.kv_events.replay, "topic": self.kv_events.topic})]
        if o.metrics:
            args.append("--enable-metrics")
        return args + list(o.extra_args)

    def environment(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items()
               if not k.startswith("SGLANG_TEST_HICACHE_BACKEND_RANDOM_")}   # fault injection
        path = [str(p) for p in SERVER_PATH] + [p for p in [env.get("PYTHONPATH")] if p]
        env.update(PYTHONPATH=os.pathsep.join(path), PYTHONUNBUFFERED="1",
                   SGLANG_USE_CPU_ENGINE="1", SGLANG_PLUGINS="hicache_mc,cpu_hicache",
                   # two cores shared by every server of a test: one compute thread each
                   OMP_NUM_THREADS="1", TORCH_EXTENSIONS_DIR=TORCH_EXTENSIONS)
        env.update(self.options.env)
        return env

    def start(self) -> "SGLangServer":
        """Start the process group; returns at once (``wait_ready`` waits)."""
        check_server_modules()
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT,
                                         env=self.environment(), start_new_session=True,
                                         preexec_fn=_die_with_parent)
        return self

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def ready(self) -> bool:
        """``GET /health`` answers 200 once the server has warmed up (503 before)."""
        try:
            return self.http.get(f"{self.url}/health", timeout=5).status_code == 200
        except requests.RequestException:
            return False

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM to the whole group (launcher, scheduler, detokenizer), SIGKILL to whatever
        is left after ``timeout_s``."""
        if self.proc is None:
            return
        for sig, wait_s in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(wait_s)
            except subprocess.TimeoutExpired:
                continue
        self.http.close()

    def log(self, tail: int = 6000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-tail:]
        except OSError as exc:
            return f"(no log: {exc})"

    def generate(self, input_ids: Optional[Sequence[int]] = None, text: Optional[str] = None,
                 max_new_tokens: int = 4, logprob_start_len: Optional[int] = None,
                 timeout_s: float = 300.0) -> Generation:
        """One greedy ``POST /generate``; logprobs of the prompt from ``logprob_start_len`` on
        (only the last token's by default: asking from 0 makes SGLang skip the cache)."""
        body = {"sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0},
                "return_logprob": True}
        body.update({"input_ids": list(input_ids)} if input_ids is not None else {"text": text})
        if logprob_start_len is not None:
            body["logprob_start_len"] = logprob_start_len
        r = self.http.post(f"{self.url}/generate", json=body, timeout=timeout_s)
        r.raise_for_status()
        out = r.json()
        meta = out["meta_info"]
        details = meta.get("cached_tokens_details") or {}
        return Generation(out.get("output_ids", []), meta["prompt_tokens"], meta["cached_tokens"],
                          details.get("storage", 0), details.get("storage_backend"),
                          [lp[0] for lp in meta["input_token_logprobs"]],
                          [lp[0] for lp in meta["output_token_logprobs"]], meta)

    def first_token(self, input_ids: Sequence[int], timeout_s: float = 600.0) -> "FirstToken":
        """Stream one greedy token for ``input_ids``: the seconds until the first chunk (the
        time to first token, seen by the client) and what the prompt took from the caches."""
        body = {"input_ids": list(input_ids), "stream": True,
                "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}}
        start = time.perf_counter()
        first, meta = None, {}
        with self.http.post(f"{self.url}/generate", json=body, stream=True,
                            timeout=timeout_s) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if not line.startswith(b"data:") or line.strip() == b"data: [DONE]":
                    continue
                if first is None:
                    first = time.perf_counter() - start
                meta = json.loads(line[len(b"data:"):])["meta_info"]
        details = meta.get("cached_tokens_details") or {}
        return FirstToken(first, meta.get("cached_tokens", 0), details.get("storage", 0))

    def loads(self) -> dict:
        """``GET /v1/loads``: the per-DP-rank load report (queues, memory, ...)."""
        r = self.http.get(f"{self.url}/v1/loads", timeout=30)
        r.raise_for_status()
        return r.json()

    def metrics(self) -> str:
        """``GET /metrics`` (Prometheus text; needs ``ServerOptions(metrics=True)``)."""
        r = self.http.get(f"{self.url}/metrics", timeout=30)
        r.raise_for_status()
        return r.text


def wait_ready(servers: Sequence[SGLangServer], timeout_s: float = 900.0) -> None:
    """Return once every server answers ``/health``; raise with the log of the first that
    exited or did not come up in time."""
    pending = list(servers)
    end = time.monotonic() + timeout_s
    while pending:
        for s in list(pending):
            if not s.alive:
                raise RuntimeError(f"SGLang server {s.name} exited ({s.proc.returncode}); "
                                   f"{s.log_path}:\n{s.log()}")
            if s.ready():
                pending.remove(s)
        if pending and time.monotonic() > end:
            raise TimeoutError(f"SGLang server {pending[0].name} not ready in {timeout_s:.0f} s; "
                               f"{pending[0].log_path}:\n{pending[0].log()}")
        if pending:
            time.sleep(0.5)


@contextmanager
def start_servers(model: Path, master: str, workdir: Path, n: int = 1,
                  options: ServerOptions = ServerOptions(),
                  names: Optional[Sequence[str]] = None) -> Iterator[list[SGLangServer]]:
    """Start ``n`` servers against one store at once, wait until all are ready, yield them,
    and stop every one on the way out, whatever happened (a failed start included)."""
    names = list(names or [f"sglang{i}" for i in range(n)])
    build_page_hash()
    with ExitStack() as stack:
        servers = []
        for name in names:
            server = SGLangServer(name, model, master, workdir, options)
            stack.callback(server.stop)
            servers.append(server.start())
        wait_ready(servers)
        yield servers
