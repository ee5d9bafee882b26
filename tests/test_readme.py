"""README.md's snippets run as written: every ```python block, and every ```bash / ```sh block
but those in SKIP, against a real store (tests/snippets.py)."""
import pytest

from snippets import blocks, run_block

SKIP = {"make demo": "the set-up commands: they build .venv and run the whole suite",
        "sglang.launch_server": "needs a GPU and a model"}


def snippets() -> list:
    return [b for b in blocks("README.md") if b.lang in ("python", "bash", "sh")]


def params() -> list:
    out = []
    for b in snippets():
        why = next((why for mark, why in SKIP.items() if mark in b.body), None)
        out.append(pytest.param(b, id=b.where, marks=[pytest.mark.skip(reason=why)] if why else []))
    return out


def test_every_skip_names_one_block_and_something_runs():
    found = snippets()
    for mark in SKIP:
        assert sum(mark in b.body for b in found) == 1, mark
    assert {"python", "bash"} <= {b.lang for b in found if not any(m in b.body for m in SKIP)}


@pytest.mark.parametrize("block", params())
def test_readme_snippet_runs(block, tmp_path):
    run_block(block, tmp_path)
