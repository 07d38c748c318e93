"""Roofline latency model of one replica: TPOT, TTFT and output throughput at a given concurrency.

Roofline latency model (documented assumptions, not measurements; the tuning ladder measures the real curve):

* decode step = max(bytes read / (HBM bandwidth x 0.75), FLOPs / (dense TFLOPs x 0.5)) + all-reduce time
  + 1 ms step overhead + drafting time. Bytes read = weights per GPU (MoE: only the experts a batch touches)
  + the batch's KV cache. FLOPs = 2 x active params per GPU x tokens in the step.
* TP all-reduce: two per decoder layer, each latency + 2 (tp-1)/tp x message / (link bandwidth x 0.7).
* prefill of P new tokens = 2 x active params x P + causal attention FLOPs, at 50 % of dense TFLOPs, split
  into chunks of max_num_batched_tokens minus the running decodes; cached prefix tokens are skipped.
* TPOT p50 = (decode step + the prefill work of the requests that replace finishing ones) / tokens accepted
  per step; TTFT p95 = one step of waiting + the prompt's chunks, stretched by prefill queueing
  (1 + 1.5 rho / (1 - rho), rho = prefill tokens arriving per step / chunk budget).
* speculative decoding verifies 1 + k tokens per sequence per step and accepts (1 - a^(k+1)) / (1 - a) of
  them (a = acceptance rate): lower TPOT at light load, longer steps and so higher TTFT under load (the
  seed articles' warning about ngram). A drafter runs k passes
  per step, or one where all drafts come from one pass (``vocabulary.drafts_in_one_pass``: dflash, dspark,
  and parallel_drafting).

The request timed is the config's workload (``workload.prompt_tokens`` and ``output_tokens``).

Pure: imports neither ray, vllm nor torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from serve_app.config.vocabulary import DRAFT_MODEL_FORWARD_METHODS, drafts_in_one_pass
from serve_app.planning.catalogue import GpuSpec
from serve_app.planning.memory import MemoryEstimate
from serve_app.planning.model_bytes import active_parameter_count, cdiv, dtype_bytes
from serve_app.planning.request import PlanRequest
from serve_app.planning.shape import ModelShape

__all__ = ["LatencyEstimate", "estimate_latency", "meets_slo"]

# --- roofline constants: assumptions stated once (typical of vLLM on data-centre GPUs, not fitted here) ---
# Fraction of datasheet HBM bandwidth that decode GEMV and paged attention reach (70-85 % is usual).
HBM_EFFICIENCY = 0.75
# Fraction of dense tensor-core FLOPs that prefill and large-batch GEMMs reach.
MFU = 0.5
# Per-step scheduling, input preparation and sampling with CUDA graphs (vLLM V1), milliseconds.
STEP_OVERHEAD_MS = 1.0
# Without CUDA graphs each step also pays kernel launches: about this much more.
EAGER_STEP_OVERHEAD_MS = 4.0
# Fraction of link bandwidth an all-reduce achieves.
INTERCONNECT_EFFICIENCY = 0.7
# p95 of prefill queueing relative to its mean (M/D/1-like tail), see module docstring.
PREFILL_QUEUE_P95_FACTOR = 1.5
# Host-side n-gram lookup per step, milliseconds.
NGRAM_DRAFT_MS = 0.3
# Per drafter forward overhead (launch, sampling of the draft), milliseconds.
DRAFT_PASS_OVERHEAD_MS = 0.3


@dataclass(frozen=True)
class LatencyEstimate:
    """Roofline estimate at one concurrency (steady state, continuous batching), per replica."""

    concurrency: int
    decode_step_ms: float
    tpot_p50_ms: float
    ttft_p95_ms: float
    output_tokens_per_s: float
    tokens_per_step: float


def _dense_tflops(gpu: GpuSpec, memory: MemoryEstimate) -> float:
    # fp8 weights run on fp8 tensor cores where the GPU has them (W8A8); int4 schemes compute in 16 bit.
    if memory.quantization.method == "fp8" and gpu.fp8_dense_tflops:
        return gpu.fp8_dense_tflops
    return gpu.bf16_dense_tflops


def _allreduce_ms(gpu: GpuSpec, tp: int, layers: int, tokens: int, hidden: int, act_bytes: float) -> float:
    """Two all-reduces per decoder layer (attention and MLP outputs) of tokens x hidden activations."""
    if tp <= 1:
        return 0.0
    message = tokens * hidden * act_bytes
    per_call_s = gpu.allreduce_latency_us * 1e-6 + 2 * (tp - 1) / tp * message / (
        gpu.interconnect_gb_per_s * 1e9 * INTERCONNECT_EFFICIENCY
    )
    return 2 * layers * per_call_s * 1e3


def _weights_read_bytes(shape: ModelShape, memory: MemoryEstimate, tokens_in_step: int) -> float:
    """Weight bytes a step streams from HBM: everything for dense models; for MoE only the experts that the
    step's tokens route to (each token picks top_k of E, so a batch touches 1 - (1 - k/E)^tokens of them)."""
    weights = float(memory.weights_bytes)
    if not shape.is_moe:
        return weights
    k, experts = shape.num_experts_per_tok, shape.num_experts
    touched = 1.0 - (1.0 - k / experts) ** max(1, tokens_in_step)
    expert_params = shape.num_moe_layers * experts * 3 * shape.hidden_size * shape.moe_intermediate_size
    expert_bytes = expert_params / memory.tensor_parallel_size * memory.quantization.bytes_per_weight
    return weights - expert_bytes * (1.0 - touched)


