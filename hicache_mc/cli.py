"""``hicache-mc``: serve | master | node | demo here; stats | quota | clear | credential in admin.py;
conductor in conductor/main.py."""
from __future__ import annotations

import argparse
import errno
import faulthandler
import functools
import logging
import os
import signal
import sys
import threading
from typing import Optional

from . import __version__
from .admin import add_commands, token_arg, wait_ready
from .config import ClientConfig, MasterConfig, NodeConfig, load_config
from .errors import ConfigError, HicacheError

log = logging.getLogger("hicache_mc")
SHUTDOWN_GRACE_S = 6    # after SIGTERM/SIGINT: stacks to stderr and exit if still running
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def _master_config(args) -> MasterConfig:
    return load_config(MasterConfig, file=args.config, section="master", host=args.host,
                       port=args.port, token=token_arg(args), metrics_port=args.metrics_port,
                       publish_port=args.publish_port)


def _node_config(args, master: Optional[str] = None) -> NodeConfig:
    return load_config(NodeConfig, file=args.config, section="node", master=master or args.master,
                       host=args.host, advertise_host=args.advertise_host, port=args.node_port,
                       dram=args.dram, token=token_arg(args),
                       node_id=args.node_id, ssd=args.ssd, ssd_dir=args.ssd_dir,
                       durability=args.durability, metrics_port=args.node_metrics_port,
                       te_protocol=args.te_protocol, data_port=args.data_port)


def node_options(sp) -> None:
    sp.add_argument("--node-id")
    sp.add_argument("--advertise-host", help="the address clients dial to reach the node (default: "
                    "--host; for 0.0.0.0, this host's address on its route to the master)")
    sp.add_argument("--dram", help="DRAM tier size, e.g. 4GiB (default 4GiB)")
    sp.add_argument("--ssd", help="SSD tier size, e.g. 100GiB (default 0: no SSD tier)")
    sp.add_argument("--ssd-dir", help="SSD tier folder (default <data_dir>/ssd)")
    sp.add_argument("--durability", choices=["sync", "async", "demote"],
                    help="when writes reach the SSD tier (default async)")
    sp.add_argument("--te-protocol", choices=["tcp", "rdma"],
                    help="serve the DRAM segment through Mooncake's Transfer Engine (default: off)")
    sp.add_argument("--node-metrics-port", type=int,
                    help="the node's /metrics, /health and /ready port (default 0: any free port, "
                         "logged and in stats; -1: off)")
    sp.add_argument("--data-port", type=int,
                    help="the node's stream port for the tcp transport (default 0: any free port)")


def run_services(services, children=()) -> bool:
    """Run each service loop in a thread until Ctrl-C / SIGTERM, then stop them all. With
    ``children`` (processes running other services), also stop when one of them ends, and
    end them on the way out. False when a loop or a child ended by itself."""
    threads = [threading.Thread(target=s.serve_forever, name=s.name, daemon=True) for s in services]
    stop = threading.Event()
    clean = True

    def on_signal(signum, _frame):
        log.info("signal %d: shutting down", signum)
        stop.set()
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    for t in threads:
        t.start()
    while not stop.wait(0.2):
        if not all(t.is_alive() for t in threads):
            log.error("a service loop ended unexpectedly")
            clean = False
            break
        if not all(c.is_alive() for c in children):
            log.error("the %s process ended (exit code %s)",
                      *next((c.name, c.exitcode) for c in children if not c.is_alive()))
            clean = False
            break
    # Bounded shutdown: a process still running SHUTDOWN_GRACE_S from now (a stuck thread, a
    # hang at interpreter exit) gets every thread's stack written to stderr and is ended by
    # the faulthandler's own thread, which needs no GIL.
    faulthandler.dump_traceback_later(SHUTDOWN_GRACE_S, exit=True)
    for c in children:
        if c.is_alive():
            c.terminate()
    for s in reversed(services):
        s.stop()
    for t in threads:
        t.join(timeout=5)
    for c in children:
        c.join(timeout=SHUTDOWN_GRACE_S - 1)
    log.info("stopped")
    return clean


def cmd_serve(args) -> int:
    """Master and node on this host from one command. The node runs in a child process of
    its own: the two then never wait for each other's interpreter lock, and a put's Place
    (master) and Reserve (node) are served side by side."""
    import multiprocessing
    from .master.service import MasterService
    mcfg = _master_config(args)
    ncfg = _node_config(args, master=f"tcp://127.0.0.1:{mcfg.port}"
                        if mcfg.host in ("0.0.0.0", "127.0.0.1") else f"tcp://{mcfg.host}:{mcfg.port}")
    master = MasterService(mcfg)
    node = multiprocessing.get_context("spawn").Process(
        target=serve_node, args=(ncfg, logging.getLogger().level, os.getpid()), name="node")
    node.start()
    log.info("hicache-mc serving: master %s, node process %d (%d MiB DRAM)",
             master.address, node.pid, ncfg.dram >> 20)
    stop = threading.Event()
    threading.Thread(target=_say_ready, args=(ClientConfig(master=ncfg.master, token=mcfg.token), stop),
                     name="ready", daemon=True).start()
    clean = run_services([master], [node])
    stop.set()
    if clean:
        return 0
    return 2 if node.exitcode == 2 else 1      # 2: the node's port is in use


def _say_ready(config: ClientConfig, stop: threading.Event) -> None:
    """Log one "ready" line once the master lists serve's node: from then on it takes writes."""
    ok, what = wait_ready(config, 1, float("inf"), probe=False, stop=stop)
    if ok:
        log.info("hicache-mc ready: %s", what)


