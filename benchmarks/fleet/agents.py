"""A workload of our own design in the FAST'25 JSONL format: tool-using agents with long
shared system prompts.

    python benchmarks/fleet/agents.py --out agents.jsonl [--seed 0] [--duration 3600]

What it models (every figure below is a parameter of ``AgentMix``):

- **Agents.** Six agent types, each with its own system prompt of 4k to 16k tokens, shared
  by every session of that type; types are picked by a Zipf law (s = 1.2), so one or two
  prompts are hot and the rest lukewarm.
- **Sessions** start as a Poisson process. A session is a task (200-2,000 user tokens) then a
  tool loop: each model call outputs a tool call (50-400 tokens), the tool runs (lognormal,
  median 2 s) and its result (200-4,000 tokens) is appended, and the next call arrives with
  the whole context as its prompt. A session makes 2 to 20 calls (geometric, mean ~7); the
  last outputs the answer (200-800 tokens). The model's own time between calls is taken as
  3 s: the trace is open-loop, like the conversation trace.
- **Blocks** are 512 tokens. A block wholly inside a system prompt has that prompt's id (the
  same for every session of the type); any other full block has an id of its own, kept for
  the rest of the session (the context only grows); the partial last block gets a fresh id
  on every call, because its content changes.

So the prefix reuse is of two kinds: across sessions (the system prompts, which every
instance wants) and within a session (its growing context, which only the instance that
served the previous call, or the shared L3, holds).
"""
from __future__ import annotations

import argparse
import os
import random
import sys
from dataclasses import dataclass
from typing import Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from fleet.workload import BLOCK_TOKENS, TraceRequest, write  # noqa: E402


@dataclass(frozen=True)
class AgentMix:
    system_prompts: tuple = (4096, 6144, 8192, 10240, 12288, 16384)   # tokens, per type
    zipf_s: float = 1.2
    sessions_per_s: float = 0.45
    task_tokens: tuple = (200, 2000)
    tool_call_tokens: tuple = (50, 400)
    tool_result_tokens: tuple = (200, 4000)
    answer_tokens: tuple = (200, 800)
    mean_calls: float = 7.0
    max_calls: int = 20
    tool_median_s: float = 2.0
    tool_sigma: float = 0.8
    model_gap_s: float = 3.0


class _Ids:
    """Block ids: equal keys, equal ids; new keys take the next integer."""

    def __init__(self) -> None:
        self.ids: dict = {}

    def __call__(self, key) -> int:
        return self.ids.setdefault(key, len(self.ids))


def _chain(ids: _Ids, agent: int, system: int, session: int, context: int, call: int) -> tuple:
    full, partial = divmod(context, BLOCK_TOKENS)
    chain = []
    for j in range(full):
        if (j + 1) * BLOCK_TOKENS <= system:
            chain.append(ids(("system", agent, j)))
        else:
            chain.append(ids(("session", session, j)))
    if partial:
        chain.append(ids(("tail", session, call)))
    return tuple(chain)


def _session(rng: random.Random, mix: AgentMix, ids: _Ids, session: int, start: float,
             weights: list) -> list:
    agent = rng.choices(range(len(mix.system_prompts)), weights)[0]
    system = mix.system_prompts[agent]
    context = system + rng.randint(*mix.task_tokens)
    calls = min(mix.max_calls, max(2, 1 + int(rng.expovariate(1.0 / (mix.mean_calls - 1)))))
    out, t = [], start
    for call in range(calls):
        last = call == calls - 1
        output = rng.randint(*(mix.answer_tokens if last else mix.tool_call_tokens))
        out.append((t, context, output, _chain(ids, agent, system, session, context, call)))
        tool_s = mix.tool_median_s * rng.lognormvariate(0.0, mix.tool_sigma)
        t += mix.model_gap_s + tool_s
        context += output + rng.randint(*mix.tool_result_tokens)
    return out


def generate(seed: int = 0, duration_s: float = 3600.0,
             mix: AgentMix = AgentMix(), limit: Optional[int] = None) -> list[TraceRequest]:
    """Requests of sessions starting within ``duration_s``, in arrival order."""
    rng, ids = random.Random(seed), _Ids()
    weights = [1.0 / (k + 1) ** mix.zipf_s for k in range(len(mix.system_prompts))]
    calls, t, session = [], 0.0, 0
    while True:
        t += rng.expovariate(mix.sessions_per_s)
        if t >= duration_s:
            break
        calls.extend(_session(rng, mix, ids, session, t, weights))
        session += 1
    calls.sort(key=lambda c: c[0])
    if limit is not None:
        calls = calls[:limit]
    return [TraceRequest(i, ts, prompt, output, chain)
            for i, (ts, prompt, output, chain) in enumerate(calls)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help=".jsonl or .jsonl.xz")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--duration", type=float, default=3600.0, help="seconds of session starts")
    args = ap.parse_args()
    reqs = generate(args.seed, args.duration)
    write(args.out, reqs)
    print(f"{len(reqs)} requests -> {args.out}")


if __name__ == "__main__":
    main()
