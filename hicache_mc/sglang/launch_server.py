"""``python -m hicache_mc.sglang.launch_server [SGLang's launch_server arguments]``

``python -m sglang.launch_server`` with hicache-mc's plugin (``hicache_mc.sglang.plugin``) loaded
even where its entry point is not installed (a checkout on ``PYTHONPATH``). It loads the plugin
at import: SGLang's ``spawn`` workers import the parent's ``__main__`` module again, and without
the entry point their own ``load_plugins()`` would not find it.
"""
from __future__ import annotations

import os
import sys
from typing import Optional

from hicache_mc.sglang.plugin import load

load()


def main(argv: Optional[list[str]] = None) -> int:
    from sglang.launch_server import run_server
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.utils import kill_process_tree
    load_plugins()                      # applies load()'s hooks, with any other plugin's
    server_args = prepare_server_args(list(sys.argv[1:] if argv is None else argv))
    try:
        run_server(server_args)
    finally:
        kill_process_tree(os.getpid(), include_parent=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
