"""Configuration: one frozen dataclass per process role and one loader.

Precedence, lowest first: dataclass defaults < a TOML/JSON file < ``HICACHE_MC_*`` environment
variables (``HICACHE_MC_<ROLE>_<NAME>`` over ``HICACHE_MC_<NAME>``) < explicit keyword arguments. Unknown keys and bad values raise ``ConfigError`` naming
the key. Sizes accept plain bytes or ``4GiB`` / ``512MiB`` / ``64KB``.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, TypeVar

from .errors import ConfigError

ENV_PREFIX = "HICACHE_MC_"
DEFAULT_MASTER = "tcp://127.0.0.1:7370"
SECTIONS = ("master", "node", "client", "conductor")   # a config file's tables: one per role
# A setting two roles have with different meanings (each its own port): only its role's
# variable sets it, so HICACHE_MC_PORT (the master's port) never moves a node's port too
ROLE_ENV = {"env": "role"}

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2,
          "mib": 1024**2, "g": 1000**3, "gb": 1000**3, "gib": 1024**3, "t": 1000**4,
          "tb": 1000**4, "tib": 1024**4}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: Any, name: str = "size") -> int:
    """Bytes from an int or a string such as ``4GiB``; raises ConfigError naming ``name``."""
    if isinstance(value, bool):
        raise ConfigError(f"{name}: expected a size, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(f"{name}: size must be >= 0, got {value}")
        return value
    m = _SIZE_RE.match(str(value))
    if not m or m.group(2).lower() not in _UNITS:
        raise ConfigError(f"{name}: cannot parse size {value!r} (use e.g. 4GiB, 512MiB, 4096)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def size_field(default: str) -> Any:
    """A dataclass field holding a byte count that also accepts ``4GiB``-style strings."""
    return field(default=parse_size(default), metadata={"size": True})


def default_data_dir() -> str:
    """Per-user folder for node data (SSD tier, segment files)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "hicache-mc")


@dataclass(frozen=True)
class MasterConfig:
    """The master: key index, membership and placement."""
    host: str = "127.0.0.1"            # bind address; 127.0.0.1 unless told otherwise
    port: int = 7370
    heartbeat_interval_s: float = 1.0  # nodes heartbeat this often
    liveness: int = 3                  # a node missing this many heartbeats is dropped
    # shared secret of the cluster ("" = none; "@FILE" reads it): the CURVE keys of every ZeroMQ
    # port and the stream ports' handshake derive from it (hicache_mc/auth.py)
    token: str = field(default="", repr=False)    # never in a log line or a traceback
    # Prometheus /metrics, /health, /ready (0 = any free port, -1 = off)
    metrics_port: int = field(default=9370, metadata=ROLE_ENV)
    metrics_host: str = "127.0.0.1"
    tenant_quotas: str = ""            # "teamA=100GiB,teamB=20GiB": bytes per tenant, cluster-wide
    # "teamA=2M,*=1M": keys a tenant may have in the master's index ("*": each tenant not
    # named; "" = no limit); each costs the master ~160 B (docs/operations.md section 9)
    tenant_keys: str = ""
    # residency updates for clients' views and the KV-event bridge (master/publisher.py), on
    # the master's host: a fixed port that firewalls open beside `port`; clients learn it from
    # the master. 0 = any free port (tests, several masters on one host), -1 = off
    publish_port: int = 7373
    publish_beat_s: float = 0.5        # each subscribed namespace gets a beat this often
    expect_nodes: int = 0              # /ready says "degraded" with fewer live nodes (0: any)
    # connections kept on the master's port and on its publisher's, each (with a token: past
    # it, clients are refused at their handshake; nodes and admins never are)
    max_connections: int = 4096

    def __post_init__(self):
        _check_server_token(self.token)
        _check_port(self.port, "port")
        _check_port(self.metrics_port, "metrics_port", lowest=-1)
        _check_port(self.publish_port, "publish_port", lowest=-1)
        _check_positive(self.publish_beat_s, "publish_beat_s")
        _check_positive(self.heartbeat_interval_s, "heartbeat_interval_s")
        _check_positive(self.liveness, "liveness")
        if self.expect_nodes < 0:
            raise ConfigError(f"expect_nodes: must be >= 0, got {self.expect_nodes}")
        _check_positive(self.max_connections, "max_connections")
        parse_quotas(self.tenant_quotas)
        parse_quotas(self.tenant_keys, "tenant_keys", "keys")

    def quotas(self) -> dict[str, int]:
        return parse_quotas(self.tenant_quotas)

    def key_limits(self) -> dict[str, int]:
        """tenant -> keys it may have in the index ("*": any tenant not named)."""
        return parse_quotas(self.tenant_keys, "tenant_keys", "keys")