def _forward_ms(
    shape: ModelShape,
    memory: MemoryEstimate,
    gpu: GpuSpec,
    tokens: int,
    kv_tokens_read: float,
    new_prefill_tokens: int = 0,
    prefill_context: int = 0,
) -> float:
    """One forward pass over ``tokens`` tokens that reads ``kv_tokens_read`` cached tokens: roofline max of
    memory and compute time plus TP communication."""
    tp = memory.tensor_parallel_size
    bandwidth = gpu.hbm_bandwidth_gb_per_s * 1e9 * HBM_EFFICIENCY
    flops_rate = _dense_tflops(gpu, memory) * 1e12 * MFU
    read = _weights_read_bytes(shape, memory, tokens) + kv_tokens_read * memory.target_kv_bytes_per_token
    active = active_parameter_count(shape) / tp
    flops = 2.0 * active * tokens
    if new_prefill_tokens:
        # Causal attention over the prompt: QK^T and PV, 2 x 2 x heads x head_dim FLOPs per (query, key) pair.
        heads = shape.num_attention_heads / tp
        pairs = new_prefill_tokens * (prefill_context + new_prefill_tokens / 2)
        flops += 4.0 * shape.num_hidden_layers * heads * shape.head_dim * pairs
    compute_s, memory_s = flops / flops_rate, read / bandwidth
    act = dtype_bytes(memory.model_dtype)
    comm_ms = _allreduce_ms(gpu, tp, shape.num_hidden_layers, tokens, shape.hidden_size, act)
    return max(compute_s, memory_s) * 1e3 + comm_ms


def _draft_ms(req: PlanRequest, memory: MemoryEstimate, gpu: GpuSpec, batch: int) -> float:
    """Time per step spent proposing draft tokens."""
    spec = req.speculative
    if spec is None:
        return 0.0
    if spec.method == "ngram":
        return NGRAM_DRAFT_MS
    bandwidth = gpu.hbm_bandwidth_gb_per_s * 1e9 * HBM_EFFICIENCY
    one_pass = drafts_in_one_pass(spec.method, spec.parallel_drafting)
    passes = 1 if one_pass else spec.num_speculative_tokens
    per_pass_ms = memory.draft_weights_bytes / bandwidth * 1e3 + DRAFT_PASS_OVERHEAD_MS
    if spec.draft is not None and spec.method in DRAFT_MODEL_FORWARD_METHODS:
        flops = 2.0 * active_parameter_count(spec.draft) / memory.tensor_parallel_size * batch
        per_pass_ms = max(per_pass_ms, flops / (_dense_tflops(gpu, memory) * 1e12 * MFU) * 1e3)
        act = dtype_bytes(memory.model_dtype)
        tp = memory.tensor_parallel_size
        per_pass_ms += _allreduce_ms(
            gpu, tp, spec.draft.num_hidden_layers, batch, spec.draft.hidden_size, act
        )
    return passes * per_pass_ms


