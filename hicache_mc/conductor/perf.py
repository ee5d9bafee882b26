"""How long an SGLang instance takes to prefill and to decode: a roofline model of a
Llama-3-8B-class model on one H100, calibrated on SGLang's published figures.

The fleet simulator (``benchmarks/fleet/``) times every prefill and decode step with it, the
stand-in SGLang workers of the Conductor's server take their timing from it, and a router may
use it as its offline-profiled model (Mooncake's Algorithm 1 estimates prefill time "from an
offline test"). Nothing here fits online: that is the core's job (``model.py``).

API::

    perf = PerfModel()                     # LLAMA3_8B on H100_SXM, the calibration below
    perf.prefill_s(new_tokens, cached_tokens)        # one request's prefill, alone
    perf.prefill_batch_s([(new, cached), ...])       # one forward over several (chunks)
    perf.decode_step_s(batch, kv_tokens)             # one decode step of the running batch
    perf.kv_bytes_per_token, perf.page_bytes(page_tokens)

The model (every figure per forward pass):

- **Prefill** is compute-bound. The linear layers cost ``2 x P_layers`` FLOPs per new token
  (``P_layers``: the weights of the 32 decoder layers, 6.98e9; the LM head runs for the last
  token only); attention costs ``4 x layers x q_heads x head_dim`` FLOPs per (query, key) pair,
  and a new token at position ``c + i`` attends over ``c + i`` keys, so a prefill of ``n`` new
  tokens after ``c`` cached ones does ``n x (c + n/2)`` pairs: the cached prefix is not free,
  its keys are read by every new token. Linear layers run at ``gemm_mfu`` of the GPU's dense
  BF16 peak, attention at ``attn_mfu``; ``prefill_overhead_s`` covers scheduling and launch.
- **Decode** is bandwidth-bound: a step reads every weight once (15.0 GB: all but the input
  embedding) plus the KV of every token the batch attends over, at ``hbm_eff`` of peak HBM
  bandwidth; its compute (``2 x P`` FLOPs per sequence) only overtakes the reads near batch
  200. The step takes the larger of the two, plus ``step_overhead_s`` (CUDA graphs replay the
  launches; what is left is the scheduler's turn).
- **KV bytes per token** = 2 (K, V) x layers x kv_heads x head_dim x 2 bytes (BF16) = 128 KiB.

Sources:

- Model shape: Meta-Llama-3-8B ``config.json`` (32 layers, hidden 4096, 32 query heads, 8 KV
  heads, head_dim 128, intermediate 14336, vocab 128256, untied LM head).
- H100 SXM5 datasheet: 989 TFLOP/s dense BF16, 3.35 TB/s HBM3, 80 GB.
- SGLang's own performance gates for Llama-3.1-8B-Instruct on its H100 CI runners
  (sgl-project/sglang ``test/srt/test_bench_one_batch.py``, ``test_bench_serving.py``; the
  workload defaults are in ``sglang.test.test_utils.run_bench_serving``, installed here):
  (a) batch 1 decodes at > 135 tokens/s, so a step takes < 7.4 ms;
  (b) random prompts uniform in 1..4096 tokens, outputs in 1..2048, 1 request/s: median TTFT
      < 80 ms and median inter-token latency < 12 ms;
  (c) 500 such requests at once: output throughput > 2,830 tokens/s.
- SGLang's defaults on an 80 GB GPU (``srt/arg_groups/memory_hook.py``): chunked prefill of
  8,192 tokens, CUDA-graph decode batch up to 256, ~12.8 GB held back for activations, which
  leaves ~51 GB of KV pool after the weights: ``L1_TOKENS`` (~400k tokens).

What was derived, and how: the efficiencies are the only free constants. ``hbm_eff`` 0.80
and ``step_overhead_s`` 0.6 ms put a batch-1 step at 6.2 ms (161 tokens/s, inside (a) with
the margin a CI gate keeps). ``gemm_mfu`` 0.55 and ``attn_mfu`` 0.35 (FlashInfer / FA3 reach
about that on H100 at these shapes) give a cold 2,048-token prefill 64 ms with the 8 ms
prefill overhead, inside (b); a decode step of a few requests is ~6.5-7.5 ms, inside (b).
``tests/conductor/test_fleet_perf.py`` keeps the model inside (a) and (b) and checks its
shape (prefill superlinear in prompt length, the cached prefix cheaper than recomputing it,
decode steps growing with the batch's KV); ``tests/conductor/test_sim.py`` runs (b) and (c)
on one simulated instance: median TTFT 71 ms, median ITL 7.6 ms, 3,760 output tokens/s.

Derived figures: cold prefill 32.6k tokens/s at 4k tokens, 30.4k at 8k, 19.7k at 32k, 8.3k at
126k (attention's share grows with length); 8k new tokens after 24k cached take 0.57 s
against 1.66 s for the cold 32k; a decode step of 64 requests over 2k-token contexts takes
12.6 ms.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Iterable, NamedTuple, Tuple


@dataclass(frozen=True)
class ModelShape:
    """A dense decoder-only transformer with grouped-query attention."""
    name: str
    layers: int
    hidden: int
    q_heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    dtype_bytes: int = 2                  # BF16 weights and KV

    @property
    def layer_params(self) -> int:
        """Weights of the decoder layers (attention projections + gated MLP); norms omitted."""
        q = self.hidden * self.q_heads * self.head_dim
        kv = 2 * self.hidden * self.kv_heads * self.head_dim
        o = self.q_heads * self.head_dim * self.hidden
        mlp = 3 * self.hidden * self.intermediate
        return self.layers * (q + kv + o + mlp)

    @property
    def head_params(self) -> int:
        return self.vocab * self.hidden   # the LM head (untied); the embedding is as large

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes

    @property
    def attn_flops_per_pair(self) -> int:
        """Q.K^T and P.V for one (query, key) pair, all layers and heads."""
        return 4 * self.layers * self.q_heads * self.head_dim


@dataclass(frozen=True)
class GpuSpec:
    name: str
    bf16_flops: float                     # dense, FLOP/s
    hbm_bw: float                         # bytes/s
    memory: int                           # bytes


class _Rates(NamedTuple):
    """A PerfModel's figures per unit of work, in seconds."""
    per_token_s: float        # prefill linear layers, per new token
    head_s: float             # the LM head, once per request's prefill
    per_pair_s: float         # prefill attention, per (query, key) pair
    weights_s: float          # a decode step's weight reads
    kv_token_s: float         # a decode step's reads, per KV token attended
    seq_step_s: float         # a decode step's compute, per sequence