@dataclass(frozen=True)
class NodeConfig:
    """A storage node: DRAM tier and data plane."""
    master: str = DEFAULT_MASTER
    host: str = "127.0.0.1"            # bind address of the data plane
    # the address clients dial, published to the master ("" = host; for a wildcard host, the
    # address of this host's route to the master)
    advertise_host: str = ""
    port: int = field(default=0, metadata=ROLE_ENV)     # 0 = any free port (reported to the master)
    data_port: int = 0                 # stream port of the tcp transport (0 = any free port)
    node_id: str = ""                  # "" = derived, kept across restarts (node/naming.py)
    dram: int = size_field("4GiB")     # DRAM tier capacity (one shared-memory file)
    high_watermark: float = 0.95       # above this fraction of DRAM, evict LRU objects ...
    low_watermark: float = 0.85        # ... down to this fraction
    lease_s: float = 2.0               # a shm reader must finish copying within this
    reserve_s: float = 10.0            # a shm writer must commit reserved slots within this
    max_value: int = size_field("256MiB")  # largest single object accepted
    heartbeat_interval_s: float = 1.0
    shm_dir: str = "/dev/shm"          # where the DRAM segment file lives
    # Fault in the whole segment at start, and let same-host clients map it pre-populated: the
    # first write into a fresh page otherwise runs at ~2.7 GB/s instead of ~10 GB/s (measured
    # with benchmarks/bench_store.py's memcpy on this machine). Costs the DRAM up front.
    prefault: bool = True
    data_dir: str = field(default_factory=default_data_dir)
    token: str = field(default="", repr=False)
    metrics_port: int = field(default=0, metadata=ROLE_ENV)  # /metrics etc. (0 = any free port, in stats; -1 = off)
    metrics_host: str = "127.0.0.1"
    # SSD tier: enabled when ssd > 0. Its folder is locked by one node at a time.
    ssd: int = size_field("0")                 # SSD tier capacity (0 = no SSD tier)
    ssd_dir: str = ""                          # "" = <data_dir>/ssd
    ssd_segment: int = size_field("256MiB")    # size of one append-only segment file
    ssd_high_watermark: float = 0.95
    ssd_low_watermark: float = 0.85
    durability: str = "async"                  # sync | async | demote (see docs/configuration.md)
    ssd_fsync_interval_s: float = 1.0          # async: fsync this often
    # Mooncake Transfer Engine (transport/mooncake.py): "" = off; "tcp" | "rdma" registers the
    # DRAM segment with a TE and publishes its address, so remote clients read/write it one-sided.
    te_protocol: str = ""
    te_device: str = ""                        # NIC filter, e.g. "mlx5_0,mlx5_1" ("" = all found)
    te_metadata: str = "P2PHANDSHAKE"          # TE metadata service; P2PHANDSHAKE needs none

    def __post_init__(self):
        object.__setattr__(self, "master", master_address(self.master))
        _check_server_token(self.token)
        _check_port(self.port, "port")
        _check_port(self.data_port, "data_port")
        _check_port(self.metrics_port, "metrics_port", lowest=-1)
        _check_te_protocol(self.te_protocol)
        if self.durability not in ("sync", "async", "demote"):
            raise ConfigError(f"durability: expected sync, async or demote, got {self.durability!r}")
        if self.ssd_dir and not self.ssd:
            raise ConfigError(f"ssd_dir is {self.ssd_dir!r} but ssd is 0 (no SSD tier): give the "
                              "tier a size (ssd, --ssd) or leave ssd_dir (--ssd-dir) unset")
        if not 0 < self.ssd_low_watermark <= self.ssd_high_watermark <= 1:
            raise ConfigError("ssd_low_watermark/ssd_high_watermark: need 0 < low <= high <= 1")
        if self.ssd_segment < 1 << 16:
            raise ConfigError(f"ssd_segment: at least 64KiB, got {self.ssd_segment}")
        _check_positive(self.ssd_fsync_interval_s, "ssd_fsync_interval_s")
        if not 0 < self.low_watermark <= self.high_watermark <= 1:
            raise ConfigError(f"low_watermark/high_watermark: need 0 < low <= high <= 1, got "
                              f"{self.low_watermark}/{self.high_watermark}")
        if self.dram < 1 << 20:
            raise ConfigError(f"dram: at least 1MiB, got {self.dram} bytes")
        _check_positive(self.lease_s, "lease_s")
        _check_positive(self.reserve_s, "reserve_s")
        _check_positive(self.max_value, "max_value")
        _check_positive(self.heartbeat_interval_s, "heartbeat_interval_s")


