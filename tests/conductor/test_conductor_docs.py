"""docs/conductor-server.md agrees with the code: each of its hicache-mc commands passes the real CLI
parser, each of its configuration blocks loads, and the settings and metrics it names exist."""
from __future__ import annotations

import re
import shlex

from hicache_mc.cli import build_parser
from snippets import ROOT, blocks

DOC = "docs/conductor-server.md"


def test_every_hicache_mc_command_passes_the_parser():
    found = []
    for b in blocks(DOC):
        for line in b.body.replace("\\\n", " ").splitlines():
            if not re.match(r"\s*([A-Z_]+=\S+\s+)*hicache-mc\b", line):
                continue
            words = shlex.split(line)
            while words and "=" in words[0] and not words[0].startswith("-"):
                words.pop(0)                                  # VAR=value prefixes
            if words and words[0] == "hicache-mc":
                found.append(words[1:])
    assert len(found) >= 1
    for argv in found:
        build_parser().parse_args(argv)


def test_the_metrics_it_names_are_the_servers():
    """Every name the Metrics section gives is one the conductor registers (metrics.py) or
    computes at a scrape (server.py)."""
    from hicache_mc.conductor import metrics, server
    text = open(f"{ROOT}/{DOC}").read()
    section = text[text.index("## Metrics"):text.index("## On a GPU machine")]
    named = set(re.findall(r"`([a-z_]+)(?:\{[^}]*\})?`", section)) - {"hicache_mc_conductor_"}
    source = open(metrics.__file__).read() + open(server.__file__).read()
    registered = set(re.findall(r'P \+ "([a-z_]+)"', source)) | set(re.findall(r'gauge\("([a-z_]+)"', source))
    registered |= {"worker_" + f for f in re.findall(r'"(waiting_reqs|running_reqs|kv_usage|waiting_tokens|running_tokens)"', source)}
    registered |= {"events_" + f for f in re.findall(r'"(batches|gaps|lost|stalls|malformed|restarts)"', source)}
    assert len(named) > 20
    assert sorted(n for n in named if n.removesuffix("_total") not in registered) == []
