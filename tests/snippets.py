"""Fenced blocks of the project's markdown files, and running one as a user would: against a
real store on a free port (HICACHE_MC_MASTER names it). A block that starts its own store
(``hicache-mc serve``) gets the port through HICACHE_MC_MASTER_PORT; ``.venv/bin/...`` resolves
to this interpreter through a folder of shims."""
import os
import re
import signal
import stat
import subprocess
import sys
import time
from typing import NamedTuple

from procs import Store, free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BLOCK = re.compile(r"^```(\w*)\n(.*?)^```$", re.M | re.S)


class Block(NamedTuple):
    lang: str           # "" for a block without one (diagrams, transcripts)
    body: str
    where: str          # FILE:LINE, relative to the checkout


def blocks(path: str) -> list[Block]:
    text = open(os.path.join(ROOT, path)).read()
    return [Block(m.group(1), m.group(2), f"{path}:{text.count(chr(10), 0, m.start()) + 1}")
            for m in BLOCK.finditer(text)]


def shims(folder) -> str:
    """``.venv/bin/hicache-mc`` and ``.venv/bin/python`` under ``folder``, running this
    interpreter and this checkout; returns the bin folder."""
    bin_ = folder / ".venv" / "bin"
    bin_.mkdir(parents=True)
    for name, run in (("python", ""), ("hicache-mc", " -m hicache_mc.cli")):
        path = bin_ / name
        path.write_text(f'#!/bin/sh\nexec "{sys.executable}"{run} "$@"\n')
        path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(bin_)


def end_group(pgid: int) -> None:
    """Stop what a block left running in the background (a ``serve &``): SIGTERM, then SIGKILL."""
    for sig, wait_s in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        end = time.monotonic() + wait_s
        while time.monotonic() < end:
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.1)


def run_block(block: Block, tmp_path) -> None:
    """Run a python or bash block in ``tmp_path`` against a store; fails the test on exit != 0."""
    starts_store = "hicache-mc serve" in block.body
    store = None if starts_store else Store(tmp_path).start()
    port = free_port() if starts_store else int(store.master.rsplit(":", 1)[1])
    env = {k: v for k, v in os.environ.items() if not k.startswith("HICACHE_MC_")}
    env.update(HICACHE_MC_MASTER=f"tcp://127.0.0.1:{port}", HICACHE_MC_MASTER_PORT=str(port),
               # not 9370 and 7373: another test's store may hold them
               HICACHE_MC_MASTER_METRICS_PORT="0", HICACHE_MC_PUBLISH_PORT="0",
               HICACHE_MC_PREFAULT="0",            # a segment of --dram, allocated as it is used
               HICACHE_MC_DATA_DIR=str(tmp_path / "data"),
               PATH=shims(tmp_path) + os.pathsep + env["PATH"],
               PYTHONPATH=os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")])))
    log_path = tmp_path / "out.log"
    cmd = ([sys.executable, "-c", block.body] if block.lang == "python"
           else ["bash", "-euo", "pipefail", "-c", block.body])
    with open(log_path, "w") as log:        # a file, not a pipe: a background serve holds it open
        p = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT,
                             start_new_session=True)
    try:
        rc = p.wait(timeout=600)
    finally:
        end_group(p.pid)
        if store is not None:
            store.stop()
    assert rc == 0, (f"{block.where} failed (exit {rc}):\n{block.body}\n--- output:\n"
                     f"{log_path.read_text()[-4000:]}")
