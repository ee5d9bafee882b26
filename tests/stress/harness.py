"""The stress suite's plumbing: profiles, load processes, figures, checks.

``Profile``: how long and how wide a run is. ``short`` runs in CI (a few seconds per
scenario); ``long`` runs when ``HICACHE_MC_STRESS_LONG=1`` (``HICACHE_MC_STRESS_SECONDS`` sets
its load time) and writes its figures to ``benchmarks/results/stress_long.json``.

``Load``: starts ``traffic.py`` client processes against a master, all starting at the same
moment, and collects their results. ``summarize`` turns results into the figures: ops/s,
p50/p99/max per call kind, hit rates, wrong pages, exceptions, hangs. ``readable`` reads
acknowledged objects back and compares every byte.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from typing import Optional

import numpy as np

from hicache_mc import protocol as P
from hicache_mc.client import StoreClient
from procs import Cluster, Proc, request
from traffic import Pages, universe_size

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
RESULTS = os.path.join(ROOT, "benchmarks", "results", "stress_long.json")
LONG = os.environ.get("HICACHE_MC_STRESS_LONG", "") not in ("", "0")


@dataclass(frozen=True)
class Profile:
    name: str
    seconds: float            # load time of one scenario
    processes: int            # client processes (half shm, half tcp)
    threads: int              # threads per client process
    fault_cycles: int         # how many times a fault scenario injects its fault
    fuzz_examples: int        # hypothesis examples per fuzz strategy and target
    fault_seconds: float = 10.0   # load time of one fault scenario
    # the key universe (see traffic.py): sized so both nodes hold it without evicting
    groups: int = 4
    variants: int = 16
    prefix_pages: int = 32
    suffix_pages: int = 96
    page_size: int = 16 << 10
    batch: int = 128
    node_dram: str = "128MiB"
    # every client call must end within timeout_s + LATENCY_SLACK_S
    timeout_s: float = 2.0
    circuit_failures: int = 3
    circuit_open_s: float = 0.5

    @property
    def universe_bytes(self) -> int:
        return universe_size(asdict(self)) * self.page_size


SHORT = Profile("short", seconds=8, processes=2, threads=2, fault_cycles=1, fuzz_examples=150)
_LONG_S = float(os.environ.get("HICACHE_MC_STRESS_SECONDS", 120))
LONG_PROFILE = Profile("long", seconds=_LONG_S, processes=4, threads=3, fault_cycles=4,
                       fuzz_examples=3000, fault_seconds=_LONG_S, groups=8, variants=24,
                       node_dram="256MiB")

# Heartbeats every 0.25 s, dropped after 4 missed: a 1 s liveness window. Wider than the test
# fixtures' 0.6 s because two cores shared by six busy processes delay heartbeats.
HEARTBEAT_S, LIVENESS = 0.25, 4
# Local work after the last deadline (copying and checking 128 pages, the GIL shared with the
# other threads of the process) on a loaded 2-core machine.
LATENCY_SLACK_S = 1.0
# A client process must exit this long after its load time (its threads are then hung).
JOIN_SLACK_S = 10.0


def stress_cluster(tmp_path) -> Cluster:
    return Cluster(tmp_path, heartbeat_s=HEARTBEAT_S, liveness=LIVENESS)


def restart(cluster: Cluster, old: Proc) -> Proc:
    """Start a node again with the same arguments (same port, so the same node id)."""
    new = Proc(old.args, old.log_path, old.env, old.preexec).start()
    new.port, new.address = old.port, old.address
    cluster.nodes[cluster.nodes.index(old)] = new
    return new


def wait_for(pred, timeout_s: float, what: str) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if pred():
            return
        time.sleep(0.05)
    raise TimeoutError(f"{what} did not happen in {timeout_s}s")


# ------------------------------------------------------------------ load processes

class Load:
    """``processes`` traffic.py clients; ``start`` returns the wall time their load begins."""

    def __init__(self, master: str, profile: Profile, workdir, tag: str = "stress",
                 seconds: Optional[float] = None):
        self.master, self.profile, self.dir, self.tag = master, profile, str(workdir), tag
        self.seconds = seconds if seconds is not None else profile.seconds
        self.procs: list[tuple[subprocess.Popen, str]] = []
        self.start_at = 0.0

    def start(self, lead_s: float = 2.0) -> float:
        """Start the clients; their load begins ``lead_s`` from now (imports take a moment)."""
        p = self.profile
        self.start_at = time.time() + lead_s
        for w in range(p.processes):
            cfg = {"worker": w, "master": self.master, "transport": "shm" if w % 2 == 0 else "tcp",
                   "threads": p.threads, "seconds": self.seconds, "seed": 1 + w, "tag": self.tag,
                   "groups": p.groups, "variants": p.variants, "prefix_pages": p.prefix_pages,
                   "suffix_pages": p.suffix_pages, "page_size": p.page_size, "batch": p.batch,
                   "timeout_s": p.timeout_s, "circuit_failures": p.circuit_failures,
                   "circuit_open_s": p.circuit_open_s, "join_slack_s": JOIN_SLACK_S,
                   "start_at": self.start_at}
            cfg_path = os.path.join(self.dir, f"load{w}.json")
            out_path = os.path.join(self.dir, f"load{w}.result.json")
            with open(cfg_path, "w") as f:
                json.dump(cfg, f)
            log = open(os.path.join(self.dir, f"load{w}.log"), "wb")
            proc = subprocess.Popen([sys.executable, os.path.join(HERE, "traffic.py"), cfg_path, out_path],
                                    stdout=log, stderr=subprocess.STDOUT, cwd=self.dir,
                                    env=dict(os.environ, PYTHONUNBUFFERED="1"))
            log.close()
            self.procs.append((proc, out_path))
        return self.start_at

    def since_start(self) -> float:
        return time.time() - self.start_at

    def sleep_until(self, t: float) -> None:
        """Sleep until ``t`` seconds after the load began."""
        time.sleep(max(0.0, t - self.since_start()))

    def finish(self) -> list[dict]:
        """Wait for every client (bounded) and return their results; a missing one is a hang."""
        end = self.start_at + self.seconds + JOIN_SLACK_S + 15
        results = []
        for w, (proc, out) in enumerate(self.procs):
            try:
                proc.wait(max(1.0, end - time.time()))
            except subprocess.TimeoutExpired:
                proc.send_signal(signal.SIGKILL)
                proc.wait(10)
            if not os.path.exists(out):
                with open(os.path.join(self.dir, f"load{w}.log"), errors="replace") as f:
                    tail = f.read()[-3000:]
                results.append({"worker": w, "hung": [f"process exited {proc.returncode}: {tail}"],
                                "counts": {}, "latency_us": {}, "acked": {}, "exceptions": [],
                                "wrong_keys": [], "buckets": {}, "elapsed_s": 0, "client": {}})
                continue
            with open(out) as f:
                results.append(json.load(f))
        return results

    def stop(self) -> None:
        for proc, _ in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)


# ------------------------------------------------------------------ figures

def _pct(values: list[int], q: float) -> float:
    return round(float(np.percentile(values, q)) / 1000, 3) if values else 0.0


def summarize(results: list[dict], seconds: float) -> dict:
    counts: dict[str, int] = {}
    lat: dict[str, list[int]] = {}
    acked: dict[str, float] = {}
    for r in results:
        for k, v in r["counts"].items():
            counts[k] = counts.get(k, 0) + v
        for k, v in r["latency_us"].items():
            lat.setdefault(k, []).extend(v)
        for k, t in r["acked"].items():
            acked[k] = min(t, acked.get(k, t))
    ops = {}
    for op, values in sorted(lat.items()):
        ops[op] = {"calls": len(values), "per_s": round(len(values) / seconds, 1),
                   "p50_ms": _pct(values, 50), "p99_ms": _pct(values, 99),
                   "max_ms": round(max(values) / 1000, 3)}
    c = counts.get
    return {
        "seconds": seconds,
        "clients": len(results),
        "threads": sum(r.get("threads", 0) for r in results),
        "requests": c("requests", 0),
        "requests_per_s": round(c("requests", 0) / seconds, 1),
        "ops": ops,
        "ops_per_s": round(sum(o["calls"] for o in ops.values()) / seconds, 1),
        "pages_read_per_s": round(c("get_hits", 0) / seconds, 1),
        "pages_written_per_s": round(c("put_ok", 0) / seconds, 1),
        "hit_rate": round(c("exists_hits", 0) / max(1, c("exists_keys", 0)), 4),
        "get_hit_rate": round(c("get_hits", 0) / max(1, c("get_pages", 0)), 4),
        "put_ok_rate": round(c("put_ok", 0) / max(1, c("put_pages", 0)), 4),
        "pages_checked": c("get_hits", 0),
        "wrong_pages": c("wrong_pages", 0),
        "exceptions": c("exceptions", 0),
        "hung": sum(len(r["hung"]) for r in results),
        "acked_objects": len(acked),
        "client_errors": sum(r["client"].get("errors", 0) for r in results),
        "circuit_opens": sum(r["client"].get("circuit_opens", 0) for r in results),
        "circuit_rejects": sum(r["client"].get("circuit_rejects", 0) for r in results),
        "put_failed_calls": c("put_failed_calls", 0),
        "checksum_failures": sum(r["client"].get("checksum_failures", 0) for r in results),
        "stale_segment_maps": sum(r["client"].get("stale_segment_maps", 0) for r in results),
        "max_call_ms": max((o["max_ms"] for o in ops.values()), default=0.0),
    }


def acked_keys(results: list[dict], before: Optional[float] = None) -> list[str]:
    """Keys acknowledged by any client (before wall time ``before``, if given)."""
    out = {}
    for r in results:
        for k, t in r["acked"].items():
            if before is None or t < before:
                out[k] = True
    return sorted(out)


def timeline(results: list[dict]) -> list[dict]:
    """Per second of the run: requests, get hit rate, put ok rate (all clients together)."""
    rows: dict[int, dict] = {}
    for r in results:
        shift = int(round(r["t0"] - min(x["t0"] for x in results if "t0" in x)))
        for sec, row in r["buckets"].items():
            dst = rows.setdefault(int(sec) + shift, {})
            for k, v in row.items():
                dst[k] = dst.get(k, 0) + v
    out = []
    for sec in sorted(rows):
        row = rows[sec]
        out.append({"s": sec, "requests": row.get("requests", 0),
                    "put_failed_calls": row.get("put_failed_calls", 0),
                    "get_hit": round(row.get("get_hits", 0) / max(1, row.get("get_pages", 0)), 3),
                    "put_ok": round(row.get("put_ok", 0) / max(1, row.get("put_pages", 0)), 3)})
    return out


def assert_healthy(results: list[dict], summary: dict, profile: Profile) -> None:
    """Zero wrong pages, zero client exceptions, zero hangs, every call bounded."""
    wrong = [k for r in results for k in r["wrong_keys"]]
    assert summary["wrong_pages"] == 0, f"{summary['wrong_pages']} wrong pages, e.g. {wrong[:5]}"
    excs = [e for r in results for e in r["exceptions"]]
    assert summary["exceptions"] == 0, "client raised:\n" + "\n".join(excs[:3])
    hung = [h for r in results for h in r["hung"]]
    assert not hung, "hung:\n" + "\n".join(hung[:3])
    bound_ms = (profile.timeout_s + LATENCY_SLACK_S) * 1000
    assert summary["max_call_ms"] < bound_ms, \
        f"a call took {summary['max_call_ms']} ms (bound {bound_ms} ms): {summary['ops']}"
    assert summary["requests"] > 0 and summary["pages_checked"] > 0, summary


# ------------------------------------------------------------------ reading back

def readable(master: str, keys: list[str], page_size: int, timeout_s: float = 20.0,
             transport: str = "tcp") -> tuple[list[str], list[str]]:
    """(missing, wrong) among ``keys`` after retrying the missing ones for ``timeout_s``
    (re-registration after a restart takes a few heartbeats). Wrong is never retried."""
    pages = Pages(page_size)
    missing, wrong = list(keys), []
    end = time.monotonic() + timeout_s
    with StoreClient(master, transport=transport, timeout_s=5.0, circuit_failures=1000) as c:
        buf = np.empty(128 * page_size, dtype=np.uint8)
        while True:
            still = []
            # batches of 128 first, then each miss of a batch alone before it counts (a miss
            # read alone also tells a store that skips holes from one that stops at them)
            for i in range(0, len(missing), 128):
                batch = missing[i: i + 128]
                buf[: len(batch) * page_size] = 0xA5
                ok = c.batch_get_into(batch, [buf.ctypes.data + j * page_size for j in range(len(batch))],
                                      [page_size] * len(batch))
                wrong += [batch[j] for j in pages.wrong(buf, batch, ok)]
                for j, good in enumerate(ok):
                    if not good:
                        buf[:page_size] = 0xA5
                        one = c.batch_get_into([batch[j]], [buf.ctypes.data], [page_size])
                        if pages.wrong(buf, [batch[j]], one):
                            wrong.append(batch[j])
                        if not one[0]:
                            still.append(batch[j])
            missing = still
            if not missing or time.monotonic() > end:
                return missing, wrong
            time.sleep(0.5)


def put_pages(master: str, keys: list[str], page_size: int) -> list[bool]:
    """Store ``keys`` with their derived content (the pre-loaded set of a fault scenario)."""
    pages = Pages(page_size)
    buf = np.empty(128 * page_size, dtype=np.uint8)
    out = []
    with StoreClient(master, timeout_s=5.0) as c:
        for i in range(0, len(keys), 128):
            batch = keys[i: i + 128]
            pages.fill(buf, batch)
            out += c.batch_put_from(batch, [buf.ctypes.data + j * page_size for j in range(len(batch))],
                                    [page_size] * len(batch))
    return out


def locate(master: str, keys: list[str]) -> dict[str, str]:
    """key -> node address, for the keys the master holds (misses are left out)."""
    out = {}
    for i in range(0, len(keys), 128):
        batch = keys[i: i + 128]
        reply = request(master, P.LocateRequest(batch), 5.0)
        assert isinstance(reply, P.LocateReply), reply
        for k, entry in zip(batch, reply.located()):
            if entry:                                   # None = a key the master does not have
                out[k] = reply.nodes[entry[0]]["address"]
    return out


# ------------------------------------------------------------------ servers

def vm_hwm(pid: int) -> int:
    """Peak resident set of a process, in bytes."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM")


