"""The instance performance model stays inside the SGLang figures it was calibrated on, and
keeps the shape the simulator and the routers rely on (hicache_mc/conductor/perf.py)."""
from __future__ import annotations

import pytest

from hicache_mc.conductor.perf import L1_TOKENS, LLAMA3_8B, PerfModel

PERF = PerfModel()


def test_kv_bytes_per_token_is_llama3_8b_bf16():
    # 2 (K, V) x 32 layers x 8 KV heads x 128 dims x 2 bytes
    assert LLAMA3_8B.kv_bytes_per_token == 131072
    assert PERF.page_bytes(64) == 64 * 131072


def test_batch_one_decode_beats_sglang_ci_gate():
    """sglang test_bench_one_batch: Llama-3.1-8B at batch 1 decodes > 135 tokens/s on H100."""
    assert 1.0 / PERF.decode_step_s(1, 2048) > 135


def test_online_latency_inside_sglang_ci_gate():
    """sglang test_online_latency_default: prompts uniform in 1..4096 tokens, 1 request/s:
    median TTFT < 80 ms, median ITL < 12 ms. The median prompt (2,048) alone, and a step of
    the ~8 requests decoding at once (outputs average 1,024 tokens at ~7 ms a step)."""
    assert PERF.prefill_s(2048) < 0.080
    assert PERF.decode_step_s(8, 8 * 3072) < 0.012


def test_prefill_is_superlinear_in_prompt_length():
    per_token = [PERF.prefill_compute_s(n) / n for n in (1024, 8192, 32768, 131072)]
    assert per_token == sorted(per_token) and per_token[-1] > 2 * per_token[0]


def test_cached_prefix_costs_attention_but_less_than_recomputing_it():
    cold = PERF.prefill_s(8192)
    after_prefix = PERF.prefill_s(8192, cached_tokens=24576)
    assert cold < after_prefix < PERF.prefill_s(8192 + 24576)


def test_batched_prefill_pays_the_overhead_once():
    parts = [(2048, 0), (1024, 4096)]
    alone = sum(PERF.prefill_s(n, c) for n, c in parts)
    assert PERF.prefill_batch_s(parts) == pytest.approx(alone - PERF.prefill_overhead_s)
    assert PERF.prefill_batch_s([]) == 0.0


def test_decode_step_grows_with_kv_and_turns_compute_bound():
    assert PERF.decode_step_s(64, 64 * 8192) > PERF.decode_step_s(64, 64 * 1024)
    # bandwidth-bound: batch size alone barely matters at small KV ...
    assert PERF.decode_step_s(32, 0) == PERF.decode_step_s(1, 0)
    # ... until the batch's compute overtakes the weight reads (near 200 sequences)
    assert PERF.decode_step_s(1024, 0) > 2 * PERF.decode_step_s(1, 0)


def test_full_kv_pool_decode_step_is_tens_of_ms():
    step = PERF.decode_step_s(256, L1_TOKENS)
    assert 0.015 < step < 0.040
