"""The GPU install line of docs/sglang.md (``pip install ".[sglang]"`` from a checkout, into an
environment that already has SGLang), run in a fresh virtual environment."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ENV = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}   # nothing from the checkout


def run(cmd, **kw) -> subprocess.CompletedProcess:
    kw.setdefault("timeout", 120)
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, env=ENV, **kw)


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Path:
    """A fresh virtual environment with SGLang "already installed" and hicache-mc installed from
    a copy of the checkout by the documented line. SGLang is this environment's: its
    site-packages joins the new one through a .pth file (``--system-site-packages`` would give
    the base interpreter's, without SGLang). Offline, the line gets ``--no-deps`` (SGLang's own
    requirements pin a CUDA torch), ``--no-build-isolation`` and ``--no-index``."""
    root = tmp_path_factory.mktemp("gpu-install")
    env_dir, src = root / "venv", root / "src"
    run([sys.executable, "-m", "venv", "--without-pip", env_dir], check=True)
    py = env_dir / "bin" / "python"
    site = run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
               check=True).stdout.strip()
    here = dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib"))
    Path(site, "sglang-env.pth").write_text("".join(f"{p}\n" for p in here))
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache"))
    pip = run([py, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps",
               "--no-build-isolation", "--no-index", f"{src}[sglang]"], cwd=root)
    if pip.returncode:
        pytest.skip(f"pip cannot build hicache-mc offline here: {pip.stderr.strip()[-600:]}")
    return py


def test_gpu_install_line_installs_the_package(venv):
    """The package, its metadata and its command come from the new environment, not the checkout."""
    out = run([venv, "-c", "import importlib.metadata as md, importlib.util as u, json; "
               "print(json.dumps([u.find_spec('hicache_mc').submodule_search_locations[0], "
               "md.distribution('hicache-mc').requires]))"], cwd=venv.parent.parent)
    assert out.returncode == 0, out.stderr[-3000:]
    path, requires = json.loads(out.stdout)
    assert Path(path).is_relative_to(venv.parent.parent), path
    assert Path(path, "sglang", "backend.py").is_file()
    assert 'sglang>=0.5.23; extra == "sglang"' in requires
    assert (venv.parent / "hicache-mc").is_file()