def valid_client_works(c: Cluster, tag: str, within_s: float = 3.0) -> None:
    """A normal client can still put, find and read back a new object."""
    end = time.monotonic() + within_s
    with StoreClient(c.master, timeout_s=1.0, circuit_failures=1000) as client:
        while True:
            key, data = f"fuzz-check/{tag}/{time.monotonic_ns()}", tag.encode() * 100
            if client.put(key, data) and client.exists(key) and client.get(key) == data:
                return
            assert time.monotonic() < end, f"valid client not served after fuzzing {tag}:\n{c.logs()}"
            time.sleep(0.2)


# ------------------------------------------------------------------ recording

def code_version() -> str:
    """The commit under test (+dirty when hicache_mc/ has local changes); overridable by
    HICACHE_MC_STRESS_CODE for a copy of the tree outside git."""
    if os.environ.get("HICACHE_MC_STRESS_CODE"):
        return os.environ["HICACHE_MC_STRESS_CODE"]
    try:
        head = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", ROOT, "status", "--porcelain", "--", "hicache_mc"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (head or "unknown") + ("+dirty" if dirty else "")


def record(section: str, figures: dict, command: str) -> None:
    """Merge one scenario's figures into benchmarks/results/stress_long.json (long runs only)."""
    if not LONG:
        return
    doc = {}
    if os.path.exists(RESULTS):
        with open(RESULTS) as f:
            doc = json.load(f)
    doc.setdefault("scenarios", {})[section] = dict(figures, command=command, code=code_version(),
                                                     recorded_at=time.strftime("%Y-%m-%d %H:%M:%S"))
    doc["machine"] = {"cpus": os.cpu_count(), "python": sys.version.split()[0]}
    tmp = RESULTS + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=2, sort_keys=True)
    os.replace(tmp, RESULTS)


def profile_dict(profile: Profile) -> dict:
    d = asdict(profile)
    d["universe_mib"] = round(profile.universe_bytes / (1 << 20), 1)
    return d