def estimate_latency(
    req: PlanRequest, memory: MemoryEstimate, gpu: GpuSpec, concurrency: int
) -> LatencyEstimate:
    """TPOT p50, TTFT p95 and output throughput of one replica running ``concurrency`` sequences."""
    shape = req.model
    batch = max(1, concurrency)
    spec = req.speculative
    k = spec.num_speculative_tokens if spec else 0
    accept = spec.acceptance_rate if spec else 0.0
    tokens_per_step = (1 - accept ** (k + 1)) / (1 - accept) if k else 1.0
    prompt, output = req.prompt_tokens, req.output_tokens
    overhead = STEP_OVERHEAD_MS + (EAGER_STEP_OVERHEAD_MS if req.enforce_eager else 0.0)
    drafting = _draft_ms(req, memory, gpu, batch)

    # Decode: each sequence verifies 1 + k tokens and reads its whole context (cached prefix included).
    decode_tokens = batch * (1 + k)
    mean_context = prompt + output / 2
    decode_step = _forward_ms(shape, memory, gpu, decode_tokens, batch * mean_context) + overhead + drafting

    # Prefill: only the uncached part of the prompt is computed (at least the last token: vLLM recomputes it).
    new_tokens = max(1, int(prompt * (1 - req.prefix_reuse_fraction)))
    cached = prompt - new_tokens
    chunk_budget = max(16, memory.max_num_batched_tokens - decode_tokens)
    chunks = cdiv(new_tokens, chunk_budget)
    chunk_tokens = min(new_tokens, chunk_budget)
    mixed_step = (
        _forward_ms(
            shape,
            memory,
            gpu,
            decode_tokens + chunk_tokens,
            batch * mean_context + cached + chunk_tokens,
            new_prefill_tokens=chunk_tokens,
            prefill_context=cached,
        )
        + overhead
        + drafting
    )
    prefill_extra_ms = chunks * max(0.0, mixed_step - decode_step)

    # Steady state: a request lives output / tokens_per_step steps, so batch x tokens_per_step / output new
    # requests arrive per step, each bringing its prefill work.
    arrivals_per_step = batch * tokens_per_step / output
    step_ms = decode_step + arrivals_per_step * prefill_extra_ms
    tpot = step_ms / tokens_per_step
    rho = arrivals_per_step * new_tokens / chunk_budget
    if rho >= 0.95:
        ttft = math.inf  # prefill cannot keep up with the arrivals this concurrency implies
    else:
        queueing = 1 + PREFILL_QUEUE_P95_FACTOR * rho / (1 - rho)
        ttft = step_ms + chunks * mixed_step * queueing
    return LatencyEstimate(
        concurrency=batch,
        decode_step_ms=decode_step,
        tpot_p50_ms=tpot,
        ttft_p95_ms=ttft,
        output_tokens_per_s=batch / tpot * 1e3,
        tokens_per_step=tokens_per_step,
    )


def meets_slo(req: PlanRequest, est: LatencyEstimate) -> bool:
    ttft_ok = req.ttft_p95_ms is None or est.ttft_p95_ms <= req.ttft_p95_ms
    tpot_ok = req.tpot_p50_ms is None or est.tpot_p50_ms <= req.tpot_p50_ms
    return ttft_ok and tpot_ok
