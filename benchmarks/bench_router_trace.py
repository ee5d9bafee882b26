"""The conductor side by side with SGLang's router (sglang-router, ``cache_aware``), in front of
the same stand-in SGLang workers, replaying the FAST'25 conversation trace in scaled real time.

    .venv/bin/python benchmarks/bench_router_trace.py [--requests 600] [--workers 4]
        [--speed 2] [--time-scale 4] [--routers conductor,sglang-router]

Each router gets a fresh fleet of stand-in workers (tests/conductor/standin: SGLang's HTTP API
and KV events, prefill and decode timed by ``perf.PerfModel``, an H100 running Llama-3-8B,
slowed ``--time-scale`` times so that this host's Python keeps up; GPU pool 400k tokens, host
pool twice that, one shared hicache-mc store as L3) and a fresh store. The trace's requests
are sent at their timestamps / ``--speed``, as chat completions whose messages are the
trace's 512-token blocks (a block id is always the same text, so prefixes are shared as the
trace shares them), streamed, ``max_tokens`` the trace's output length capped at
``--max-tokens``.

Per router: goodput (requests served within both SLOs per second of the arrival span), SLO
attainment, TTFT p50 / p90 / p99, mean TBT, and the router's own CPU per request (its
process's CPU time over the run / requests); for the conductor, the error of its predicted
TTFT (measured minus ``X-Conductor-Predicted-TTFT``, p50 / p90 / p99). SLOs are the fleet simulator's
(benchmarks/fleet/sim.py): TTFT = 1 s + 3 x the prompt's cold prefill alone, TBT = 0.1 s,
both x ``--time-scale``; the conductor is told each request's TTFT SLO in a header and runs
with admission ``--admission`` (off by default: routing alone is compared).
Prints a table and writes benchmarks/results/bench_router_trace.json.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

import aiohttp

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "tests", "conductor"))
sys.path.insert(0, os.path.join(ROOT, "tests"))
from common import pct, table, write_json  # noqa: E402
from harness import StandinFleet  # noqa: E402
from procs import Store, free_port  # noqa: E402

from hicache_mc.conductor.perf import L1_TOKENS, PerfModel  # noqa: E402

TRACE = os.path.join(HERE, "data", "mooncake-fast25", "conversation_trace.jsonl.xz")
BLOCK = 512
PAGE = 64
NAMESPACE = "b3c4b3c4b3c4b3c4"


def load_trace(n: int) -> list[dict]:
    import lzma
    out = []
    with lzma.open(TRACE, "rt") as f:
        for line in f:
            out.append(json.loads(line))
            if len(out) >= n:
                break
    return sorted(out, key=lambda r: r["timestamp"])


class Blocks:
    """A trace block id -> the same ~512-token text every time."""

    def __init__(self, tokenizer_dir: str):
        from hicache_mc.conductor.prompts import PromptTokenizer
        from tokenizer import text, words
        self.vocab, self.text = words(20000, seed=11), text
        tok = PromptTokenizer(tokenizer_dir)
        self.per_word = len(tok.text(text(4000, 1, self.vocab))) / 4000

    def messages(self, r: dict) -> list[dict]:
        ids, n = r["hash_ids"], r["input_length"]
        msgs = []
        for i, b in enumerate(ids):
            tokens = BLOCK if i < len(ids) - 1 else max(8, n - BLOCK * (len(ids) - 1))
            msgs.append({"role": "user" if i % 2 == 0 else "assistant",
                         "content": self.text(max(1, int(tokens / self.per_word) - 6), 10_000_000 + b,
                                              self.vocab)})
        if msgs[-1]["role"] != "user":
            msgs.append({"role": "user", "content": "go on"})
        return msgs


async def one(session, url: str, r: dict, msgs: list, cap: int, slo: tuple, at: float,
              results: list) -> None:
    await asyncio.sleep(max(0.0, at - time.monotonic()))
    body = {"model": "standin-model", "messages": msgs, "max_tokens": min(cap, r["output_length"]),
            "stream": True}
    start = time.monotonic()
    first = last = None
    predicted = float("nan")
    tokens = 0
    status = 0
    try:
        async with session.post(url + "/v1/chat/completions", json=body,
                                headers={"X-Conductor-TTFT-SLO": f"{slo[0]:.3f}",
                                         "X-Conductor-TBT-SLO": f"{slo[1]:.3f}"}) as resp:
            status = resp.status
            predicted = float(resp.headers.get("X-Conductor-Predicted-TTFT", "nan"))
            async for line in resp.content:
                if line.startswith(b"data: {") and b'"content"' in line:
                    now = time.monotonic()
                    first = first or now
                    last = now
                    tokens += 1
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        status = f"{type(exc).__name__}"
    results.append({"status": status, "ttft": None if first is None else first - start,
                    "predicted": predicted,
                    "tbt": (last - first) / (tokens - 1) if tokens > 1 else 0.0,
                    "tokens": tokens, "slo": slo, "arrival": at})


def summarize(results: list, span_s: float, cpu_s: float) -> dict:
    ok = [x for x in results if x["status"] == 200 and x["ttft"] is not None]
    good = [x for x in ok if x["ttft"] <= x["slo"][0] and x["tbt"] <= x["slo"][1]]
    ttfts = [x["ttft"] for x in ok] or [float("nan")]
    errors = [x["ttft"] - x["predicted"] for x in ok if x["predicted"] == x["predicted"]]
    return {"requests": len(results), "served": len(ok), "rejected": sum(x["status"] == 429 for x in results),
            "failed": len(results) - len(ok) - sum(x["status"] == 429 for x in results),
            "goodput_rps": len(good) / span_s, "slo_ok": len(good) / len(results),
            "ttft_p50_s": pct(ttfts, 50), "ttft_p90_s": pct(ttfts, 90), "ttft_p99_s": pct(ttfts, 99),
            "tbt_mean_s": sum(x["tbt"] for x in ok) / max(1, len(ok)),
            "router_cpu_ms_per_request": 1e3 * cpu_s / max(1, len(results)),
            # only the conductor predicts (X-Conductor-Predicted-TTFT)
            **({f"ttft_error_p{q}_s": pct(errors, q) for q in (50, 90, 99)} if errors else {})}


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start_router(name: str, port: int, urls: dict, tok: str, store: Store, args, log) -> subprocess.Popen:
    if name == "conductor":
        cmd = [sys.executable, "-m", "hicache_mc.cli", "conductor", "--port", str(port),
               "--worker-urls", *[f"{n}={u}" for n, u in urls.items()], "--tokenizer", tok,
               "--l3-master", store.master, "--l3-namespace", NAMESPACE,
               "--admission", args.admission]
        env = dict(os.environ, HICACHE_MC_CONDUCTOR_L3_BW="10e9", HICACHE_MC_CONDUCTOR_HOST_BW="20e9",
                   HICACHE_MC_CONDUCTOR_KV_BYTES_PER_TOKEN=str(PerfModel().kv_bytes_per_token))
    else:
        cmd = [sys.executable, "-m", "sglang_router.launch_router", "--port", str(port),
               "--worker-urls", *urls.values(), "--policy", "cache_aware", "--log-level", "warn",
               "--prometheus-port", str(free_port())]
        env = dict(os.environ)
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)


async def wait_http(url: str, proc: subprocess.Popen, timeout_s: float = 180) -> None:
    end = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < end:
            if proc.poll() is not None:
                raise RuntimeError(f"router exited ({proc.returncode})")
            try:
                async with s.get(url, timeout=aiohttp.ClientTimeout(total=2)) as r:
                    if r.status == 200:
                        return
            except (aiohttp.ClientError, asyncio.TimeoutError):
                await asyncio.sleep(0.3)        # not listening yet
                continue
            await asyncio.sleep(0.3)
    raise TimeoutError(url)


async def run_router(name: str, args, trace: list, blocks: Blocks, tok: str, tmp: str) -> dict:
    perf = PerfModel()
    where = pathlib.Path(tmp) / f"store-{name}"
    where.mkdir()
    store = Store(where).start()
    workers = [{"name": f"w{i}"} for i in range(args.workers)]
    fleet = StandinFleet(tmp, tok, workers, page_size=PAGE, time_scale=args.time_scale,
                         gpu_pages=L1_TOKENS // PAGE, host_pages=2 * L1_TOKENS // PAGE,
                         l3_master=store.master, l3_namespace=NAMESPACE, host_bw=20e9, l3_bw=10e9)
    fleet.spec["cached_tokenizer"] = True
    fleet.start()
    port = free_port()
    log = open(os.path.join(tmp, f"{name}.log"), "wb")
    proc = start_router(name, port, {n: fleet.url(n) for n in fleet.workers}, tok, store, args, log)
    url = f"http://127.0.0.1:{port}"
    try:
        await wait_http(url + ("/ready" if name == "conductor" else "/health"), proc)
        msgs = [blocks.messages(r) for r in trace]
        slos = [((1.0 + 3 * perf.prefill_s(r["input_length"])) * args.time_scale, 0.1 * args.time_scale)
                for r in trace]
        t0 = time.monotonic() + 1.0
        arrivals = [t0 + (r["timestamp"] - trace[0]["timestamp"]) / 1000 / args.speed for r in trace]
        results: list = []
        cpu0 = cpu_seconds(proc.pid)
        conn = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=600)) as s:
            await asyncio.gather(*(one(s, url, r, m, args.max_tokens, slo, at, results)
                                   for r, m, slo, at in zip(trace, msgs, slos, arrivals)))
        cpu = cpu_seconds(proc.pid) - cpu0
        span = max(arrivals[-1] - arrivals[0], 1e-9)
        return summarize(results, span, cpu)
    finally:
        proc.terminate()
        proc.wait(20)
        log.close()
        fleet.stop()
        store.stop()


async def run(args) -> dict:
    from tokenizer import train
    tmp = tempfile.mkdtemp(prefix="bench-router-trace-")
    tok = train(os.path.join(tmp, "tok"), vocab_size=32000)
    blocks = Blocks(tok)
    trace = load_trace(args.requests)
    rows = []
    for name in args.routers.split(","):
        print(f"{name}: {len(trace)} requests ...", flush=True)
        rows.append({"router": name, **await run_router(name, args, trace, blocks, tok, tmp)})
        print(table(rows[-1:], COLS), flush=True)
    return {"rows": rows, "requests": len(trace), "workers": args.workers, "speed": args.speed,
            "time_scale": args.time_scale, "max_tokens": args.max_tokens, "admission": args.admission,
            "load_avg_1m_at_end": os.getloadavg()[0]}


COLS = [("router", ""), ("goodput_rps", ".2f"), ("slo_ok", ".3f"), ("ttft_p50_s", ".2f"),
        ("ttft_p90_s", ".2f"), ("ttft_p99_s", ".2f"), ("tbt_mean_s", ".3f"), ("rejected", "d"),
        ("failed", "d"), ("router_cpu_ms_per_request", ".2f")]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=600)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--speed", type=float, default=1.0, help="trace time / this")
    ap.add_argument("--time-scale", type=float, default=4.0, help="stand-ins' slowdown of the H100 model")
    ap.add_argument("--max-tokens", type=int, default=64, help="cap on each request's output")
    ap.add_argument("--routers", default="conductor,sglang-router")
    ap.add_argument("--admission", default="off", choices=["off", "early", "predictive"])
    ap.add_argument("--out", default="bench_router_trace.json")
    args = ap.parse_args()
    doc = asyncio.run(run(args))
    print()
    print(table(doc["rows"], COLS))
    print("results:", write_json(args.out, doc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
