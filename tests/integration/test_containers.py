"""Same-host shared memory across containers, with the mechanisms a container runtime uses: a
node and a client in UTS namespaces of their own (different hostnames, as two containers or
pods have), sharing the segment folder and the user (the recipe of deploy/compose.sglang.yaml
and deploy/kubernetes-sglang.yaml) use shm; a client of another user, or one whose segment
folder is a tmpfs of its own (a container without the shared volume), uses tcp. Needs root
(unshare, setpriv); skipped without it."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid

import pytest

from procs import Cluster

USER = 10001            # the image's user (deploy/Dockerfile)
pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare")
                                or not shutil.which("setpriv"), reason="needs root, unshare, setpriv")

CLIENT = r"""
import dataclasses, socket, sys
import numpy as np
from hicache_mc import protocol as P
from hicache_mc.client import StoreClient
src = np.arange(4 << 20, dtype=np.uint8)
dst = np.zeros_like(src)
with StoreClient(sys.argv[1], timeout_s=10.0) as c:
    ok = c.batch_put_from([sys.argv[2]], [src.ctypes.data], [src.nbytes])
    got = c.batch_get_into([sys.argv[2]], [dst.ctypes.data], [dst.nbytes])
    record = c.stats()["cluster"]["nodes"][0]
    node = P.NodeInfo.from_dict({f.name: record[f.name] for f in dataclasses.fields(P.NodeInfo)})
    print(socket.gethostname(), ok[0] and got[0] and bool((src == dst).all()), c.transport_for(node).name)
"""


def contained(argv: list[str], hostname: str, uid: int, private: str = "") -> list[str]:
    """``argv`` in a UTS namespace of its own named ``hostname``, as ``uid``; with ``private``, a
    mount namespace where that folder is a fresh tmpfs."""
    mount = f"mount -t tmpfs -o uid={uid} tmpfs {private} && " if private else ""
    inner = (f"{mount}hostname {hostname} && exec setpriv --reuid {uid} --regid {uid} "
             f"--clear-groups -- \"$@\"")
    return ["unshare", "--uts", *(["--mount", "--propagation", "private"] if private else []),
            "--", "sh", "-c", inner, "contained", *argv]


@pytest.fixture
def segments():
    """A folder in the host's /dev/shm for the segments, owned by the node's user."""
    path = f"/dev/shm/hicache-mc-test-{uuid.uuid4().hex[:8]}"
    os.mkdir(path, 0o700)
    os.chown(path, USER, USER)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_containers_sharing_the_segment_folder_and_user_use_shm_others_tcp(tmp_path, segments):
    c = Cluster(tmp_path)
    c.start_master()
    data = tmp_path / "data"
    data.mkdir()
    os.chown(data, USER, USER)
    env = {**os.environ, **c.env, "HICACHE_MC_SHM_DIR": segments, "HICACHE_MC_DATA_DIR": str(data),
           "PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))}
    node = subprocess.Popen(contained([sys.executable, "-m", "hicache_mc.cli", "node", "--master",
                                       c.master, "--dram", "64MiB"], "nodebox", USER),
                            env=env, stdout=open(tmp_path / "node.log", "wb"), stderr=subprocess.STDOUT)
    try:
        c.wait_nodes(1)
        runs = {}
        for name, uid, private in (("sharing", USER, ""), ("other-user", USER + 1, ""),
                                   ("own-tmpfs", USER, segments)):
            r = subprocess.run(contained([sys.executable, "-c", CLIENT, c.master, f"box/{name}"],
                                         f"{name}box", uid, private),
                               env=env, capture_output=True, text=True, timeout=120)
            assert r.returncode == 0, r.stderr[-3000:]
            runs[name] = r.stdout.split()
        assert runs["sharing"] == ["sharingbox", "True", "shm"]
        assert runs["other-user"] == ["other-userbox", "True", "tcp"]      # mode 0600: not its file
        assert runs["own-tmpfs"] == ["own-tmpfsbox", "True", "tcp"]        # no segment there
    finally:
        node.terminate()
        node.wait(30)
        c.stop()
