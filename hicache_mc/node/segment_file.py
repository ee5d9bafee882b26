"""SegmentFile: the file under ``shm_dir`` that holds a node's DRAM tier, and who owns it.

The node creates it (never opens one that exists) with mode 0600, maps it, and holds an
exclusive ``flock`` on it for as long as it runs: the lock, not the pid in the file's name,
says a live node owns it. A pid means nothing across PID namespaces (containers sharing
``/dev/shm``: a node in one would take a live node of another for dead), a lock does: the
kernel drops it when the owner exits, however it exits. ``remove_unowned`` deletes the files
whose lock nobody holds: segments of nodes killed before they could remove theirs.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import glob
import logging
import mmap
import os
import stat

from ..errors import HicacheError
from ..transport.shm import MAGIC

log = logging.getLogger(__name__)

PREFIX = "hicache-mc-"       # segment files are PREFIX<pid>-<segment id>
PREFAULT_CHUNK = 256 << 20   # the prefault's step (see SegmentFile._prefault)
MADV_POPULATE_WRITE = 23     # Linux 5.14+; Python's mmap module does not name it


class SegmentFile:
    def __init__(self, path: str, size: int, segment_id: str, prefault: bool = False):
        """Create ``path`` (``size`` bytes, the segment id in its header), lock and map it."""
        self.path = path
        self._fd = self._create(path)       # (no signal is handled between these two)
        try:
            os.ftruncate(self._fd, size)
            self.mm = mmap.mmap(self._fd, size, flags=mmap.MAP_SHARED)
            if prefault:
                self._prefault()
        except BaseException:       # no room, or SIGTERM / Ctrl-C while prefaulting: no file left
            os.unlink(path)
            os.close(self._fd)
            raise
        header = MAGIC + segment_id.encode()
        self.mm[: len(header)] = header

    @staticmethod
    def _create(path: str) -> int:
        """A new file at ``path``, ours alone, locked. A ``remove_unowned`` elsewhere may take
        it for a dead node's between its creation and its lock: then it is created again."""
        for _ in range(3):
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)      # (a remover holds it only while it unlinks)
                if os.stat(path).st_ino == os.fstat(fd).st_ino:
                    return fd
            except FileNotFoundError:
                log.info("%s was removed as it was created; creating it again", path)
            except BaseException:       # SIGTERM / Ctrl-C: no file left
                with contextlib.suppress(OSError):
                    if os.stat(path).st_ino == os.fstat(fd).st_ino:
                        os.unlink(path)
                os.close(fd)
                raise
            os.close(fd)
        raise HicacheError(f"could not create the DRAM segment {path}: removed each time")

    def _prefault(self) -> None:
        """Allocate every page of the segment now, a chunk at a time: signals are handled
        between two chunks (one MAP_POPULATE of the whole segment holds them off for about a
        second per GiB). A shm_dir without room for the segment fails here, where MAP_POPULATE
        would succeed and the first write past the room left would kill the node (SIGBUS)."""
        size = len(self.mm)
        for off in range(0, size, PREFAULT_CHUNK):
            n = min(PREFAULT_CHUNK, size - off)
            try:
                self.mm.madvise(MADV_POPULATE_WRITE, off, n)
            except OSError as exc:
                if exc.errno != errno.EINVAL:     # EFAULT: the tmpfs is full; ENOMEM
                    raise HicacheError(
                        f"{os.path.dirname(self.path)} has no room for a {size >> 20} MiB DRAM "
                        "segment: lower --dram, or enlarge it (docker run --shm-size; a "
                        "Kubernetes emptyDir of medium Memory)") from None
                # Linux before 5.14: no MADV_POPULATE_WRITE
                mmap.mmap(self._fd, n, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE, offset=off).close()

    def close(self) -> None:
        """Unmap and remove the file, then give up its lock."""
        try:
            self.mm.close()
        except BufferError:  # a zero-copy send still holds a view; the OS reclaims it at exit
            log.debug("segment still exported at close; the OS unmaps it at exit")
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            log.debug("segment %s was removed already", self.path)
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def remove_unowned(shm_dir: str) -> None:
    """Delete the segment files in ``shm_dir`` whose lock no process holds (their node died,
    SIGKILL). A file also needs the pid in its name to be dead here, so a live node of an
    earlier version, which took no lock, keeps its segment; a pid alone never decides."""
    for path in glob.glob(os.path.join(shm_dir, PREFIX + "*")):
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError:
            continue        # another user's, or gone already
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode) or _pid_alive(path):
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue    # a live node's, in this PID namespace or another
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                os.unlink(path)
                log.info("removed %s: no live node holds it", path)
        except OSError as exc:
            log.warning("could not check %s: %s", path, exc)
        finally:
            os.close(fd)


def _pid_alive(path: str) -> bool:
    """Whether the pid in a segment file's name is a live process in this PID namespace (True
    when the name has none: it is not a segment of ours to remove)."""
    try:
        pid = int(os.path.basename(path)[len(PREFIX):].split("-")[0])
    except ValueError:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
