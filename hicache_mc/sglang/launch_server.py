"""``python -m hicache_mc.sglang.launch_server [SGLang's launch_server arguments]``

``python -m sglang.launch_server`` with hicache-mc's plugin (``hicache_mc.sglang.plugin``) loaded
even where its entry point is not installed (a checkout on ``PYTHONPATH``). It also registers
at import: SGLang 0.5.23 starts an encoder's extra workers (``--encoder-only`` with
``--tp-size`` or ``--dp-size`` above 1) with multiprocessing ``spawn`` and without loading
plugins, and ``spawn`` imports the parent's ``__main__`` module again, so
``--mm-global-cache-backend hicache_mc`` reaches those workers through this launcher only.
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