LLAMA3_8B = ModelShape("Llama-3-8B", layers=32, hidden=4096, q_heads=32, kv_heads=8,
                       head_dim=128, intermediate=14336, vocab=128256)
H100_SXM = GpuSpec("H100-SXM5-80GB", bf16_flops=989e12, hbm_bw=3.35e12, memory=80 * 10**9)

# SGLang's KV pool on one 80 GB H100 for Llama-3-8B (module docstring: ~51 GB / 128 KiB).
L1_TOKENS = 400_000
# SGLang's default chunk on an 80 GB GPU (srt/arg_groups/memory_hook.py).
CHUNKED_PREFILL_TOKENS = 8192
# SGLang's default CUDA-graph decode batch on an 80 GB GPU at TP 1: the running batch cap.
MAX_RUNNING_REQUESTS = 256


@dataclass(frozen=True)
class PerfModel:
    """Prefill and decode times of one instance; see the module docstring for the model."""
    model: ModelShape = LLAMA3_8B
    gpu: GpuSpec = H100_SXM
    gemm_mfu: float = 0.55                # linear layers in prefill, fraction of dense peak
    attn_mfu: float = 0.35                # attention kernels in prefill
    hbm_eff: float = 0.80                 # achieved fraction of HBM bandwidth in decode
    decode_mfu: float = 0.50              # linear layers in decode, once compute-bound
    prefill_overhead_s: float = 0.008     # a prefill forward's scheduling and launch
    step_overhead_s: float = 0.0006       # a decode step's scheduler turn (graphs replayed)

    @property
    def kv_bytes_per_token(self) -> int:
        return self.model.kv_bytes_per_token

    def page_bytes(self, page_tokens: int) -> int:
        """KV bytes of one page of ``page_tokens`` tokens (all layers, one TP rank)."""
        return page_tokens * self.kv_bytes_per_token

    @cached_property
    def _rates(self) -> "_Rates":
        # cached: the simulator asks for these hundreds of thousands of times a run
        m, peak = self.model, self.gpu.bf16_flops
        return _Rates(per_token_s=2.0 * m.layer_params / (peak * self.gemm_mfu),
                      head_s=2.0 * m.head_params / (peak * self.gemm_mfu),
                      per_pair_s=m.attn_flops_per_pair / (peak * self.attn_mfu),
                      weights_s=(m.layer_params + m.head_params) * m.dtype_bytes
                      / (self.gpu.hbm_bw * self.hbm_eff),
                      kv_token_s=m.kv_bytes_per_token / (self.gpu.hbm_bw * self.hbm_eff),
                      seq_step_s=2.0 * (m.layer_params + m.head_params)
                      / (self.gpu.bf16_flops * self.decode_mfu))

    def prefill_compute_s(self, new_tokens: int, cached_tokens: int = 0) -> float:
        """The compute of one request's prefill inside a forward, without the overhead."""
        if new_tokens <= 0:
            return 0.0
        r = self._rates
        return (new_tokens * r.per_token_s + r.head_s
                + r.per_pair_s * new_tokens * (cached_tokens + new_tokens / 2.0))

    def prefill_s(self, new_tokens: int, cached_tokens: int = 0) -> float:
        """One request's prefill alone on an idle instance: ``new_tokens`` computed after
        ``cached_tokens`` served from the cache (already in GPU memory)."""
        if new_tokens <= 0:
            return 0.0
        return self.prefill_overhead_s + self.prefill_compute_s(new_tokens, cached_tokens)

    def prefill_batch_s(self, parts: Iterable[Tuple[int, int]]) -> float:
        """One prefill forward over several requests (or chunks): ``(new, cached)`` each. The
        overhead is paid once; linear layers and attention add up per request."""
        total = sum(self.prefill_compute_s(n, c) for n, c in parts)
        return self.prefill_overhead_s + total if total > 0 else 0.0

    def decode_step_s(self, batch: int, kv_tokens: int) -> float:
        """One decode step of ``batch`` sequences attending over ``kv_tokens`` tokens in all."""
        if batch <= 0:
            return 0.0
        r = self._rates
        return self.step_overhead_s + max(r.weights_s + kv_tokens * r.kv_token_s,
                                          batch * r.seq_step_s)

    def prefill_tokens_per_s(self, prompt_tokens: int) -> float:
        """Cold prefill throughput at one prompt length (a figure for docs and tests)."""
        return prompt_tokens / self.prefill_s(prompt_tokens)
