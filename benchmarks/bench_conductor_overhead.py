"""The conductor's own cost per request, against SGLang's router (sglang-router, Rust) in the
same run: what each adds to a request's latency, and how many requests it routes a second on
one core.

    .venv/bin/python benchmarks/bench_conductor_overhead.py [--rounds 5] [--quick]

Both routers run pinned to core 0 in front of one fake worker (a raw asyncio server that
answers at once, on the other core, with the load generator): what is measured is the
router. Per round and router, sequential requests (medians):

- ``chat_cold``: a chat completion with an 8k-token prompt never seen before (the conductor
  encodes one window of it before routing, reach.py, and the rest on a thread once the
  request has gone: on the one core it is pinned to, the next request waits for that);
- ``chat_warm``: the same 8k-token conversation with a new last turn each time (its earlier
  turns are in the conductor's piece cache, as in a conversation or an agent loop);
- ``generate_ids``: ``/generate`` with 8k ``input_ids`` (no tokenization);

each as the router's p50 minus the worker's own p50 (straight to it, the same bodies), and
``rps``: requests/s of short chat completions over 64 connections. The conductor runs with
the served model's tokenizer (here one trained locally: tests/conductor/tokenizer.py, 32k
vocabulary) and its scheduling core; SGLang's router with ``cache_aware``, its default.
Prints a table and writes benchmarks/results/bench_conductor_overhead.json.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests", "conductor"))
from bench_proxy import _content_length, free_port, sequential, throughput  # noqa: E402
from common import pct, table, write_json  # noqa: E402

PROMPT_TOKENS = 8192
REPLY = json.dumps({"id": "c1", "object": "chat.completion", "model": "m", "choices": [
    {"index": 0, "message": {"role": "assistant", "content": "x" * 256}, "finish_reason": "length"}],
    "usage": {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": 64}}).encode()
GETS = {b"/health": b"", b"/health_generate": b"", b"/v1/models": json.dumps(
    {"object": "list", "data": [{"id": "m", "object": "model"}]}).encode(),
    b"/server_info": json.dumps({"page_size": 64, "max_total_num_tokens": 400000,
                                  "model_path": "m"}).encode(),
    b"/get_server_info": json.dumps({"page_size": 64, "model_path": "m"}).encode(),
    b"/get_model_info": json.dumps({"model_path": "m", "is_generation": True}).encode()}
LOADS = json.dumps({"loads": [{"dp_rank": 0, "num_running_reqs": 0, "num_waiting_reqs": 0,
                               "num_waiting_uncached_tokens": 0, "num_used_tokens": 0,
                               "token_usage": 0.0, "timestamp": 0}]}).encode()


class FakeWorker(asyncio.Protocol):
    """Answers every POST with REPLY at once; GETs with what a router asks a worker."""

    def connection_made(self, transport):
        self.t, self.buf = transport, b""

    def data_received(self, data):
        self.buf += data
        while (end := self.buf.find(b"\r\n\r\n")) >= 0:
            head = self.buf[:end].lstrip(b"\r\n")
            length = _content_length(head)
            if len(self.buf) < end + 4 + length:
                return
            self.buf = self.buf[end + 4 + length:]
            words = head.split(b" ", 2)
            if len(words) < 2:
                self.t.write(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
                continue
            method, path = words[0], words[1].split(b"?")[0]
            body = REPLY if method == b"POST" else LOADS if path == b"/v1/loads" else GETS.get(path)
            if body is None:
                self.t.write(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")
            else:
                self.t.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
                             + str(len(body)).encode() + b"\r\n\r\n" + body)


class Workload:
    """The request bodies: 8k-token chats (new ones, and one conversation's next turns),
    8k-token id lists, short chats."""

    def __init__(self, tokenizer_dir: str, n: int):
        from hicache_mc.conductor.prompts import PromptTokenizer
        from tokenizer import text, words
        self.vocab = words(20000, seed=11)
        tok = PromptTokenizer(tokenizer_dir)
        per_word = len(tok.text(text(4000, 1, self.vocab))) / 4000
        self.words = int(PROMPT_TOKENS / per_word)
        self.n, self.text = n, text
        mk = self._chat
        history = [{"role": "system", "content": text(self.words // 2, 7, self.vocab)},
                   {"role": "user", "content": text(self.words // 2 - 40, 8, self.vocab)},
                   {"role": "assistant", "content": "noted"}]
        self.warm = [mk(history + [{"role": "user", "content": text(30, 5000 + i, self.vocab)}])
                     for i in range(n)]
        import random
        rng = random.Random(3)
        self.ids = [json.dumps({"model": "m", "input_ids": [rng.randrange(100, 30000) for _ in
                                                            range(PROMPT_TOKENS)],
                                "sampling_params": {"max_new_tokens": 64}}).encode() for _ in range(n)]
        self.small = [mk([{"role": "user", "content": text(12, 9000 + i, self.vocab)}])
                      for i in range(512)]
        self.tokens = len(tok.chat(json.loads(self.cold(0)[0])))

    @staticmethod
    def _chat(msgs: list) -> bytes:
        return json.dumps({"model": "m", "messages": msgs, "max_tokens": 64}).encode()

    def cold(self, r: int) -> list[bytes]:
        """Round ``r``'s never-seen 8k-token chats."""
        return [self._chat([{"role": "user", "content": self.text(self.words, 1000 + 1000 * r + i,
                                                                  self.vocab)}])
                for i in range(self.n)]


def pinned(cmd: list[str], log) -> subprocess.Popen:
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                            preexec_fn=lambda: os.sched_setaffinity(0, {0}))


