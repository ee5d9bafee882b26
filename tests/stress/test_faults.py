"""Faults during load: the same checks as the load test, plus durability.

Each scenario starts a master and two nodes, stores a pre-loaded set of pages and notes where
each one lives, then runs the load while it injects its fault ``fault_cycles`` times:

- ``node_kill``: SIGKILL a node (SSD tier, ``durability=sync``) and start it again on its port;
- ``master_kill``: SIGKILL the master and start it again (the nodes rebuild its index);
- ``node_stop``: SIGSTOP a node for longer than the liveness window, then SIGCONT;
- ``disk_full``: fill the tmpfs that holds both nodes' SSD tiers (one ``sync``, one ``async``),
  then free it.

While a node is out, every pre-loaded page on the other node is read back and must be right.
After the run every object any client saw acknowledged must be readable, byte for byte: no
scenario loses a node's memory or disk for good, and the data never needs evicting.
"""
import os
import signal
import subprocess
import time

import pytest

from harness import (LONG_PROFILE, Load, acked_keys, assert_healthy, locate, profile_dict, put_pages,
                     readable, record, restart, summarize, timeline, wait_for)
from traffic import universe

TIMEOUT_S = max(300, int(LONG_PROFILE.fault_seconds * 2 + 180))
SEED_CHAINS, SPARE_CHAINS, CHAIN_PAGES = 2, 6, 128
MiB = 1 << 20


def seed_chains() -> list[list[str]]:
    """Distinct prefix chains (no shared prefix), each one Place: placement keeps it on one node."""
    return list(universe(1, SEED_CHAINS + SPARE_CHAINS, 0, CHAIN_PAGES, "seed").values())


class Scenario:
    """Runs the load, calls ``inject`` / ``restore`` on a schedule, keeps the record."""

    def __init__(self, cluster, profile, tmp_path, name):
        self.cluster, self.profile, self.tmp, self.name = cluster, profile, tmp_path, name
        self.events: list[dict] = []
        self.seeds: list[str] = []
        self.where: dict[str, str] = {}
        self.outage_checks: list[dict] = []

    def preload(self) -> None:
        """Store SEED_CHAINS chains, and spare ones until both nodes hold some: a new chain goes
        to the node with most room, unless the other is late with its heartbeat (a loaded host)."""
        for i, chain in enumerate(seed_chains()):
            ok = put_pages(self.cluster.master, chain, self.profile.page_size)
            assert all(ok), f"{ok.count(False)} pre-loaded pages were not stored"
            self.seeds += chain
            self.where = locate(self.cluster.master, self.seeds)
            assert len(self.where) == len(self.seeds)
            if i + 1 >= SEED_CHAINS and len(set(self.where.values())) == 2:
                return
        raise AssertionError(f"{len(self.seeds) // CHAIN_PAGES} chains all went to one node")

    def event(self, load: Load, what: str) -> None:
        self.events.append({"t": round(load.since_start(), 2), "event": what})

    def check_survivor(self, load: Load, down_address: str) -> None:
        """Every pre-loaded page on the nodes still up is readable while ``down_address`` is out."""
        keys = [k for k, a in self.where.items() if a != down_address]
        t0 = time.monotonic()
        missing, wrong = readable(self.cluster.master, keys, self.profile.page_size, timeout_s=3)
        self.outage_checks.append({"t": round(load.since_start(), 2), "pages": len(keys),
                                   "missing": len(missing), "wrong": len(wrong),
                                   "seconds": round(time.monotonic() - t0, 2)})
        assert not wrong, f"wrong pages on the surviving node: {wrong[:5]}"
        assert not missing, f"{len(missing)} pages on the surviving node unreadable during the outage"

    def run(self, inject, restore) -> dict:
        p = self.profile
        self.preload()
        load = Load(self.cluster.master, p, self.tmp, tag=self.name, seconds=p.fault_seconds)
        try:
            load.start()
            period = p.fault_seconds / p.fault_cycles
            for i in range(p.fault_cycles):
                load.sleep_until(i * period + 0.25 * period)
                inject(load, i)
                restore(load, i)
            results = load.finish()
        finally:
            load.stop()
        summary = summarize(results, load.seconds)
        print(f"\n[{p.name}] {self.name}: {summary}\nevents: {self.events}")
        assert_healthy(results, summary, p)
        assert all(proc.alive for proc in self.cluster.procs()), self.cluster.logs()
        self.cluster.wait_nodes(2)
        # nothing was lost for good: every acknowledged object and every pre-loaded page is back
        acked = acked_keys(results)
        missing, wrong = readable(self.cluster.master, acked + self.seeds, p.page_size, timeout_s=20)
        assert not wrong, f"wrong pages after the run: {wrong[:5]}"
        assert not missing, f"{len(missing)} of {len(acked)} acknowledged objects lost, e.g. {missing[:3]}"
        tl = timeline(results)
        figures = {"profile": profile_dict(p), "summary": summary, "events": self.events,
                   "outage_checks": self.outage_checks, "recovery_s": recovery(tl, self.events),
                   "timeline": tl}
        return figures

    def record(self, figures: dict) -> None:
        record(self.name, figures, command="HICACHE_MC_STRESS_LONG=1 .venv/bin/pytest tests/stress -m slow")


