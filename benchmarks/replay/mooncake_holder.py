"""A Mooncake Store holder: contributes one memory segment, then waits for stdin to close.

    python mooncake_holder.py MASTER_ADDR SEGMENT_BYTES

Prints ``ready`` once the segment is mounted. Objects live in this process's segment, so it
must outlive every instance (Mooncake issue #607: a closed client's objects disappear).
"""
from __future__ import annotations

import sys

# A pure server cannot Put or Get itself; it still needs a small local buffer at setup.
LOCAL_BUFFER = 16 << 20


def main() -> int:
    master, capacity = sys.argv[1], int(sys.argv[2])
    from mooncake.store import MooncakeDistributedStore
    store = MooncakeDistributedStore()
    rc = store.setup("127.0.0.1", "P2PHANDSHAKE", capacity, LOCAL_BUFFER, "tcp", "", master)
    if rc != 0:
        print(f"setup failed rc={rc}", flush=True)
        return 1
    print("ready", flush=True)
    try:
        sys.stdin.read()
    except (ValueError, OSError):
        pass
    store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
