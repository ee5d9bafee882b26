"""The admin commands of ``hicache-mc``: stats | quota | clear | wait | credential, against a
running master (``cli.py`` runs the processes)."""
from __future__ import annotations

import dataclasses
import json
import sys
import threading
import time
from typing import Optional

from .config import ClientConfig, MasterConfig, load_config
from .errors import ConfigError, HicacheError, RemoteError

PROBE_NAMESPACE = "hicache-mc-probe"    # wait's probe objects (removed once written)


def token_arg(args) -> Optional[str]:
    """``--token-file`` as the config loader reads it ("@FILE"); None leaves the token to the
    config file or HICACHE_MC_TOKEN. A secret is never an argument: argv is visible to every
    user of the host."""
    return f"@{args.token_file}" if args.token_file else None


def client_config(args) -> ClientConfig:
    return load_config(ClientConfig, file=args.config, section="client", master=args.master,
                       token=token_arg(args), timeout_s=getattr(args, "timeout", None))


def call(config: ClientConfig, msg, timeout_s: float, address: str = "", what: str = "the master"):
    """One request to the master (or the node at ``address``); its reply, or a HicacheError
    whose text is the one line the CLI prints."""
    import zmq
    from .errors import Misconfigured, StoreUnavailable
    from .rpc import Channel
    address = address or config.master
    ch = Channel(zmq.Context.instance(), address, config.token)     # the one StoreClient uses
    try:
        return ch.call(msg, timeout_s)
    except Misconfigured as exc:
        why = str(exc).removeprefix(f"{address}: ")
        raise Misconfigured(f"{what} at {address} refused this connection: {why}", exc.down) from None
    except StoreUnavailable as exc:
        why = str(exc).removeprefix(f"{address}: ")
        hint = " (is it running? --master, HICACHE_MC_MASTER)" if what == "the master" else ""
        raise StoreUnavailable(f"no answer from {what} at {address}: {why}{hint}") from None
    except RemoteError as exc:
        raise HicacheError(f"{what} at {address} refused the request: {exc}"
                           f"{_role_hint(config) if exc.code == 'forbidden' else ''}") from None
    finally:
        ch.close()


def _role_hint(config: ClientConfig) -> str:
    """What a refusal for the caller's role means, naming the role it holds."""
    from .auth import credential
    cred = credential(config.token)
    if cred is None or cred.role != "client":
        return ""
    return (f" (this process holds a client credential of tenant {cred.tenant or '(default)'!r}: "
            "quotas, node stats and other tenants' keys need an admin credential, from "
            "'hicache-mc credential --role admin', or the token)")


def cmd_stats(args) -> int:
    from . import protocol as P
    config = client_config(args)
    while True:
        try:
            stats = call(config, P.StatsRequest(), args.timeout).stats
        except HicacheError as exc:
            if not args.watch:
                raise
            print(f"hicache-mc: {exc}", file=sys.stderr)
        else:
            if args.json:
                print(json.dumps(stats, indent=2, sort_keys=True))
            else:
                if args.watch:
                    print("\033[2J\033[H", end="")   # clear the terminal, cursor home
                print(format_stats(stats))
        if not args.watch:
            return 0
        time.sleep(args.watch)


def n_nodes(n: int) -> str:
    return f"{n} node" if n == 1 else f"{n} nodes"


def format_stats(stats: dict) -> str:
    """The at-a-glance table of ``hicache-mc stats``."""
    lines = [f"master {stats['epoch']} (hicache-mc {stats.get('version', '?')}): {stats['keys']} keys on {n_nodes(len(stats['nodes']))}, "
             f"DRAM {_mib(stats['used'])} / {_mib(stats['capacity'])} MiB used",
             f"lookups {stats['hits']} hits / {stats['misses']} misses; placed {stats['placed']}, "
             f"deduplicated {stats['deduplicated']}, evicted {stats['evicted']}, "
             f"cleared {stats.get('cleared', 0)}, "
             f"nodes expired {stats['nodes_expired']}", ""]
    head = (f"{'node':<22}{'objects':>9}{'DRAM MiB':>15}{'SSD MiB':>15}{'evict':>8}{'demote':>8}"
            f"{'promote':>8}{'compact':>8}{'corrupt':>8}{'age s':>7}")
    lines.append(head)
    for n in stats["nodes"]:
        ssd = f"{_mib(n.get('ssd_used', 0))}/{_mib(n.get('ssd_capacity', 0))}" if n.get("ssd_capacity") else "-"
        lines.append(f"{n['node_id']:<22}{n.get('objects_total', n.get('objects', 0)):>9}"
                     f"{_mib(n.get('used', 0)):>7}/{_mib(n['capacity']):<7}{ssd:>15}"
                     f"{n.get('evictions', 0):>8}{n.get('ssd_demotions', 0):>8}{n.get('ssd_promotions', 0):>8}"
                     f"{n.get('ssd_compactions', 0):>8}{n.get('ssd_corrupt', 0):>8}{n.get('age_s', 0):>7.1f}")
    lines += [f"DEGRADED {n['node_id']}: {n['degraded']}" for n in stats["nodes"] if n.get("degraded")]
    lines += [f"LOST {n['node_id']} ({n['address']}): missed its heartbeats {n['lost_s']:.0f} s ago; "
              "its keys are misses until it registers again" for n in stats.get("lost", ())]
    expect = stats.get("expect_nodes", 0)
    if len(stats["nodes"]) < expect:
        lines.append(f"DEGRADED: {len(stats['nodes'])} of {expect} storage nodes live (expect_nodes)")
    if stats.get("tenants"):
        lines += ["", f"{'tenant':<22}{'used MiB':>12}{'quota MiB':>12}{'keys':>12}{'key limit':>12}"]
        for t, row in sorted(stats["tenants"].items()):
            quota = "-" if row["quota"] is None else str(_mib(row["quota"]))
            limit = "-" if row.get("key_limit") is None else str(row["key_limit"])
            lines.append(f"{t or '(none)':<22}{_mib(row['used']):>12}{quota:>12}"
                         f"{row.get('keys', 0):>12}{limit:>12}")
    return "\n".join(lines)