@dataclass(frozen=True)
class ClientConfig:
    """A StoreClient (and the SGLang backend built on it)."""
    master: str = DEFAULT_MASTER
    # auto: shm for a node on this host, mooncake for a remote node that publishes a TE address
    # (when the TE is installed), else tcp. shm | tcp | mooncake force one (falling back to tcp
    # where it cannot reach a node).
    transport: str = "auto"
    timeout_s: float = 5.0             # deadline of every call
    circuit_failures: int = 3          # consecutive failures that open the circuit ...
    circuit_open_s: float = 2.0        # ... for this long (calls answer misses at once)
    verify_checksums: bool = True      # a mismatch is a miss, counted and logged
    token: str = field(default="", repr=False)
    # Mooncake transport (used only when it is chosen; see docs/operations.md)
    te_protocol: str = ""              # "" = what the node publishes; tcp | rdma
    # NIC filter: "mlx5_0", "mlx5_0,mlx5_1", or a per-rank JSON map {"0": "mlx5_0", "1": "mlx5_1"}
    # keyed by the local GPU index (torch.cuda.current_device(), else LOCAL_RANK); "*" = default.
    te_device: str = ""
    te_metadata: str = "P2PHANDSHAKE"  # must match the nodes'
    te_hostname: str = ""              # this host's address for the TE ("" = the route to the master)
    # Registered bounce buffer for caller memory that was not given to register_buffer.
    te_staging: int = size_field("64MiB")
    # answer batch_exists / batch_contains from a local residency view (client/view.py) kept
    # up to date by the master's publisher: on | off | auto (on in the SGLang backend, off in a
    # plain StoreClient)
    view: str = "auto"
    # copies of the hot keys of a put (its Chain says how many, from the first: a shared
    # prompt, a chain's first pages) and, with replicate_reads, of every key this client reads
    # (made from the bytes it read): a node's loss then costs no hit on them (1 = one copy)
    replicas: int = 1
    replicate_reads: bool = False

    def __post_init__(self):
        from .auth import credential
        from .limits import MAX_REPLICAS
        object.__setattr__(self, "master", master_address(self.master))
        try:
            credential(self.token)
        except ValueError as exc:
            raise ConfigError(f"token: {exc}") from None
        if self.view not in ("auto", "on", "off"):
            raise ConfigError(f"view: expected auto, on or off, got {self.view!r}")
        if self.transport not in ("auto", "shm", "tcp", "mooncake"):
            raise ConfigError(f"transport: expected auto, shm, tcp or mooncake, got {self.transport!r}")
        _check_te_protocol(self.te_protocol)
        if self.te_staging < 1 << 20:
            raise ConfigError(f"te_staging: at least 1MiB, got {self.te_staging}")
        _check_positive(self.timeout_s, "timeout_s")
        _check_positive(self.circuit_failures, "circuit_failures")
        if self.circuit_open_s < 0:
            raise ConfigError(f"circuit_open_s: must be >= 0, got {self.circuit_open_s}")
        if not 1 <= self.replicas <= MAX_REPLICAS:
            raise ConfigError(f"replicas: expected 1..{MAX_REPLICAS}, got {self.replicas}")


