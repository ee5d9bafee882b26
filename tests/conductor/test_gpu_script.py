"""scripts/conductor_gpu.sh (run on a GPU machine, not here) at least parses, and each of its
hicache-mc commands passes the real CLI parser, its shell variables given sample values."""
from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

from hicache_mc.cli import build_parser

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "conductor_gpu.sh"
SAMPLES = {"MASTER_PORT": "31000", "DRAM": "8GiB", "CONDUCTOR_PORT": "31001",
           "TOKENIZER": "/models/tok", "NAMESPACE": "0123456789abcdef", "WORKDIR": "/tmp/w"}
SERVERS = "s0=http://127.0.0.1:31010 s1=http://127.0.0.1:31020"


def test_the_script_parses_and_its_commands_pass_the_cli_parser():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    text = SCRIPT.read_text().replace("\\\n", " ")
    commands = [line.split("hicache-mc", 1)[1] for line in text.splitlines()
                if re.match(r"\s*(setsid )?hicache-mc ", line)]
    assert len(commands) == 3                       # serve, wait, conductor
    for command in commands:
        command = command.replace('"${SERVERS[@]}"', SERVERS)
        command = re.sub(r"\$\{?([A-Z_]+)\}?", lambda m: SAMPLES[m.group(1)], command)
        argv = shlex.split(command.split(">")[0])
        build_parser().parse_args(argv)