def cmd_quota(args) -> int:
    from . import protocol as P
    from .config import parse_size
    quota = -1 if args.size in ("none", "off") else parse_size(args.size, "size")
    call(client_config(args), P.QuotaRequest(args.tenant, quota), args.timeout)
    print(f"tenant {args.tenant}: quota {'removed' if quota < 0 else args.size}")
    return 0


def cmd_clear(args) -> int:
    """Remove the keys under ``--prefix`` from every node (all of them only with ``--yes``)."""
    from . import protocol as P
    if not args.prefix and not args.yes:
        print("hicache-mc: clear without --prefix removes every key in the store (every key of "
              "your tenant, with a client credential); add --yes to do that", file=sys.stderr)
        return 2
    config = client_config(args)
    removed = 0
    for node in call(config, P.StatsRequest(), args.timeout).stats["nodes"]:
        removed += call(config, P.ClearRequest(args.prefix), args.timeout, node["address"],
                        f"node {node['node_id']}").removed
    print(f"removed {removed} objects")
    return 0


def wait_ready(config: ClientConfig, nodes: int = 1, timeout_s: float = 60.0, probe: bool = True,
               stop: Optional[threading.Event] = None, pid: int = 0) -> tuple[bool, str]:
    """Ask the master until it lists at least ``nodes`` live nodes and, with ``probe``, a put of a
    probe object (over ``tcp``, then removed) succeeds and this host reaches the master's
    publish port: (True, what is up), or (False, why not) once ``timeout_s`` has passed,
    ``stop`` is set, or the process ``pid`` (the store being waited for) has ended."""
    from . import protocol as P
    end, why, client, stop = time.monotonic() + timeout_s, "", None, stop or threading.Event()
    try:
        while True:
            try:
                stats = call(config, P.StatsRequest(), min(config.timeout_s, 2.0)).stats
                ids = [n["node_id"] for n in stats["nodes"]]
                if len(ids) < nodes:
                    why = f"{len(ids)} of {nodes} storage nodes live"
                else:
                    if probe and client is None:
                        from .client import StoreClient
                        client = StoreClient(config=dataclasses.replace(config, transport="tcp",
                                                                        circuit_open_s=0))
                    if probe and not _probe(client):
                        why = f"{n_nodes(len(ids))} live, but a probe put failed (see the nodes' logs)"
                    else:
                        why = _publisher_problem(config, stats.get("publish_port", -1)) if probe else ""
                        if not why:
                            return True, (f"master {config.master} (hicache-mc {stats.get('version', '?')}), "
                                          f"{n_nodes(len(ids))} live ({', '.join(ids)})"
                                          + (", a probe put succeeded" if probe else ""))
            except HicacheError as exc:
                why = str(exc)
            if pid and not _running(pid):
                return False, f"process {pid} ended (its output says why); last: {why}"
            if time.monotonic() >= end or stop.wait(0.25):
                return False, why
    finally:
        if client is not None:
            client.close()