@dataclass(frozen=True)
class ConductorServerConfig:
    """``hicache-mc conductor``: the HTTP router in front of SGLang workers (conductor/)."""
    host: str = "127.0.0.1"            # bind address of the HTTP port
    port: int = field(default=30000, metadata=ROLE_ENV)   # SGLang's router's default port
    # workers, comma-separated (more at runtime through the admin API): plain ones, PD prefill
    # ones as "URL" or "URL BOOTSTRAP_PORT", PD decode ones
    worker_urls: str = ""
    prefill_urls: str = ""
    decode_urls: str = ""
    tokenizer: str = ""                # the served model's tokenizer folder ("" = route on load)
    page_size: int = 0                 # tokens per page (0 = the workers' own, from /server_info)
    ttft_slo_s: float = 2.0            # SLOs of requests that name none (headers do)
    tbt_slo_s: float = 0.1
    admission: str = "off"             # off | early | predictive (429 before an SLO is lost)
    slo_tolerance: float = 0.0         # reject above SLO x (1 + tolerance)
    work_weight: float = 2.0           # the core's total-work term (0: Algorithm 1 as written)
    triage: bool = True                # admission off: a request late everywhere -> longest queue
    # the shared L3 (hicache-mc): its master, the deployment's namespace (the SGLang backend
    # logs it) and its page parts (k,v; kv for MLA); "" = no L3
    l3_master: str = ""
    l3_namespace: str = ""
    l3_parts: str = "k,v"
    token: str = field(default="", repr=False)   # the L3 client credential ("@FILE" reads it)
    kv_bytes_per_token: int = 0        # KV bytes of one token on a worker (0 = the model's default)
    host_bw: float = 0.0               # B/s of a worker's L2 -> L1 path (0 = the model's default)
    l3_bw: float = 0.0                 # B/s of a worker's L3 -> L2 path (0 = the model's default)
    poll_s: float = 0.2                # /v1/loads polls: a failing worker is out within ~2 of them
    stall_s: float = 1.0               # expected KV events this late mark the stream stalled
    index_blocks: int = 1 << 20        # the block index's LRU bound
    max_body: int = size_field("32MiB")    # largest request body
    max_inflight: int = 4096           # requests in progress beyond which new ones get 503
    retries: int = 2                   # times a request a worker failed unstarted is re-routed
    request_timeout_s: float = 1800.0  # a worker's whole answer, as SGLang's router allows
    shutdown_grace_s: float = 30.0     # after SIGTERM, requests in progress get this long
    api_key: str = field(default="", repr=False)     # clients' bearer token ("" = none)
    admin_key: str = field(default="", repr=False)   # the admin API's bearer token ("" = off)

    def __post_init__(self):
        _check_port(self.port, "port")
        if self.admission not in ("off", "early", "predictive"):
            raise ConfigError(f"admission: expected off, early or predictive, got {self.admission!r}")
        if bool(self.l3_master) != bool(self.l3_namespace):
            raise ConfigError("l3_master and l3_namespace: give both (the L3 view) or neither")
        if self.l3_master:
            object.__setattr__(self, "l3_master", master_address(self.l3_master))
        for name in ("ttft_slo_s", "tbt_slo_s", "poll_s", "stall_s", "request_timeout_s", "shutdown_grace_s",
                     "index_blocks", "max_body", "max_inflight"):
            _check_positive(getattr(self, name), name)
        if self.page_size < 0 or self.retries < 0 or self.slo_tolerance < 0:
            raise ConfigError("page_size, retries and slo_tolerance must be >= 0")


def master_address(value: str) -> str:
    """``tcp://HOST:PORT``, from itself or from ``HOST:PORT`` (Mooncake's form); anything else
    is a ConfigError: a master address ZeroMQ cannot dial would turn every call into a miss."""
    text = str(value).strip()
    host, sep, port = text.removeprefix("tcp://").rpartition(":")
    if not sep or not host or "/" in host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"master: expected tcp://HOST:PORT or HOST:PORT, got {value!r}")
    return f"tcp://{host}:{port}"


def _check_server_token(token: str) -> None:
    from .auth import PREFIX
    if token.startswith(PREFIX + ":"):
        raise ConfigError("token: the master and the nodes hold the cluster token itself; a "
                          "credential is for clients and administrators")


def parse_quotas(text: str, name: str = "tenant_quotas", what: str = "size") -> dict[str, int]:
    """``"teamA=100GiB,teamB=20GiB"`` -> {"teamA": ..., "teamB": ...} (``2M`` counts keys as
    well as bytes); ConfigError names the entry."""
    out = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        tenant, sep, size = item.partition("=")
        if not sep or not tenant.strip():
            raise ConfigError(f"{name}: expected tenant={what}, got {item!r}")
        out[tenant.strip()] = parse_size(size.strip(), f"{name}[{tenant.strip()}]")
    from .limits import MAX_TENANTS
    if len(out) > MAX_TENANTS:      # what a node's heartbeat reply can carry
        raise ConfigError(f"{name}: at most {MAX_TENANTS} tenants, got {len(out)}")
    return out


def _check_port(value: int, name: str, lowest: int = 0) -> None:
    if not lowest <= value <= 65535:
        raise ConfigError(f"{name}: expected {lowest}..65535, got {value}")