def serve_node(config: NodeConfig, level: int, parent: int) -> None:
    """The node of ``serve``, in its child process; it ends when the parent does."""
    _die_with_parent(parent)
    logging.basicConfig(level=level, format=LOG_FORMAT)
    from .node.startup import start_node
    try:
        node = start_node(config)
    except KeyboardInterrupt:
        sys.exit(1)
    except Exception as exc:
        if not isinstance(exc, (HicacheError, OSError)) and not in_use(exc):
            raise
        log.error("the node could not start: %s", in_use(exc) or exc)
        sys.exit(2 if in_use(exc) else 1)
    log.info("node %s on %s, segment %s", node.node_id, node.address, node.info.shm_path)
    sys.exit(0 if run_services([node]) else 1)


def _die_with_parent(parent: int) -> None:
    """SIGTERM this process when its parent dies, even by SIGKILL (Linux: PR_SET_PDEATHSIG)."""
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)   # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:      # it died before the line above took effect
        sys.exit(1)


def cmd_master(args) -> int:
    from .master.service import MasterService
    return 0 if run_services([MasterService(_master_config(args))]) else 1


def cmd_node(args) -> int:
    from .node.startup import start_node
    node = start_node(_node_config(args))
    log.info("node %s on %s, master %s", node.node_id, node.address, node.config.master)
    return 0 if run_services([node]) else 1


def cmd_demo(args) -> int:
    from .demo import run_demo
    return run_demo(dram=args.dram or "2GiB", requests=args.requests, pages=args.pages)


class NoSecretArgument(argparse.Action):
    """``--token``: refused without echoing its value (argv is visible to every user of the
    host; the error would print it again)."""

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error("a secret is never an argument (every user of this host sees the command "
                     "line): give --token-file FILE, or HICACHE_MC_TOKEN")


def build_parser() -> argparse.ArgumentParser:
    # no abbreviations: "--token X" must never be read as "--token-file X" (nor any prefix as
    # another option)
    strict = functools.partial(argparse.ArgumentParser, allow_abbrev=False)
    p = strict(prog="hicache-mc", description="L3 KV-cache store for SGLang HiCache")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    p.add_argument("--version", action="version", version=f"hicache-mc {__version__}")
    sub = p.add_subparsers(dest="cmd", required=True, parser_class=strict)

    def common(sp, master=False):
        sp.add_argument("--config", help="TOML or JSON config file ([master], [node], [client] sections)")
        sp.add_argument("--token-file", metavar="FILE",
                        help="a file holding the cluster token or a credential (else HICACHE_MC_TOKEN "
                             "or the config file's token)")
        sp.add_argument("--token", action=NoSecretArgument, help=argparse.SUPPRESS)
        if master:
            sp.add_argument("--master", help="the master, tcp://HOST:PORT or HOST:PORT (default: "
                            "HICACHE_MC_MASTER, else the config file, else tcp://127.0.0.1:7370)")

    s = sub.add_parser("serve", help="master + one node on this host, from one command")
    common(s)
    s.add_argument("--host", help="bind address (default 127.0.0.1)")
    s.add_argument("--port", type=int, help="master port (default 7370)")
    s.add_argument("--node-port", type=int, help="node data-plane port (default: any free)")
    s.add_argument("--metrics-port", type=int, help="the master's /metrics, /health and /ready port "
                   "(default 9370; 0: any free port; -1: off)")
    s.add_argument("--publish-port", type=int, help="the master's residency publisher, which "
                   "clients' views and the KV-event bridge subscribe to (default 7373; 0: any free "
                   "port; -1: off)")
    node_options(s)
    s.set_defaults(fn=cmd_serve)

    s = sub.add_parser("master", help="run a master")
    common(s)
    s.add_argument("--host")
    s.add_argument("--port", type=int)
    s.add_argument("--metrics-port", type=int, help="/metrics, /health and /ready port "
                   "(default 9370; 0: any free port; -1: off)")
    s.add_argument("--publish-port", type=int, help="residency publisher port (default 7373; "
                   "0: any free port; -1: off)")
    s.set_defaults(fn=cmd_master)

    s = sub.add_parser("node", help="run a storage node")
    common(s, master=True)
    s.add_argument("--host")
    s.add_argument("--node-port", "--port", dest="node_port", type=int)
    node_options(s)
    s.set_defaults(fn=cmd_node)

    add_commands(sub, common)
    from .conductor.main import add_parser as add_conductor
    add_conductor(sub, common)

    s = sub.add_parser("demo", help="start an embedded store and push a KV-page stream through it")
    s.add_argument("--dram", help="DRAM tier of the embedded node (default 2GiB)")
    s.add_argument("--requests", type=int, default=16)
    s.add_argument("--pages", type=int, default=32, help="pages per request")
    s.set_defaults(fn=cmd_demo)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format=LOG_FORMAT)
    try:
        return args.fn(args)
    except ConfigError as exc:
        print(f"hicache-mc: configuration error: {exc}", file=sys.stderr)
        return 2
    except HicacheError as exc:
        print(f"hicache-mc: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:     # `hicache-mc stats | head`: the reader is done, and so are we
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())   # (the exit flush)
        return 141                                                        # 128 + SIGPIPE
    except Exception as exc:
        if not in_use(exc):
            raise
        print(f"hicache-mc: {in_use(exc)}", file=sys.stderr)
        return 2


def in_use(exc: BaseException) -> Optional[str]:
    """The one line for a port that another process holds (ZeroMQ or a plain socket), or None
    for any other error."""
    if getattr(exc, "errno", None) != errno.EADDRINUSE:
        return None
    return (f"cannot listen: {exc}; another process (another hicache-mc?) holds that port: stop "
            "it or choose another (--port, --publish-port, --node-port, --data-port, "
            "--metrics-port, --node-metrics-port)")


if __name__ == "__main__":
    sys.exit(main())