def recovery(tl: list[dict], events: list[dict]) -> list[float]:
    """Seconds from each restore until a whole second of gets hit again (>= 95 %)."""
    out = []
    for e in events:
        if not e["event"].startswith("restored"):
            continue
        back = next((row["s"] for row in tl if row["s"] >= e["t"] and row["requests"]
                     and row["get_hit"] >= 0.95), None)
        out.append(round(back - e["t"], 2) if back is not None else None)
    return out


def ssd_args(folder, durability: str, ssd: str = "512MiB") -> tuple:
    return ("--ssd", ssd, "--ssd-dir", str(folder), "--durability", durability)


# ------------------------------------------------------------------ scenarios

@pytest.mark.timeout(TIMEOUT_S)
def test_node_sigkill_and_restart(scluster, profile, tmp_path):
    c = scluster
    c.env["HICACHE_MC_SSD_SEGMENT"] = "16MiB"
    c.start_master()
    c.add_node(dram=profile.node_dram, args=ssd_args(tmp_path / "ssd0", "sync"))
    c.add_node(dram=profile.node_dram, args=ssd_args(tmp_path / "ssd1", "sync"))
    c.wait_nodes(2)
    sc = Scenario(c, profile, tmp_path, "node_kill")

    def inject(load, i):
        victim = c.nodes[i % 2]
        victim.kill(signal.SIGKILL)
        sc.event(load, f"killed node {victim.port}")
        c.wait_nodes(1, timeout_s=10)
        sc.event(load, "master dropped it")
        sc.check_survivor(load, victim.address)

    def restore(load, i):
        restart(c, c.nodes[i % 2])
        c.wait_nodes(2, timeout_s=20)
        sc.event(load, "restored: node back")

    figures = sc.run(inject, restore)
    assert c.stats()["nodes_expired"] == profile.fault_cycles, "a node other than the victim was dropped"
    sc.record(figures)


@pytest.mark.timeout(TIMEOUT_S)
def test_master_sigkill_and_restart(scluster, profile, tmp_path):
    c = scluster
    c.start_master()
    c.add_node(dram=profile.node_dram)
    c.add_node(dram=profile.node_dram)
    c.wait_nodes(2)
    sc = Scenario(c, profile, tmp_path, "master_kill")
    epochs = [c.stats()["epoch"]]

    def inject(load, i):
        c.master_proc.kill(signal.SIGKILL)
        sc.event(load, "killed master")
        time.sleep(1.0)

    def restore(load, i):
        c.start_master()
        c.wait_nodes(2, timeout_s=20)
        epochs.append(c.stats()["epoch"])
        sc.event(load, "restored: master back, nodes registered")

    figures = sc.run(inject, restore)
    assert len(set(epochs)) == profile.fault_cycles + 1
    # the clients did notice: a call in flight when the master died failed, or one sent during
    # the outage waited for the new master (which one happens depends on timing)
    summary = figures["summary"]
    assert summary["client_errors"] > 0 or max(op["max_ms"] for op in summary["ops"].values()) >= 500, summary
    sc.record(figures)


@pytest.mark.timeout(TIMEOUT_S)
def test_node_sigstop_beyond_liveness(scluster, profile, tmp_path):
    c = scluster
    c.start_master()
    c.add_node(dram=profile.node_dram)
    c.add_node(dram=profile.node_dram)
    c.wait_nodes(2)
    sc = Scenario(c, profile, tmp_path, "node_stop")
    window = c.heartbeat_s * c.liveness
    stopped = []

    def inject(load, i):
        victim = c.nodes[i % 2]
        victim.pause()
        stopped.append(victim)
        t0 = time.monotonic()
        sc.event(load, f"stopped node {victim.port}")
        c.wait_nodes(1, timeout_s=10)
        sc.event(load, "master dropped it")
        sc.check_survivor(load, victim.address)
        time.sleep(max(0.0, 2 * window - (time.monotonic() - t0)))

    def restore(load, i):
        stopped.pop().kill(signal.SIGCONT)
        c.wait_nodes(2, timeout_s=20)
        sc.event(load, "restored: node continued and registered again")

    try:
        figures = sc.run(inject, restore)
    finally:
        for p in stopped:
            p.kill(signal.SIGCONT)
    assert c.stats()["nodes_expired"] == profile.fault_cycles, "a node other than the victim was dropped"
    sc.record(figures)


