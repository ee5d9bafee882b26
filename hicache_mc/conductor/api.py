"""The Conductor's contract: what a router observes, what it is asked, what it answers.

Every router (the Conductor's own core, and each baseline the fleet simulator compares it with)
implements ``Router``. Whoever drives it (the fleet simulator, or the HTTP server in front of
SGLang) feeds it the same four kinds of observation, each when it would arrive in production,
and asks it ``route`` once per request:

- ``add_worker`` / ``remove_worker``: the fleet as configured (flags, config file, admin API);
- ``observe_events``: a worker's KV events (SGLang's ``--kv-events-config`` publisher): pages
  entering and leaving its GPU (L1) and host (L2) tiers, late by the publisher's delay, with
  gaps filled by replay (or a ``Cleared`` when they cannot be);
- ``observe_load``: a worker's load report (SGLang's ``/v1/loads``), every poll interval;
- ``observe_started`` / ``observe_finished``: what a request's response said once it got its
  first token and once it ended (SGLang's ``meta_info``: cached tokens per tier, timings);
  these feed the online cost model and retire the router's own accounting of work in flight.

A router never reads the simulator's internals or a worker's memory: only these. The shared
L3's residency is the one thing it asks for itself, through the ``L3Lookup`` it was built with
(the residency view of ``StoreClient``; a simulated view in the simulator).

No I/O happens here: nothing blocks, nothing sleeps, time is the ``now_s`` passed in.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Optional, Protocol, Sequence, Union


class Tier(enum.IntEnum):
    """Where a page of a prefix sits, nearest first."""
    GPU = 1          # L1: the instance's device pool (SGLang medium GPU)
    HOST = 2         # L2: the instance's host pool (SGLang medium CPU_PINNED)
    L3 = 3           # the shared pool: hicache-mc's DRAM and SSD


class Role(enum.Enum):
    BOTH = "both"            # prefill and decode on one instance (no PD)
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(frozen=True)
class WorkerSpec:
    """A worker as configured. Bandwidths are bytes/s of each path into its GPU."""
    name: str
    role: Role = Role.BOTH
    page_tokens: int = 64                 # SGLang --page-size
    page_bytes: int = 0                   # KV bytes of one page (all layers, this TP rank)
    host_bw: float = 0.0                  # L2 -> L1
    l3_bw: float = 0.0                    # L3 -> L2 over this worker's path (shm, tcp, TE)
    l1_pages: int = 0                     # capacities, 0 when unknown
    l2_pages: int = 0


@dataclass(frozen=True)
class Request:
    """One request as a router sees it before it is sent anywhere."""
    rid: str
    arrival_s: float
    prompt_tokens: int
    page_hashes: Sequence[str]            # SGLang's chained page hashes of the prompt's full pages
    max_new_tokens: int = 0               # the client's bound; 0 when it gave none
    ttft_slo_s: Optional[float] = None    # per-request SLOs; None: the router's defaults
    tbt_slo_s: Optional[float] = None
    # their KV-event block hashes (chain.chain); None: chain.block_hash of each page hash,
    # which is right for a request with no cache salt and no LoRA
    block_hashes: Optional[Sequence[int]] = None


@dataclass(frozen=True)
class BlocksStored:
    worker: str
    tier: Tier
    block_hashes: Sequence[int]           # SGLang's int64 block hashes, in chain order


@dataclass(frozen=True)
class BlocksRemoved:
    worker: str
    tier: Tier
    block_hashes: Sequence[int]


@dataclass(frozen=True)
class Cleared:
    """Everything of ``worker`` is gone from the index (AllBlocksCleared, an unfillable gap)."""
    worker: str


@dataclass(frozen=True)
class StreamHealth:
    """Whether ``worker``'s event stream is live. While it is not (stalled, or a gap not yet
    filled), the router routes that worker on load alone; ``live=True`` restores its index."""
    worker: str
    live: bool


Event = Union[BlocksStored, BlocksRemoved, Cleared, StreamHealth]


@dataclass(frozen=True)
class LoadReport:
    """A worker's load as its load endpoint reported it at ``at_s``."""
    worker: str
    at_s: float
    waiting_reqs: int = 0
    waiting_tokens: int = 0               # prompt tokens queued for prefill
    running_reqs: int = 0                 # the decode batch
    running_tokens: int = 0               # tokens held by the running batch
    kv_usage: float = 0.0                 # 0..1 of the device pool


@dataclass(frozen=True)
class Started:
    """A request's first token arrived (its prefill is done)."""
    worker: str
    rid: str
    at_s: float


@dataclass(frozen=True)
class Finished:
    """What a request's response reported when it ended."""
    worker: str
    rid: str
    at_s: float
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: dict                   # Tier -> tokens served from that tier
    ttft_s: float                         # measured from arrival at the worker
    prefill_s: Optional[float] = None     # prefill compute alone, when the worker reports it
    ok: bool = True                       # False: failed or aborted


@dataclass(frozen=True)
class Prediction:
    """A predicted TTFT and its parts, for one request on one worker."""
    worker: str
    ttft_s: float
    queue_s: float
    fetch_s: float
    prefill_s: float
    pages: dict = field(default_factory=dict)   # Tier -> pages of the prefix used from it
    recompute_pages: int = 0                    # pages held in some tier but recomputed here
    tbt_s: float = 0.0                          # predicted time per output token


@dataclass(frozen=True)
class Decision:
    worker: str                           # the prefill worker (or the only one)
    prediction: Prediction
    decode_worker: Optional[str] = None   # PD mode
    reasons: str = ""                     # for the debug log
    late: bool = False                    # late on every worker: sent to the longest queue


class RejectReason(enum.Enum):
    TTFT_SLO = "ttft_slo"
    TBT_SLO = "tbt_slo"
    NO_WORKER = "no_worker"


@dataclass(frozen=True)
class Rejection:
    reason: RejectReason
    retry_after_s: float
    prediction: Optional[Prediction] = None
    reasons: str = ""


class L3Lookup(Protocol):
    def __call__(self, page_hashes: Sequence[str]) -> int:
        """The number of leading pages of the chain the shared L3 holds now."""
        ...


class Router(Protocol):
    """A routing policy. Observation methods are cheap and never fail on unknown workers."""

    def add_worker(self, spec: WorkerSpec) -> None:
        """Start routing to ``spec.name`` (again, with a fresh state, if it was known)."""
        ...

    def remove_worker(self, name: str) -> None:
        """Stop routing to ``name`` and forget its state."""
        ...

    def observe_events(self, events: Sequence[Event]) -> None:
        """Apply KV events in the order the worker published them."""
        ...

    def observe_load(self, report: LoadReport) -> None:
        """Take a load report; it supersedes the router's own estimate up to ``at_s``."""
        ...

    def observe_started(self, started: Started) -> None:
        """A request routed here has its first token."""
        ...

    def observe_finished(self, finished: Finished) -> None:
        """A request routed here ended; feeds the online model."""
        ...

    def route(self, req: Request, now_s: float) -> Union[Decision, Rejection]:
        """Choose the worker for ``req``, or reject it. Counts it as in flight there."""
        ...
