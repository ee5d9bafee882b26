"""The GPU install line of docs/sglang.md (``pip install ".[sglang]"`` from a checkout, into an
environment that already has SGLang), run in a fresh virtual environment; then SGLang's own
plugin loader, CLI, factories and cache controller there, with hicache-mc's plugin; and the
launcher alias, which loads the plugin without the installed entry point."""
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


CHOICES = ("--hicache-storage-backend {", "--mm-global-cache-backend {")


def help_choices(text: str) -> list[list[str]]:
    """The choices ``--help`` lists for the two flags."""
    return [text.split(flag, 1)[1].split("}", 1)[0].split(",") for flag in CHOICES]


def test_sglang_serve_loads_the_plugin(venv):
    """``sglang serve`` (SGLang's CLI, up to starting the server) loads the plugin through the
    ``sglang.srt.plugins`` entry point and parses ``hicache_mc`` for both flags; SGLang's
    controller then gets HiCacheMC from its factory by that name, on the zero-copy path unless
    the extra config says ``interface_v1: 0``, and the embedding-store factory builds ours."""
    master = "tcp://127.0.0.1:1"    # nothing connects before the first page moves
    out = run([venv, Path(__file__).with_name("plugin_probe.py"), master],
              cwd=venv.parent.parent, timeout=240)
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("PROBE ")), None)
    assert out.returncode == 0 and line, out.stdout[-2000:] + out.stderr[-4000:]
    got = json.loads(line[len("PROBE "):])
    assert got["entry_points"] == ["hicache_mc = hicache_mc.sglang.plugin:load (hicache-mc)"]
    assert Path(got["hicache_mc"]).is_relative_to(venv.parent.parent)
    assert got["serve"] == ["hicache_mc", "hicache_mc"] and got["bogus"] == "exit 2"
    assert len(got["hooked"]) == 5                          # all five hooks were applied
    assert got["threshold"] == 64                           # SGLang's key, parsed by SGLang
    assert got["kv"] == ["hicache_mc.sglang.backend.HiCacheMC", master,
                         "_page_get_zero_copy", "_page_set_zero_copy"]
    assert got["kv_interface_v1_0"][2:] == ["_generic_page_get", "_generic_page_set"]
    assert got["embedding_store"] == "hicache_mc.sglang.embedding_store.HiCacheMCEmbeddingStore"


def test_launch_server_help_lists_hicache_mc(venv):
    """``python -m sglang.launch_server --help`` in a fresh process: the plugin is loaded before
    the parser is built, so both flags list ``hicache_mc``."""
    out = run([venv, "-m", "sglang.launch_server", "--help"], cwd=venv.parent.parent)
    assert out.returncode == 0, out.stderr[-3000:]
    assert all("hicache_mc" in c and "mooncake" in c for c in help_choices(out.stdout))


def test_launcher_alias():
    """``python -m hicache_mc.sglang.launch_server`` from the checkout, whether or not an entry
    point names the plugin: its import registers both backends (what SGLang's ``spawn`` workers
    get when they import it again as ``__mp_main__``), and SGLang's parser lists ``hicache_mc``."""
    code = ("import runpy, sys\n"
            "sys.argv = ['launch_server', '--help']\n"
            "try:\n"
            "    runpy.run_module('hicache_mc.sglang.launch_server', run_name='__main__', "
            "alter_sys=True)\n"
            "except SystemExit as exc:\n"
            "    assert not exc.code, exc.code\n"
            "from sglang.srt.mem_cache.embedding_store import EmbeddingStoreFactory as E\n"
            "from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory as S\n"
            "print('REGISTERED', 'hicache_mc' in E._registry, 'hicache_mc' in S._registry)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**ENV, "PYTHONPATH": str(ROOT)}, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert all("hicache_mc" in c for c in help_choices(out.stdout))
    assert "REGISTERED True True" in out.stdout, out.stdout[-500:]