@pytest.fixture
def disk(tmp_path, profile):
    """A tmpfs for both SSD tiers with room for the data twice over, so that only the test fills
    it; skipped where we may not mount one."""
    d = tmp_path / "disk"
    d.mkdir()
    size_m = 2 * (profile.universe_bytes >> 20) + 64
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_m}m", "tmpfs", str(d)],
                                           capture_output=True).returncode != 0:
        pytest.skip("filling a disk needs a tmpfs mount (root)")
    yield d
    subprocess.run(["umount", "-l", str(d)], check=False)


def fill(folder) -> int:
    """Write a filler file until the file system is full; returns the bytes written."""
    chunk = b"\0" * MiB
    n = 0
    with open(os.path.join(folder, "filler"), "wb", buffering=0) as f:
        try:
            while True:
                n += f.write(chunk)
        except OSError:
            pass
    return n


@pytest.mark.timeout(TIMEOUT_S)
def test_disk_full_during_load(scluster, profile, tmp_path, disk):
    c = scluster
    c.env["HICACHE_MC_SSD_SEGMENT"] = "4MiB"
    c.start_master()
    c.add_node(dram=profile.node_dram, args=ssd_args(disk / "ssd0", "sync"))
    c.add_node(dram=profile.node_dram, args=ssd_args(disk / "ssd1", "async"))
    c.wait_nodes(2)
    sc = Scenario(c, profile, tmp_path, "disk_full")

    def errors() -> int:
        return sum(n.get("ssd_write_errors", 0) for n in c.stats()["nodes"])

    def inject(load, i):
        before = errors()
        filled = fill(disk)
        sc.event(load, f"disk full ({filled >> 20} MiB filler)")
        wait_for(lambda: errors() > before, 10, "a failed SSD write")
        sc.event(load, "nodes saw write errors")
        time.sleep(1.0)

    def restore(load, i):
        os.unlink(disk / "filler")
        sc.event(load, "restored: filler removed")

    figures = sc.run(inject, restore)
    assert c.stats()["nodes_expired"] == 0, "a full disk made a node miss its heartbeats"
    assert errors() >= profile.fault_cycles
    figures["ssd_write_errors"] = errors()
    # a node that wrote while the disk was full says so, at most once a minute (a node may not
    # have written then)
    saw = [n for n in c.nodes if "ssd tier unusable" in n.log()]
    assert saw and all(n.log().count("ssd tier unusable") <= 1 + profile.fault_seconds // 60 for n in saw)
    # with room again, the nodes take writes again, and those that saw the disk fail say so
    fresh = list(dict.fromkeys(k for keys in universe(1, 2, 0, 128, "after").values() for k in keys))
    assert all(put_pages(c.master, fresh, profile.page_size))
    wait_for(lambda: all("ssd tier writable again" in n.log() for n in saw), 10, "disk writable again")
    sc.record(figures)


def deleted_segments_mapped(pid: int) -> list[str]:
    """Segment files of the node process ``pid`` this process still maps although they were
    deleted (only that node's: clients of earlier tests may still await collection)."""
    with open("/proc/self/maps") as f:
        return sorted({line.split()[-2] for line in f if f"hicache-mc-{pid}-" in line
                       and line.rstrip().endswith("(deleted)")})


def test_clients_unmap_the_segment_of_a_restarted_node(scluster, tmp_path):
    from hicache_mc.client import StoreClient
    c = scluster
    c.start_master()
    node = c.add_node(dram="16MiB")
    c.wait_nodes(1)
    with StoreClient(c.master, transport="shm", timeout_s=1.0, circuit_open_s=0.1) as client:
        assert client.put("seg/a", b"a" * 1000) and client.get("seg/a") == b"a" * 1000   # maps segment 1
        first = node.p.pid
        node.kill(signal.SIGKILL)
        c.wait_nodes(0)
        restart(c, node)
        c.wait_nodes(1)
        wait_for(lambda: client.put("seg/b", b"b" * 1000), 10, "a put to the restarted node")
        assert client.get("seg/b") == b"b" * 1000                                         # maps segment 2
        assert deleted_segments_mapped(first) == []