def _running(pid: int) -> bool:
    """Whether process ``pid`` runs (an exited child not yet reaped does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def _publisher_problem(config: ClientConfig, port: int) -> str:
    """Why this host cannot subscribe to the master's publish port ("" when it can, or when the
    master publishes nothing): its residency views and KV-event bridges would fail there."""
    import zmq
    from . import protocol as P
    from .auth import credential, secure_client
    from .link import reach
    from .rpc import host_of
    if port < 0:
        return ""
    host = host_of(config.master)
    address = f"tcp://{'[' + host + ']' if ':' in host else host}:{port}"
    cred = credential(config.token)
    sock = secure_client(zmq.Context.instance().socket(zmq.SUB), cred, P.MAX_HEADER_BYTES)
    down = reach(sock, address, cred is not None, min(config.timeout_s, 2.0))
    return "" if down is None else (f"the master's publish port {address}: {down.value} (clients' "
                                    "residency views and the KV-event bridge subscribe there: open "
                                    "it to this host, or set publish_port)")


def _probe(client) -> bool:
    """Put one small object in the probe namespace (of the credential's tenant), then remove it."""
    import uuid
    from .auth import tenant_for
    from .keys import with_tenant
    key = f"{with_tenant(PROBE_NAMESPACE, tenant_for(client.config.token, ''))}/{uuid.uuid4().hex}"
    if not client.put(key, b"hicache-mc wait"):
        return False
    client.clear(key)
    return True


def cmd_wait(args) -> int:
    ok, what = wait_ready(client_config(args), args.nodes, args.wait_s, pid=args.pid)
    if not ok:
        when = "" if args.pid and not _running(args.pid) else f" after {args.wait_s:g} s"
        print(f"hicache-mc: not ready{when}: {what}", file=sys.stderr)
        return 1
    print(f"ready: {what}")
    return 0


def cmd_credential(args) -> int:
    """Print a credential derived from the cluster token (for clients and administrators)."""
    from .auth import issue
    token = load_config(MasterConfig, file=args.config, section="master", token=token_arg(args)).token
    if not token:
        raise ConfigError("token: set one (--token-file, HICACHE_MC_TOKEN or the config file); "
                          "credentials derive from it")
    try:
        text = issue(token, args.role, args.tenant).text()
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    _private_stdout()
    print(text)
    return 0


def _private_stdout() -> None:
    """``credential > FILE``: the shell made FILE with its umask (often readable by everyone);
    make it readable by its owner alone before the secret goes in, or say so."""
    import os
    import stat
    fd = sys.stdout.fileno()
    mode = os.fstat(fd).st_mode
    if stat.S_ISREG(mode) and mode & 0o077:
        try:
            os.fchmod(fd, stat.S_IMODE(mode) & 0o600)
        except OSError as exc:
            print(f"hicache-mc: warning: the file receiving the credential is readable by others "
                  f"and could not be restricted ({exc.strerror}): chmod 600 it", file=sys.stderr)


def _mib(n) -> int:
    return int(n) >> 20


def add_commands(sub, common) -> None:
    """The admin subcommands of the ``hicache-mc`` parser."""
    s = sub.add_parser("stats", help="cluster stats")
    common(s, master=True)
    s.add_argument("--json", action="store_true")
    s.add_argument("--watch", type=float, nargs="?", const=2.0, default=0.0, metavar="SECONDS",
                   help="refresh every SECONDS (default 2) until Ctrl-C")
    s.add_argument("--timeout", type=float, default=3.0)
    s.set_defaults(fn=cmd_stats)

    s = sub.add_parser("quota", help="set or remove a tenant's quota (bytes across the cluster)")
    common(s, master=True)
    s.add_argument("tenant")
    s.add_argument("size", help="e.g. 100GiB, or 'none' to remove the quota")
    s.add_argument("--timeout", type=float, default=3.0)
    s.set_defaults(fn=cmd_quota)

    s = sub.add_parser("clear", help="remove keys (all, or those under a prefix)")
    common(s, master=True)
    s.add_argument("--prefix", "--namespace", dest="prefix", default="",
                   help="remove the keys that start with this (e.g. a namespace and '/')")
    s.add_argument("--yes", action="store_true", help="confirm a clear without --prefix: every key")
    s.add_argument("--timeout", type=float, default=10.0)
    s.set_defaults(fn=cmd_clear)

    s = sub.add_parser("wait", help="wait until the store accepts writes (exit 0), or time out (exit 1)")
    common(s, master=True)
    s.add_argument("--nodes", type=int, default=1, help="live storage nodes to wait for (default 1)")
    s.add_argument("--timeout", dest="wait_s", type=float, default=60.0, metavar="SECONDS",
                   help="give up after this long (default 60)")
    s.add_argument("--pid", type=int, default=0,
                   help="give up as soon as this process (the store being started) has ended")
    s.set_defaults(fn=cmd_wait)

    s = sub.add_parser("credential", help="print a client's or an administrator's credential")
    common(s)
    s.add_argument("--role", choices=["client", "admin"], default="client")
    s.add_argument("--tenant", default="", help="the client's tenant (default: the default tenant)")
    s.set_defaults(fn=cmd_credential)