async def wait_ready(port: int, path: str, proc: subprocess.Popen, timeout_s: float = 120) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"router exited ({proc.returncode})")
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 2)
            writer.close()
            if b" 200 " in head.split(b"\r\n")[0]:
                return
        except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError):
            await asyncio.sleep(0.2)            # not listening yet
            continue
        await asyncio.sleep(0.2)
    raise TimeoutError(f"router on {port} not ready")


async def run(args) -> dict:
    others = set(range(os.cpu_count() or 1)) - {0}
    if others:
        os.sched_setaffinity(0, others)
    tmp = tempfile.mkdtemp(prefix="bench-overhead-")
    from tokenizer import train
    tok_dir = train(os.path.join(tmp, "tok"), vocab_size=32000)
    wl = Workload(tok_dir, args.n)
    wport = free_port()
    server = await asyncio.get_running_loop().create_server(FakeWorker, "127.0.0.1", wport)
    worker = f"http://127.0.0.1:{wport}"
    ports = {"conductor": free_port(), "sglang-router": free_port()}
    log = open(os.path.join(tmp, "routers.log"), "wb")
    procs = {
        "conductor": pinned([sys.executable, "-m", "hicache_mc.cli", "conductor", "--port",
                             str(ports["conductor"]), "--worker-urls", f"w0={worker}",
                             "--tokenizer", tok_dir], log),
        "sglang-router": pinned([sys.executable, "-m", "sglang_router.launch_router", "--port",
                                 str(ports["sglang-router"]), "--worker-urls", worker,
                                 "--policy", "cache_aware", "--log-level", "warn",
               "--prometheus-port", str(free_port())], log)}
    try:
        await wait_ready(ports["conductor"], "/ready", procs["conductor"])
        await wait_ready(ports["sglang-router"], "/health", procs["sglang-router"])
        rounds: dict = {name: [] for name in ports}
        cases = [("chat_cold", "/v1/chat/completions", None), ("chat_warm", "/v1/chat/completions", wl.warm),
                 ("generate_ids", "/generate", wl.ids)]
        for name, port in ports.items():                # warm-up: connections, caches
            await sequential(port, "/v1/chat/completions", wl.small[:20] + wl.warm[:3])
        for r in range(args.rounds):
            for name, port in ports.items():
                row = {}
                for case, path, bodies in cases:
                    bodies = bodies or wl.cold(r)
                    direct = await sequential(wport, path, bodies)
                    via = await sequential(port, path, bodies)
                    row[case + "_ms"] = (pct(via, 50) - pct(direct, 50)) * 1e3
                row["rps"] = await throughput(port, "/v1/chat/completions", wl.small, 64, args.seconds)
                rounds[name].append(row)
            print(f"round {r + 1}/{args.rounds}", flush=True)
        rows = [{"router": name, **{k: statistics.median(x[k] for x in rounds[name]) for k in rounds[name][0]}}
                for name in ports]
        return {"rows": rows, "rounds": rounds, "prompt_tokens": wl.tokens, "n": args.n,
                "seconds": args.seconds, "load_avg_1m_at_end": os.getloadavg()[0]}
    finally:
        for p in procs.values():
            p.terminate()
            p.wait(15)
        server.close()
        log.close()


COLS = [("router", ""), ("chat_cold_ms", ".2f"), ("chat_warm_ms", ".2f"), ("generate_ids_ms", ".2f"),
        ("rps", ".0f")]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("-n", type=int, default=40, help="sequential requests per case and round")
    ap.add_argument("--seconds", type=float, default=3.0, help="throughput run per round")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.n, args.seconds = 1, 8, 1.0
    doc = asyncio.run(run(args))
    print(table(doc["rows"], COLS))
    if not args.quick:
        print("results:", write_json("bench_conductor_overhead.json", doc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
