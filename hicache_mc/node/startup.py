"""Starting a storage node in a process of its own (``hicache-mc node`` and ``serve``'s node).

Faulting its DRAM in and reading its SSD tier back take seconds per GiB. SIGTERM interrupts
that like Ctrl-C, and a start that fails or is interrupted leaves no segment file behind."""
from __future__ import annotations

import glob
import os
import signal

from ..config import NodeConfig
from .service import StorageNode


def start_node(config: NodeConfig) -> StorageNode:
    """The node, once it has started; until ``run_services`` sets its own handlers, SIGINT
    and SIGTERM raise KeyboardInterrupt."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _interrupted)
    try:
        return StorageNode(config)
    except BaseException:
        for path in glob.glob(os.path.join(config.shm_dir, f"hicache-mc-{os.getpid()}-*")):
            os.unlink(path)
        raise


def _interrupted(_signum, _frame):
    """Stop starting; a second signal (``serve`` passes each on to its node) must not
    interrupt the clean-up."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)     # not SIG_IGN: one pending then raises OSError
    raise KeyboardInterrupt