def _check_te_protocol(value: str) -> None:
    if value not in ("", "tcp", "rdma"):
        raise ConfigError(f"te_protocol: expected tcp, rdma or empty, got {value!r}")


def _check_positive(value: float, name: str) -> None:
    if value <= 0:
        raise ConfigError(f"{name}: must be > 0, got {value}")


T = TypeVar("T")


def load_config(cls: type[T], file: Optional[str] = None, env: Optional[Mapping[str, str]] = None,
                section: Optional[str] = None, **explicit: Any) -> T:
    """Build ``cls`` from defaults < ``file`` < env ``HICACHE_MC_*`` < ``explicit``.

    ``file`` is TOML or JSON; its keys may sit at the top level or under ``[section]``.
    ``None`` values in ``explicit`` mean "not given". Unknown keys raise ConfigError.
    """
    fields = {f.name: f for f in dataclasses.fields(cls)}
    values: dict[str, Any] = {}
    if file:
        values.update(_read_file(file, section, fields))
    env = os.environ if env is None else env
    for name, f in fields.items():
        # HICACHE_MC_NODE_DRAM targets one role; HICACHE_MC_DRAM every role that has the
        # setting, except the ports (ROLE_ENV)
        raw = env.get(f"{ENV_PREFIX}{section.upper()}_{name.upper()}") if section else None
        if raw is None and not (section and f.metadata.get("env") == "role"):
            raw = env.get(ENV_PREFIX + name.upper())
        if raw is not None:
            values[name] = raw
    for name, value in explicit.items():
        if value is None:
            continue
        if name not in fields:
            raise ConfigError(f"{name}: unknown setting for {cls.__name__} "
                              f"(known: {', '.join(sorted(fields))})")
        values[name] = value
    converted = {name: _convert(fields[name], value) for name, value in values.items()}
    try:
        return cls(**converted)
    except TypeError as exc:  # pragma: no cover - guarded by the checks above
        raise ConfigError(str(exc)) from exc


def _read_file(path: str, section: Optional[str], fields: Mapping[str, Any]) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise ConfigError(f"config file {path!r}: {exc.strerror}") from exc
    try:
        if path.endswith(".json"):
            doc = json.loads(data)
        else:
            try:
                import tomllib
            except ImportError:  # Python 3.10: the same parser, as the tomli package
                import tomli as tomllib
            doc = tomllib.loads(data.decode())
    except Exception as exc:
        raise ConfigError(f"config file {path!r}: {exc}") from exc
    unknown = [name for name, value in doc.items() if isinstance(value, dict) and name not in SECTIONS]
    if unknown:
        raise ConfigError(f"[{unknown[0]}]: unknown section in {path!r} (known: "
                          f"{', '.join(f'[{s}]' for s in SECTIONS)})")
    if section and isinstance(doc.get(section), dict):
        doc = doc[section]
    else:   # the top-level keys; the tables are the other roles' sections
        doc = {name: value for name, value in doc.items() if not isinstance(value, dict)}
    out = {}
    for name, value in doc.items():
        if name not in fields:
            raise ConfigError(f"{name}: unknown setting in {path!r} (known: {', '.join(sorted(fields))})")
        out[name] = value
    return out


def _convert(f: dataclasses.Field, value: Any) -> Any:
    name, typ = f.name, f.type
    if f.metadata.get("size"):
        return parse_size(value, name)
    if name in ("token", "api_key", "admin_key") and isinstance(value, str) and value.startswith("@"):
        try:   # a token kept in a file stays out of process listings and shell history
            with open(value[1:]) as fh:
                token = fh.read().strip()
        except OSError as exc:
            raise ConfigError(f"{name}: cannot read {value[1:]!r}: {exc.strerror}") from None
        if not token:       # an empty file must not silently mean "no authentication"
            raise ConfigError(f"{name}: {value[1:]!r} is empty")
        return token
    try:
        if typ in ("bool", bool):
            if isinstance(value, bool):
                return value
            text = str(value).strip().lower()
            if text in ("1", "true", "yes", "on"):
                return True
            if text in ("0", "false", "no", "off"):
                return False
            raise ValueError
        if typ in ("int", int):
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            return int(value)
        if typ in ("float", float):
            if isinstance(value, bool):
                raise ValueError
            return float(value)
        if typ in ("str", str):
            if not isinstance(value, (str, int, float)) or isinstance(value, bool):
                raise ValueError
            return str(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{name}: expected {typ}, got {value!r}") from None
    return value
