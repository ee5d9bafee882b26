"""Starting a storage node in a process of its own (``hicache-mc node`` and ``serve``'s node).

Faulting its DRAM in and reading its SSD tier back take seconds per GiB. SIGTERM interrupts
that like Ctrl-C, and a start that fails or is interrupted leaves no segment file behind (the
node removes its own; one left by a process killed at the wrong moment goes at the next start,
see ``segment_file.remove_unowned``)."""
from __future__ import annotations

import logging
import os
import shutil
import signal

from ..config import NodeConfig
from .service import StorageNode

log = logging.getLogger(__name__)


def start_node(config: NodeConfig) -> StorageNode:
    """The node, once it has started; until ``run_services`` sets its own handlers, SIGINT
    and SIGTERM raise KeyboardInterrupt."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _interrupted)
    check_ssd_room(config)
    return StorageNode(config)


def check_ssd_room(config: NodeConfig) -> None:
    """Say at start, in one line, when the SSD tier's disk cannot hold ``ssd``: the tier would
    fill the disk before it reaches its size, and its writes fail from then on (the node then
    drops objects like a cache). Its own segments from before count as room."""
    if not config.ssd:
        return
    folder = config.ssd_dir or os.path.join(config.data_dir, "ssd")
    existing = folder
    while not os.path.exists(existing):
        existing = os.path.dirname(existing) or "."
    try:
        free = shutil.disk_usage(existing).free
        own = sum(e.stat().st_size for e in os.scandir(folder)
                  if e.name.startswith("seg-") and e.is_file()) if os.path.isdir(folder) else 0
    except OSError as exc:      # (the tier's own start says what is wrong with the folder)
        log.debug("ssd_dir %s: free space unknown: %s", folder, exc)
        return
    if free + own < config.ssd:
        log.error("ssd %.1f GiB: %s has %.1f GiB free (and %.1f GiB of this tier's segments): "
                  "the tier will fill the disk first and its writes fail from then on; lower "
                  "--ssd (ssd) or free space", config.ssd / 2**30, folder, free / 2**30, own / 2**30)


def _interrupted(_signum, _frame):
    """Stop starting; a second signal (``serve`` passes each on to its node) must not
    interrupt the clean-up."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)     # not SIG_IGN: one pending then raises OSError
    raise KeyboardInterrupt
