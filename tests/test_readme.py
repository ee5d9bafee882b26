"""README.md's snippets run as written: every ```python block, and every ```bash / ```sh block
but those in SKIP, against a real store on a free port (HICACHE_MC_MASTER names it). A block
that starts its own store (``hicache-mc serve``) gets the port through HICACHE_MC_MASTER_PORT;
``.venv/bin/...`` resolves to this interpreter through a folder of shims."""
import os
import re
import signal
import stat
import subprocess
import sys
import time

import pytest

from procs import Store, free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
SKIP = {"make demo": "the set-up commands: they build .venv and run the whole suite",
        "sglang.launch_server": "needs a GPU and a model"}
BLOCK = re.compile(r"^```(\w+)\n(.*?)^```$", re.M | re.S)


def snippets() -> list[tuple[str, str, int]]:
    """(language, text, line) of each runnable-language block of README.md."""
    text = open(README).read()
    return [(m.group(1), m.group(2), text.count("\n", 0, m.start()) + 1)
            for m in BLOCK.finditer(text) if m.group(1) in ("python", "bash", "sh")]


def params() -> list:
    out = []
    for lang, body, line in snippets():
        why = next((why for mark, why in SKIP.items() if mark in body), None)
        out.append(pytest.param(lang, body, id=f"README.md:{line}",
                                marks=[pytest.mark.skip(reason=why)] if why else []))
    return out


def test_every_skip_names_one_block_and_something_runs():
    found = snippets()
    for mark in SKIP:
        assert sum(mark in body for _, body, _ in found) == 1, mark
    assert {"python", "bash"} <= {lang for lang, body, _ in found
                                  if not any(mark in body for mark in SKIP)}


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


@pytest.mark.parametrize("lang, body", params())
def test_readme_snippet_runs(lang, body, tmp_path):
    starts_store = "hicache-mc serve" in body
    store = None if starts_store else Store(tmp_path).start()
    port = free_port() if starts_store else int(store.master.rsplit(":", 1)[1])
    env = {k: v for k, v in os.environ.items() if not k.startswith("HICACHE_MC_")}
    env.update(HICACHE_MC_MASTER=f"tcp://127.0.0.1:{port}", HICACHE_MC_MASTER_PORT=str(port),
               HICACHE_MC_MASTER_METRICS_PORT="0",  # not 9370: another test's store may hold it
               HICACHE_MC_PREFAULT="0",            # a 4GiB segment, allocated as it is used
               HICACHE_MC_DATA_DIR=str(tmp_path / "data"),
               PATH=shims(tmp_path) + os.pathsep + env["PATH"],
               PYTHONPATH=os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")])))
    log_path = tmp_path / "out.log"
    cmd = ["bash", "-euo", "pipefail", "-c", body] if lang != "python" else [sys.executable, "-c", body]
    with open(log_path, "w") as log:        # a file, not a pipe: a background serve holds it open
        p = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT,
                             start_new_session=True)
    try:
        rc = p.wait(timeout=600)
    finally:
        end_group(p.pid)
        if store is not None:
            store.stop()
    assert rc == 0, f"README {lang} block failed (exit {rc}):\n{body}\n--- output:\n{log_path.read_text()[-4000:]}"
