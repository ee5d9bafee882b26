"""docs/*.md agree with the code. Every ```python block runs against a real store, and so does
every ```bash block but those in NOT_RUN (tests/snippets.py). Every hicache-mc command of any
block (``$ hicache-mc ...`` in a transcript included) passes the real CLI parser, and every
```toml block loads through the config loader, which refuses unknown sections and settings."""
import shlex

import pytest

from hicache_mc.cli import build_parser
from hicache_mc.config import (ClientConfig, ConductorServerConfig, MasterConfig, NodeConfig,
                               load_config)
from snippets import blocks, run_block

DOCS = ["docs/architecture.md", "docs/configuration.md", "docs/operations.md", "docs/sglang.md"]
# a mark found in exactly one bash block -> why that block is only parsed, not run
NOT_RUN = {
    "/etc/hicache-mc/token)": "several hosts with their own addresses (10.0.0.x)",
    "apt-get install": "installs system and GPU packages",
    "tenant_quotas": "names a master.toml the reader writes",
    "HICACHE_MC_STRESS_LONG": "the long stress run: ten minutes",
    "docker compose": "needs docker, systemd or Kubernetes",
    "pip install \".[sglang]\"": "installs into SGLang's environment (tests/sglang/test_install.py)",
    "--model-path MODEL": "SGLang's server: a GPU and a model",
    "launch_server --help": "needs hicache-mc installed as a package beside SGLang "
                            "(tests/sglang/test_install.py runs SGLang's parser)",
    "Qwen/Qwen2.5-VL": "SGLang's server: a GPU and a model",
    "--tp-size 4 --hicache-mem-layout page_head": "SGLang's servers at two TP sizes: GPUs and a "
                                                  "model (tests/sglang/test_heads.py)",
    "--disaggregation-mode decode": "SGLang's prefill and decode servers: GPUs and a model "
                                    "(tests/sglang/test_pd.py runs their managers)",
    "hicache_mc.sglang.kv_events": "a bridge that runs until stopped, for a master on another "
                                   "host (tests/sglang/test_kv_events.py runs it)",
    "test_live_server.py": "tests of the suite itself (live SGLang servers, minutes)",
    "test_plugin_order.py": "tests of the suite itself (a fresh SGLang per case)",
}
SECTIONS = {"master": MasterConfig, "node": NodeConfig, "client": ClientConfig,
            "conductor": ConductorServerConfig}
PREFIXES = {"sudo", "exec", "nohup", "time"}    # words that still leave a command to come
CONTROL = {"|", "||", "&", "&&", ";", ">", ">>", "<", "(", ")"}


def all_blocks() -> list:
    return [b for path in DOCS for b in blocks(path)]


def commands(block) -> list[list[str]]:
    """Each ``hicache-mc ...`` command of a shell block (every line) or of another block (its
    ``$ `` lines: a transcript), as argv without the program, cut at the first pipe,
    redirection or list operator."""
    out = []
    shell = block.lang in ("bash", "sh")
    for line in block.body.replace("\\\n", " ").splitlines():
        if not shell and not line.startswith("$ "):
            continue
        line = line.removeprefix("$ ")
        lex = shlex.shlex(line, posix=True, punctuation_chars=True)
        lex.whitespace_split = True
        words, argv, start = list(lex), None, True
        for w in words:
            if w in CONTROL:
                argv, start = None, True
            elif argv is not None:
                argv.append(w)
            elif start and (w == "hicache-mc" or w.endswith("/bin/hicache-mc")):
                argv = []
                out.append(argv)
            elif not (start and ("=" in w or w in PREFIXES)):
                start = False
    return out


def test_every_not_run_mark_names_one_bash_block_and_something_runs():
    bash = [b for b in all_blocks() if b.lang in ("bash", "sh")]
    for mark in NOT_RUN:
        assert sum(mark in b.body for b in bash) == 1, mark
    assert any(not any(m in b.body for m in NOT_RUN) for b in bash)
    assert any(b.lang == "python" for b in all_blocks())


def runnable() -> list:
    return [pytest.param(b, id=b.where) for b in all_blocks()
            if b.lang == "python" or (b.lang in ("bash", "sh")
                                      and not any(m in b.body for m in NOT_RUN))]


@pytest.mark.parametrize("block", runnable())
def test_docs_snippet_runs(block, tmp_path):
    run_block(block, tmp_path)


def test_every_hicache_mc_command_in_the_docs_passes_the_parser():
    found = [(b.where, argv) for b in all_blocks() for argv in commands(b)]
    assert len(found) >= 10, found          # the extraction itself still finds them
    parser = build_parser()
    for where, argv in found:
        try:
            parser.parse_args(argv)
        except SystemExit:
            pytest.fail(f"{where}: hicache-mc rejects {shlex.join(argv)}")


@pytest.mark.parametrize("block", [pytest.param(b, id=b.where) for b in all_blocks()
                                   if b.lang == "toml"])
def test_docs_config_files_load(block, tmp_path):
    path = tmp_path / "config.toml"
    path.write_text(block.body)
    sections = [name for name in SECTIONS if f"[{name}]" in block.body]
    assert sections, block.where
    for name in sections:
        load_config(SECTIONS[name], file=str(path), env={}, section=name)
