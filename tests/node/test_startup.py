"""A node that cannot start, or is stopped while it starts, says why and leaves no segment
file behind (real ``hicache-mc node`` / ``serve`` processes)."""
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest

from procs import Proc, free_port

START_S = 60         # generous: a loaded 2-core machine


@pytest.fixture
def shm_dir():
    """A folder of its own on /dev/shm for the node's segment file (HICACHE_MC_SHM_DIR)."""
    d = tempfile.mkdtemp(prefix="hicache-mc-test-", dir="/dev/shm")
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def start(tmp_path):
    """start(cmd, shm_dir, *args): ``hicache-mc node`` (with no master: it only has to start)
    or ``serve``; whatever is still running at the end is killed with its process group."""
    procs = []

    def run(cmd: str, shm_dir: str, *args: str) -> Proc:
        port = str(free_port())
        head = ["node", "--master", f"tcp://127.0.0.1:{port}"] if cmd == "node" else ["serve", "--port", port]
        env = {"HICACHE_MC_SHM_DIR": shm_dir, "HICACHE_MC_DATA_DIR": str(tmp_path / "data"),
               # serve's master: not 9370, which another hicache-mc on this host may hold
               "HICACHE_MC_MASTER_METRICS_PORT": "0", "HICACHE_MC_PUBLISH_PORT": "0"}
        procs.append(Proc([*head, *args], str(tmp_path / f"{cmd}.log"), env, os.setsid).start())
        return procs[-1]
    yield run
    for p in procs:
        if p.alive:
            os.killpg(p.p.pid, signal.SIGKILL)
            p.p.wait(10)


def _read_only(path) -> callable:
    """Make ``path`` unwritable for the node; returns an undo function."""
    if os.geteuid() != 0:
        os.chmod(path, 0o555)
        return lambda: os.chmod(path, 0o755)
    # root ignores permissions: bind-mount the folder read-only over itself
    r = subprocess.run(["mount", "--bind", "-o", "ro", str(path), str(path)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot make a read-only folder as root here: {r.stderr.decode().strip()}")
    return lambda: subprocess.run(["umount", "-l", str(path)], check=False)


@pytest.mark.parametrize("cmd", ["node", "serve"])
@pytest.mark.parametrize("durability", ["sync", "async"])
@pytest.mark.parametrize("problem", ["read-only", "not a folder"])
def test_an_unusable_ssd_dir_fails_the_start_with_one_line(start, tmp_path, shm_dir, cmd, durability, problem):
    ssd_dir = tmp_path / "ssd"
    undo = lambda: None  # noqa: E731
    if problem == "read-only":
        ssd_dir.mkdir()
        undo = _read_only(ssd_dir)
        reason = "ssd_dir .*ssd: .*(Read-only file system|Permission denied)"
    else:
        ssd_dir.write_text("a file")
        reason = "ssd_dir .*ssd: .*(Not a directory|File exists)"
    try:
        proc = start(cmd, shm_dir, "--dram", "16MiB", "--ssd", "64MiB", "--ssd-dir",
                     str(ssd_dir), "--durability", durability)
        assert proc.p.wait(START_S) != 0
    finally:
        undo()
    log = proc.log()
    assert "Traceback" not in log, log
    assert any(re.search(reason, line) for line in log.splitlines()), log
    assert os.listdir(shm_dir) == []          # the DRAM segment of the failed start is gone


def _wait_for_segment(proc: Proc, shm_dir: str) -> None:
    end = time.monotonic() + START_S
    while not os.listdir(shm_dir):
        assert proc.alive, proc.log()
        assert time.monotonic() < end, "no segment file appeared"
        time.sleep(0.002)


@pytest.mark.parametrize("cmd,sig,group", [("node", signal.SIGTERM, False), ("node", signal.SIGINT, False),
                                           ("serve", signal.SIGTERM, False), ("serve", signal.SIGINT, True)])
def test_a_signal_during_prefault_leaves_no_segment(start, shm_dir, cmd, sig, group):
    """Stopped while it faults in 2 GiB of DRAM (a supervisor's SIGTERM; Ctrl-C, which a
    terminal sends to the whole process group), the node removes its segment file."""
    proc = start(cmd, shm_dir, "--dram", "2GiB")
    _wait_for_segment(proc, shm_dir)
    if group:
        os.killpg(proc.p.pid, sig)
    else:
        proc.p.send_signal(sig)
    proc.p.wait(START_S)
    end = time.monotonic() + START_S        # serve's node process may end after serve
    while os.listdir(shm_dir) and time.monotonic() < end:
        time.sleep(0.05)
    assert os.listdir(shm_dir) == [], proc.log()
    assert "Traceback" not in proc.log(), proc.log()


def test_a_shm_dir_too_small_for_the_dram_tier_fails_the_start(start, tmp_path):
    small = tmp_path / "shm"
    small.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(small)],
                                           capture_output=True).returncode != 0:
        pytest.skip("needs root to mount a small tmpfs")
    try:
        proc = start("node", str(small), "--dram", "64MiB")
        assert proc.p.wait(START_S) != 0
        log = proc.log()
        assert "Traceback" not in log and "--dram" in log and str(small) in log, log
        assert os.listdir(small) == []
    finally:
        subprocess.run(["umount", "-l", str(small)], check=False)


def test_the_demo_with_too_little_dram_says_why_it_failed():
    r = subprocess.run([sys.executable, "-m", "hicache_mc.cli", "demo", "--dram", "16MiB"],
                       capture_output=True, text=True, timeout=300)
    out = r.stdout + r.stderr
    assert r.returncode != 0, out
    assert "--dram" in out and "16MiB" in out, out       # the setting to change, and its value
    assert "Traceback" not in out, out


def test_an_ssd_tier_larger_than_its_disk_is_named_at_start(start, tmp_path, shm_dir):
    """--ssd 100GiB on a disk with 61 GB free was accepted without a word."""
    import shutil as sh
    ssd_dir = tmp_path / "ssd"
    too_big = sh.disk_usage(tmp_path).free + (64 << 30)
    proc = start("node", shm_dir, "--dram", "16MiB", "--ssd", str(too_big), "--ssd-dir", str(ssd_dir))
    end = time.monotonic() + START_S
    while "will fill the disk first" not in proc.log():
        assert proc.alive and time.monotonic() < end, proc.log()
        time.sleep(0.05)
    line = next(x for x in proc.log().splitlines() if "will fill the disk first" in x)
    assert f"ERROR hicache_mc.node.startup: ssd {too_big / 2**30:.1f} GiB: {ssd_dir} has " in line
    assert proc.alive          # it serves all the same, until the disk fills
