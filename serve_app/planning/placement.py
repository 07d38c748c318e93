"""Placement planner: from a model, a cluster and SLOs to tensor-parallel size, replicas, bundles and limits.

``plan(PlanRequest) -> Plan`` is a pure function. It

1. enumerates the tensor-parallel sizes vLLM accepts within one node (1, 2, 4, 8 dividing the attention heads,
   KV heads and MLP widths; a user-given size is the only candidate);
2. sizes each one with the memory model (:mod:`serve_app.planning.memory`): weights, activation peak,
   runtime buffers, draft model, and the KV blocks left;
3. estimates TPOT and TTFT with a roofline latency model (below) and finds, per size, the highest concurrency
   per replica that meets the SLO within what the KV cache holds;
4. picks the size with the most output tokens per second per GPU among those that meet the SLO: a model that
   fits one GPU may still get a TP group if single-GPU replicas cannot meet a tight TPOT; a model that does
   not fit one GPU must use TP;
5. or refuses with vLLM's error template: need versus supply with units, the largest value that would fit, and
   which setting to change, each alternative computed.

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
  them (a = acceptance rate): lower TPOT at light load, longer steps and so higher TTFT under load - the lab
  measured ngram raising TTFT p50 at concurrency 64 from 209 to 625 ms on an H200.

Pure: imports neither ray, vllm nor torch.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, InstanceOf, field_validator, model_validator

from serve_app.planning import catalogue
from serve_app.planning.catalogue import GpuSpec
from serve_app.planning.memory import (
    CUDA_CONTEXT_BYTES,
    GIB_BYTES,
    MemoryEstimate,
    MemoryInputs,
    SpeculativeSpec,
    active_parameter_count,
    bytes_to_gib,
    cdiv,
    dtype_bytes,
    estimate_memory,
    padded_vocab_size,
)
from serve_app.planning.shape import ModelShape

__all__ = [
    "ClusterSpec",
    "LatencyEstimate",
    "Plan",
    "PlanRequest",
    "estimate_latency",
    "plan",
    "render_plan_table",
    "valid_tensor_parallel_sizes",
]

TP_CANDIDATES = (1, 2, 4, 8)

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
# Larger TP must beat smaller TP by more than 5 % output tokens/s/GPU to be chosen.
TP_TIE_MARGIN = 0.95
# Request shape assumed when the user gives none: a chat turn.
DEFAULT_PROMPT_TOKENS = 1024
DEFAULT_OUTPUT_TOKENS = 256
# Acceptance rate assumed per drafted token when the user gives none: n-gram drafts hit less often.
DEFAULT_ACCEPTANCE_RATE = {"ngram": 0.4}
DEFAULT_MODEL_ACCEPTANCE_RATE = 0.6

SpeculativeMethod = Literal["ngram", "draft_model", "eagle", "eagle3", "mtp", "dflash", "dspark"]
_NEEDS_DRAFT = ("draft_model", "dflash", "dspark")
_PARALLEL_DRAFT = ("dflash", "dspark")
Quantization = Literal[
    "fp8", "awq", "gptq", "awq_marlin", "gptq_marlin", "compressed-tensors", "bitsandbytes"
]

_FROZEN = ConfigDict(frozen=True, extra="forbid", arbitrary_types_allowed=True)


# ============================================================================================== inputs
class ClusterSpec(BaseModel):
    """The hardware replicas are placed on: identical nodes of identical GPUs."""

    model_config = _FROZEN

    nodes: int = Field(default=1, ge=1, le=4096, description="Nodes in the cluster (or node pool).")
    gpus_per_node: int = Field(
        default=1, ge=0, le=16, description="GPUs per node; a tensor-parallel group never spans nodes."
    )
    gpu: InstanceOf[GpuSpec] | None = Field(
        default=None,
        description=(
            "GPU model (a catalogue name such as 'H200' is accepted); required on the GPU accelerator."
        ),
    )

    @field_validator("gpu", mode="before")
    @classmethod
    def _gpu_from_name(cls, value: object) -> object:
        return catalogue.gpu(value) if isinstance(value, str) else value

    @classmethod
    def of(
        cls, gpu: str | GpuSpec, nodes: int = 1, gpus_per_node: int = 1, gpu_memory_gib: float | None = None
    ) -> ClusterSpec:
        """Build from a catalogue GPU name; ``gpu_memory_gib`` overrides its memory (as torch reports it)."""
        spec = catalogue.gpu(gpu) if isinstance(gpu, str) else gpu
        if gpu_memory_gib is not None:
            spec = dataclasses.replace(spec, memory_bytes=int(gpu_memory_gib * GIB_BYTES))
        return cls(nodes=nodes, gpus_per_node=gpus_per_node, gpu=spec)

    @property
    def total_gpus(self) -> int:
        return self.nodes * self.gpus_per_node


class PlanRequest(BaseModel):
    """What to plan: the model, its engine settings, the traffic and SLOs, and the cluster."""

    model_config = _FROZEN

    model: InstanceOf[ModelShape] = Field(
        ..., description="Shape of the target model (from its config.json)."
    )
    draft_model: InstanceOf[ModelShape] | None = Field(
        default=None, description="Shape of the draft checkpoint (draft_model, dflash, dspark; EAGLE head)."
    )
    speculative_method: SpeculativeMethod | None = Field(
        default=None, description="Speculative decoding method; null turns it off."
    )
    num_speculative_tokens: int = Field(default=0, ge=0, le=16, description="Draft tokens proposed per step.")
    speculative_acceptance_rate: float | None = Field(
        default=None,
        gt=0,
        lt=1,
        description=(
            "Assumed probability each draft token is accepted (latency estimate); null: 0.4 ngram, 0.6 else."
        ),
    )
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        default="auto", description="Weight dtype."
    )
    quantization: Quantization | None = Field(
        default=None, description="Weight quantization; null uses the checkpoint's own quantization_config."
    )
    kv_cache_dtype: Literal["auto", "fp8", "fp8_e4m3", "fp8_e5m2"] = Field(
        default="auto", description="KV cache storage dtype; fp8 halves bytes per token."
    )
    max_model_len: int | None = Field(
        default=None,
        ge=16,
        description="Longest request in tokens; null: the model's max_position_embeddings.",
    )
    max_num_seqs: int = Field(default=256, ge=1, le=8192, description="Most sequences batched per step.")
    max_num_batched_tokens: int | None = Field(
        default=None, ge=16, description="Step token budget; null: vLLM's default for the GPU."
    )
    enable_chunked_prefill: bool = Field(default=True, description="Split prompts into step-sized chunks.")
    gpu_memory_utilization: float = Field(
        default=0.9, ge=0.05, le=0.99, description="vLLM's memory budget share."
    )
    enforce_eager: bool = Field(default=False, description="No CUDA graphs: no graph memory, slower steps.")
    prefix_reuse_fraction: float = Field(
        default=0.0,
        ge=0.0,
        le=0.99,
        description=(
            "Share of each request that is a prefix common to all requests (stored once in the KV cache)."
        ),
    )
    typical_prompt_tokens: int | None = Field(
        default=None,
        ge=1,
        description=f"Typical prompt length; null: {DEFAULT_PROMPT_TOKENS} (latency model).",
    )
    typical_output_tokens: int | None = Field(
        default=None,
        ge=1,
        description=f"Typical output length; null: {DEFAULT_OUTPUT_TOKENS} (latency model).",
    )
    ttft_p95_ms: float | None = Field(default=None, gt=0, description="TTFT SLO at p95; null: no TTFT bound.")
    tpot_p50_ms: float | None = Field(default=None, gt=0, description="TPOT SLO at p50; null: no TPOT bound.")
    tensor_parallel_size: Literal[1, 2, 4, 8] | None = Field(
        default=None, description="Force a tensor-parallel size; null lets the planner choose."
    )
    cluster: ClusterSpec = Field(default_factory=ClusterSpec, description="Nodes and GPUs available.")
    accelerator: Literal["gpu", "cpu"] = Field(default="gpu", description="vLLM's CUDA or CPU backend.")
    cpu_kv_cache_space_gib: float | None = Field(
        default=None, gt=0, description="CPU backend: KV cache size in GiB (VLLM_CPU_KVCACHE_SPACE)."
    )
    num_cpus_per_replica: float = Field(default=1, ge=0, description="CPUs in each replica's first bundle.")
    require_max_num_seqs: bool = Field(
        default=False,
        description=(
            "Refuse instead of lowering max_num_seqs when the KV cache cannot hold that many requests."
        ),
    )
    subtract_cudagraph_estimate: bool = Field(
        default=False,
        description="Subtract CUDA graph memory from the KV budget (newer vLLM); false matches vLLM 0.26.",
    )

    @model_validator(mode="after")
    def _check(self) -> PlanRequest:
        method = self.speculative_method
        if method is not None and self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1 with speculative_method {method!r}")
        if method in _NEEDS_DRAFT and self.draft_model is None:
            raise ValueError(
                f"speculative_method {method!r} needs draft_model (the draft checkpoint's shape)"
            )
        if self.accelerator == "gpu" and self.cluster.gpu is None:
            raise ValueError("cluster.gpu is required on the GPU accelerator (e.g. ClusterSpec.of('H200'))")
        if self.accelerator == "gpu" and self.cluster.gpus_per_node < 1:
            raise ValueError("cluster.gpus_per_node must be >= 1 on the GPU accelerator")
        budget = self.max_num_batched_tokens
        if budget is not None and budget < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({budget}) must be >= max_num_seqs ({self.max_num_seqs})"
            )
        return self

    # --- derived ---
    @property
    def resolved_max_model_len(self) -> int:
        return self.max_model_len or self.model.max_position_embeddings

    @property
    def speculative(self) -> SpeculativeSpec | None:
        if self.speculative_method is None:
            return None
        rate = self.speculative_acceptance_rate or DEFAULT_ACCEPTANCE_RATE.get(
            self.speculative_method, DEFAULT_MODEL_ACCEPTANCE_RATE
        )
        return SpeculativeSpec(self.speculative_method, self.num_speculative_tokens, self.draft_model, rate)

    @property
    def prompt_tokens(self) -> int:
        return min(self.typical_prompt_tokens or DEFAULT_PROMPT_TOKENS, self.resolved_max_model_len - 1)

    @property
    def output_tokens(self) -> int:
        room = max(1, self.resolved_max_model_len - self.prompt_tokens)
        return min(self.typical_output_tokens or DEFAULT_OUTPUT_TOKENS, room)

    @property
    def typical_request_tokens(self) -> int | None:
        if self.typical_prompt_tokens is None and self.typical_output_tokens is None:
            return None
        return self.prompt_tokens + self.output_tokens

    def memory_inputs(self, tensor_parallel_size: int, **overrides: Any) -> MemoryInputs:
        gpu = self.cluster.gpu
        fields: dict[str, Any] = dict(
            model=self.model,
            gpu_memory_bytes=gpu.memory_bytes if gpu else 0,
            gpu_name=gpu.name if gpu else "",
            gpu_memory_utilization=self.gpu_memory_utilization,
            tensor_parallel_size=tensor_parallel_size,
            dtype=self.dtype,
            quantization=self.quantization,
            kv_cache_dtype=self.kv_cache_dtype,
            max_model_len=self.resolved_max_model_len,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            enable_chunked_prefill=self.enable_chunked_prefill,
            speculative=self.speculative,
            accelerator=self.accelerator,
            cpu_kv_cache_space_gib=self.cpu_kv_cache_space_gib,
            enforce_eager=self.enforce_eager or self.accelerator == "cpu",
            subtract_cudagraph_estimate=self.subtract_cudagraph_estimate,
        )
        fields.update(overrides)
        return MemoryInputs(**fields)


# ============================================================================================= outputs
@dataclass(frozen=True)
class Plan:
    """The planner's answer: where and how to run the replicas, or why not. ``reasons`` always says why."""

    fits: bool
    tensor_parallel_size: int
    replicas: int
    bundles: tuple[dict[str, float], ...]
    placement_strategy: str
    max_num_seqs: int
    gpu_memory_utilization: float
    kv_cache_tokens_per_replica: int
    # vLLM's "Maximum concurrency for max_model_len tokens per request".
    max_concurrency_per_replica: float
    weights_gib_per_gpu: float
    kv_bytes_per_token: int
    reasons: tuple[str, ...]
    warnings: tuple[str, ...] = ()
    accelerator: str = "gpu"
    gpu_type: str | None = None
    max_model_len: int = 0
    max_num_batched_tokens: int = 0
    # At the typical request length (prompt + output) with prefix reuse; None without a typical length.
    max_concurrency_at_typical_length: float | None = None
    # Concurrency per replica at which the latency estimates hold (the SLO limit, or max_num_seqs).
    planned_concurrency_per_replica: int = 0
    estimated_tpot_p50_ms: float | None = None
    estimated_ttft_p95_ms: float | None = None
    estimated_output_tokens_per_s_per_gpu: float | None = None
    memory: MemoryEstimate | None = field(default=None, compare=False)
    alternatives: tuple[dict[str, Any], ...] = ()

    @property
    def gpus_per_replica(self) -> int:
        return self.tensor_parallel_size if self.accelerator == "gpu" else 0

    def to_json(self) -> dict[str, Any]:
        """Plain-JSON dict (for ``headroom plan --json`` and the app builder)."""
        mem = self.memory
        return {
            "fits": self.fits,
            "accelerator": self.accelerator,
            "gpu_type": self.gpu_type,
            "tensor_parallel_size": self.tensor_parallel_size,
            "replicas": self.replicas,
            "bundles": [dict(b) for b in self.bundles],
            "placement_strategy": self.placement_strategy,
            "max_num_seqs": self.max_num_seqs,
            "max_model_len": self.max_model_len,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "gpu_memory_utilization": self.gpu_memory_utilization,
            "kv_cache_tokens_per_replica": self.kv_cache_tokens_per_replica,
            "max_concurrency_per_replica": round(self.max_concurrency_per_replica, 2),
            "max_concurrency_at_typical_length": (
                None
                if self.max_concurrency_at_typical_length is None
                else round(self.max_concurrency_at_typical_length, 2)
            ),
            "planned_concurrency_per_replica": self.planned_concurrency_per_replica,
            "weights_gib_per_gpu": round(self.weights_gib_per_gpu, 3),
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "estimated_tpot_p50_ms": _round_opt(self.estimated_tpot_p50_ms),
            "estimated_ttft_p95_ms": _round_opt(self.estimated_ttft_p95_ms),
            "estimated_output_tokens_per_s_per_gpu": _round_opt(self.estimated_output_tokens_per_s_per_gpu),
            "reasons": list(self.reasons),
            "warnings": list(self.warnings),
            "memory": mem.to_dict() if mem else None,
            "alternatives": [dict(a) for a in self.alternatives],
        }


def _round_opt(value: float | None, digits: int = 1) -> float | None:
    return None if value is None or math.isinf(value) else round(value, digits)


# ======================================================================================= latency model
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
    passes = 1 if spec.method in _PARALLEL_DRAFT else spec.num_speculative_tokens
    per_pass_ms = memory.draft_weights_bytes / bandwidth * 1e3 + DRAFT_PASS_OVERHEAD_MS
    if spec.draft is not None and spec.method in _NEEDS_DRAFT:
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


def _meets(req: PlanRequest, est: LatencyEstimate) -> bool:
    ttft_ok = req.ttft_p95_ms is None or est.ttft_p95_ms <= req.ttft_p95_ms
    tpot_ok = req.tpot_p50_ms is None or est.tpot_p50_ms <= req.tpot_p50_ms
    return ttft_ok and tpot_ok


# ======================================================================================= TP candidates
def valid_tensor_parallel_sizes(shape: ModelShape, gpus_per_node: int) -> dict[int, str | None]:
    """Each of 1, 2, 4, 8 mapped to None when vLLM can shard ``shape`` that way within one node, else why not.

    vLLM divides attention heads, KV heads (or replicates them when tp exceeds their count), MLP and expert
    widths evenly across ranks; the vocabulary is padded to a multiple of 64 so it always divides.
    """
    verdicts: dict[int, str | None] = {}
    for tp in TP_CANDIDATES:
        why: str | None = None
        if tp > gpus_per_node:
            why = f"needs {tp} GPUs in one node; nodes have {gpus_per_node}"
        elif shape.num_attention_heads % tp:
            why = f"num_attention_heads ({shape.num_attention_heads}) is not divisible by {tp}"
        elif not shape.is_mla and tp < shape.num_key_value_heads and shape.num_key_value_heads % tp:
            why = f"num_key_value_heads ({shape.num_key_value_heads}) is not divisible by {tp}"
        elif shape.num_dense_layers and shape.intermediate_size % tp:
            why = f"intermediate_size ({shape.intermediate_size}) is not divisible by {tp}"
        elif shape.is_moe and shape.moe_intermediate_size % tp:
            why = f"moe_intermediate_size ({shape.moe_intermediate_size}) is not divisible by {tp}"
        elif padded_vocab_size(shape.vocab_size) % tp:
            why = f"padded vocab ({padded_vocab_size(shape.vocab_size)}) is not divisible by {tp}"
        verdicts[tp] = why
    return verdicts


@dataclass(frozen=True)
class _Option:
    """One tensor-parallel size, sized and timed."""

    tp: int
    memory: MemoryEstimate
    replicas: int
    # Concurrency the KV cache holds at the sizing length (typical request if given, else max_model_len).
    kv_concurrency: float
    # max_num_seqs capped by the KV cache.
    cap: int
    # Highest concurrency meeting the SLO (0: none), and the estimate there (at 1 when none meets).
    slo_concurrency: int
    estimate: LatencyEstimate | None

    @property
    def fits(self) -> bool:
        return self.memory.kv_cache_available_bytes > 0 and self.memory.fits_one_request

    @property
    def meets_slo(self) -> bool:
        return self.slo_concurrency > 0

    @property
    def tokens_per_s_per_gpu(self) -> float:
        if self.estimate is None or not self.meets_slo:
            return 0.0
        return self.estimate.output_tokens_per_s / self.tp

    def summary(self) -> dict[str, Any]:
        est = self.estimate
        return {
            "tensor_parallel_size": self.tp,
            "fits": self.fits,
            "replicas": self.replicas if self.fits else 0,
            "weights_gib_per_gpu": round(bytes_to_gib(self.memory.weights_bytes), 2),
            "kv_cache_tokens_per_replica": self.memory.kv_cache_tokens,
            "kv_concurrency": round(self.kv_concurrency, 2),
            "slo_concurrency_per_replica": self.slo_concurrency,
            "estimated_tpot_p50_ms": _round_opt(est.tpot_p50_ms) if est else None,
            "estimated_ttft_p95_ms": _round_opt(est.ttft_p95_ms) if est else None,
            "estimated_output_tokens_per_s_per_gpu": round(self.tokens_per_s_per_gpu, 1),
        }


def _sizing_length(req: PlanRequest) -> int:
    return req.typical_request_tokens or req.resolved_max_model_len


def _evaluate(req: PlanRequest, tp: int, gpu: GpuSpec) -> _Option:
    memory = estimate_memory(req.memory_inputs(tp))
    replicas = req.cluster.nodes * (req.cluster.gpus_per_node // tp)
    kv_conc = memory.concurrency_for(_sizing_length(req), req.prefix_reuse_fraction)
    cap = max(0, min(req.max_num_seqs, int(kv_conc) if math.isfinite(kv_conc) else req.max_num_seqs))
    if not (memory.kv_cache_available_bytes > 0 and memory.fits_one_request) or cap < 1:
        return _Option(tp, memory, replicas, kv_conc, cap, 0, None)
    # Latency grows with concurrency, so binary-search the largest concurrency that meets the SLO.
    lo, hi, best = 1, cap, 0
    while lo <= hi:
        mid = (lo + hi) // 2
        if _meets(req, estimate_latency(req, memory, gpu, mid)):
            best, lo = mid, mid + 1
        else:
            hi = mid - 1
    estimate = estimate_latency(req, memory, gpu, best or 1)
    return _Option(tp, memory, replicas, kv_conc, cap, best, estimate)


# ============================================================================================ planning
def _gib(n_bytes: float) -> str:
    return f"{bytes_to_gib(n_bytes):,.2f} GiB"


def _slo_text(req: PlanRequest) -> str:
    parts = []
    if req.ttft_p95_ms is not None:
        parts.append(f"TTFT p95 <= {req.ttft_p95_ms:g} ms")
    if req.tpot_p50_ms is not None:
        parts.append(f"TPOT p50 <= {req.tpot_p50_ms:g} ms")
    return " and ".join(parts) if parts else "no latency SLO"


def _has_slo(req: PlanRequest) -> bool:
    return req.ttft_p95_ms is not None or req.tpot_p50_ms is not None


def _plural(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _bundles(tp: int, cpus: float) -> tuple[dict[str, float], ...]:
    # One bundle per TP rank; the first also hosts the replica actor, so it carries the replica's CPUs.
    first_cpus = cpus if cpus >= 1 else 1
    return tuple({"GPU": 1, "CPU": first_cpus if rank == 0 else 1} for rank in range(tp))


def _fits_one_gpu_text(opt: _Option) -> str:
    mem = opt.memory
    return (
        f"{_gib(mem.weights_bytes + mem.draft_weights_bytes)} of weights fit one GPU's budget of "
        f"{_gib(mem.requested_bytes)} ({mem.gpu_memory_utilization:g} x {_gib(mem.gpu_memory_bytes)}), "
        f"leaving {mem.kv_cache_tokens:,} KV tokens"
    )


def _does_not_fit_text(opt: _Option) -> str:
    mem = opt.memory
    overhead = mem.activation_peak_bytes + mem.non_torch_bytes
    if mem.kv_cache_available_bytes <= 0:
        return (
            f"weights {_gib(mem.weights_bytes + mem.draft_weights_bytes)} + activations/runtime "
            f"{_gib(overhead)} exceed the budget {_gib(mem.requested_bytes)} at TP={opt.tp}"
        )
    return (
        f"at TP={opt.tp} only {mem.kv_cache_tokens:,} KV tokens remain, fewer than one "
        f"{mem.max_model_len:,}-token request needs"
    )


def plan(req: PlanRequest) -> Plan:
    """Plan replicas for ``req``: the chosen tensor-parallel size and limits with reasons, or a refusal."""
    if req.accelerator == "cpu":
        return _plan_cpu(req)
    gpu = req.cluster.gpu
    assert gpu is not None  # checked by PlanRequest
    verdicts = valid_tensor_parallel_sizes(req.model, req.cluster.gpus_per_node)
    if req.tensor_parallel_size is not None:
        tp = req.tensor_parallel_size
        if verdicts[tp] is not None:
            return _refuse_invalid_tp(req, tp, str(verdicts[tp]))
        sizes: list[int] = [tp]
    else:
        sizes = [size for size, why in verdicts.items() if why is None]
    if not sizes:
        return _refuse_invalid_tp(req, 1, "; ".join(f"TP={t}: {w}" for t, w in verdicts.items() if w))
    options = [_evaluate(req, tp, gpu) for tp in sizes]
    fitting = [o for o in options if o.fits]
    if not fitting:
        return _refuse(req, options[-1], options)
    return _accept(req, fitting, options)


def _choose(
    req: PlanRequest, fitting: list[_Option], options: list[_Option]
) -> tuple[_Option, list[str], list[str]]:
    reasons: list[str] = []
    warnings: list[str] = []
    one_gpu = next((o for o in options if o.tp == 1), None)
    meeting = [o for o in fitting if o.meets_slo]
    if req.tensor_parallel_size is not None:
        chosen = fitting[0]
        reasons.append(f"TP={chosen.tp} as requested (tensor_parallel_size)")
    elif meeting:
        # Within 5 % of the best, the smaller TP wins: fewer GPUs per failure, no NCCL, simpler placement.
        best = max(o.tokens_per_s_per_gpu for o in meeting)
        chosen = min(
            (o for o in meeting if o.tokens_per_s_per_gpu >= TP_TIE_MARGIN * best), key=lambda o: o.tp
        )
        others = ", ".join(
            f"TP={o.tp}: {o.tokens_per_s_per_gpu:,.0f}" for o in options if o is not chosen and o.meets_slo
        )
        layout = (
            f"{_plural(chosen.replicas, 'independent single-GPU replica')}"
            if chosen.tp == 1
            else f"{_plural(chosen.replicas, f'TP={chosen.tp} bundle')} of {chosen.tp} GPUs"
        )
        within = f"within {_slo_text(req)}" if _has_slo(req) else "(no latency SLO given)"
        reasons.append(
            f"TP={chosen.tp} gives the most output throughput per GPU {within}: {layout}, est. "
            f"{chosen.tokens_per_s_per_gpu:,.0f} tok/s/GPU at {chosen.slo_concurrency} concurrent "
            "sequences per replica" + (f" (vs {others} tok/s/GPU)" if others else "")
        )
    else:
        assert all(o.estimate is not None for o in fitting)
        chosen = min(fitting, key=lambda o: (o.estimate.tpot_p50_ms if o.estimate else math.inf, o.tp))
        est = chosen.estimate
        assert est is not None
        reasons.append(
            f"no tensor-parallel size meets {_slo_text(req)} at any concurrency; TP={chosen.tp} comes "
            f"closest (est. TPOT p50 {est.tpot_p50_ms:.1f} ms, TTFT p95 {est.ttft_p95_ms:.0f} ms at "
            "concurrency 1)"
        )
        warnings.append(
            f"SLO not met: {_slo_text(req)} is out of reach on "
            f"{req.cluster.gpu.name if req.cluster.gpu else 'GPU'} by the roofline estimate; relax the SLO, "
            "quantize (fp8), shorten prompts or use a faster GPU"
        )
    if one_gpu is not None and one_gpu.fits:
        reasons.append(f"the model fits one GPU: {_fits_one_gpu_text(one_gpu)}")
        if chosen.tp > 1 and meeting and not one_gpu.meets_slo:
            single = one_gpu.estimate
            detail = f" (best at concurrency 1: TPOT {single.tpot_p50_ms:.1f} ms)" if single else ""
            reasons.append(f"single-GPU replicas cannot meet {_slo_text(req)}{detail}, so TP={chosen.tp}")
    elif one_gpu is not None:
        reasons.append(
            f"the model does not fit one GPU: {_does_not_fit_text(one_gpu)}; TP={chosen.tp} is needed"
        )
    elif chosen.tp > 1 and req.tensor_parallel_size is None:
        reasons.append("the model does not fit one GPU: TP=1 is not a valid shard for it")
    if req.model.is_moe:
        reasons.append(
            f"MoE: weights sized by all {req.model.num_experts} experts "
            f"({_gib(chosen.memory.weights_bytes)}/GPU), compute by the {req.model.num_experts_per_tok} "
            "active ones"
        )
    return chosen, reasons, warnings


def _accept(req: PlanRequest, fitting: list[_Option], options: list[_Option]) -> Plan:
    chosen, reasons, warnings = _choose(req, fitting, options)
    mem = chosen.memory
    length = _sizing_length(req)
    at = "typical request" if req.typical_request_tokens else "max_model_len"
    max_num_seqs = req.max_num_seqs
    if chosen.cap < req.max_num_seqs:
        if req.require_max_num_seqs:
            return _refuse(req, chosen, options, strict_seqs=True)
        max_num_seqs = max(1, chosen.cap)
        levers = ("fp8 KV cache (kv_cache_dtype), " if req.kv_cache_dtype == "auto" else "") + (
            "a shorter max_model_len, more prefix reuse or a larger TP"
        )
        warnings.append(
            f"max_num_seqs lowered from {req.max_num_seqs} to {max_num_seqs}: the KV cache holds "
            f"{mem.kv_cache_tokens:,} tokens per replica = {chosen.kv_concurrency:.1f} requests of "
            f"{length:,} tokens ({at}, prefix reuse {req.prefix_reuse_fraction:.0%}); more would be "
            f"preempted. Raise it with {levers}"
        )
    if req.speculative is not None:
        warnings.append(_speculation_warning(req, chosen))
    if mem.headroom_after_graphs_bytes < 0:
        free_share = (mem.gpu_memory_bytes - mem.cudagraph_bytes - CUDA_CONTEXT_BYTES) / mem.gpu_memory_bytes
        warnings.append(
            f"CUDA graphs ({_gib(mem.cudagraph_bytes)}) and the CUDA context need more than the "
            f"{_gib(mem.gpu_memory_bytes - mem.requested_bytes)} left outside gpu_memory_utilization "
            f"{mem.gpu_memory_utilization:g}; lower it to <= {math.floor(free_share * 100) / 100:.2f} or "
            "set enforce_eager"
        )
    est = chosen.estimate
    planned = chosen.slo_concurrency or 1
    typical = (
        mem.concurrency_for(req.typical_request_tokens, req.prefix_reuse_fraction)
        if req.typical_request_tokens
        else None
    )
    return Plan(
        fits=True,
        tensor_parallel_size=chosen.tp,
        replicas=chosen.replicas,
        bundles=_bundles(chosen.tp, req.num_cpus_per_replica),
        placement_strategy="STRICT_PACK" if chosen.tp > 1 else "PACK",
        max_num_seqs=max_num_seqs,
        gpu_memory_utilization=req.gpu_memory_utilization,
        kv_cache_tokens_per_replica=mem.kv_cache_tokens,
        max_concurrency_per_replica=mem.max_concurrency,
        weights_gib_per_gpu=bytes_to_gib(mem.weights_bytes + mem.draft_weights_bytes),
        kv_bytes_per_token=mem.kv_bytes_per_token,
        reasons=tuple(reasons),
        warnings=tuple(warnings + list(mem.notes)),
        accelerator="gpu",
        gpu_type=req.cluster.gpu.name if req.cluster.gpu else None,
        max_model_len=mem.max_model_len,
        max_num_batched_tokens=mem.max_num_batched_tokens,
        max_concurrency_at_typical_length=typical,
        planned_concurrency_per_replica=min(planned, max_num_seqs),
        estimated_tpot_p50_ms=est.tpot_p50_ms if est else None,
        estimated_ttft_p95_ms=est.ttft_p95_ms if est else None,
        estimated_output_tokens_per_s_per_gpu=(est.output_tokens_per_s / chosen.tp) if est else None,
        memory=mem,
        alternatives=tuple(o.summary() for o in options),
    )


def _speculation_warning(req: PlanRequest, chosen: _Option) -> str:
    spec = req.speculative
    assert spec is not None and req.cluster.gpu is not None
    gpu = req.cluster.gpu
    plain_req = req.model_copy(
        update={"speculative_method": None, "num_speculative_tokens": 0, "draft_model": None}
    )
    plain_mem = estimate_memory(plain_req.memory_inputs(chosen.tp))
    conc = max(1, min(chosen.cap, 64))
    with_spec = estimate_latency(req, chosen.memory, gpu, conc)
    without = estimate_latency(plain_req, plain_mem, gpu, conc)
    return (
        f"speculative decoding ({spec.method}, {spec.num_speculative_tokens} tokens, assumed acceptance "
        f"{spec.acceptance_rate:.0%}) trades TTFT for TPOT: at concurrency {conc} est. TPOT "
        f"{without.tpot_p50_ms:.1f} -> {with_spec.tpot_p50_ms:.1f} ms, TTFT p95 {without.ttft_p95_ms:.0f} "
        f"-> {with_spec.ttft_p95_ms:.0f} ms; draft weights {_gib(chosen.memory.draft_weights_bytes)}/GPU "
        f"and {chosen.memory.draft_kv_bytes_per_token:,} KV bytes/token. The lab measured ngram raising "
        "TTFT p50 at concurrency 64 from 209 to 625 ms (H200, Qwen3-8B): judge TTFT and TPOT, not "
        "throughput alone"
    )


# ============================================================================================= refusals
def _alternative(req: PlanRequest, tp: int, **overrides: Any) -> MemoryEstimate | None:
    try:
        return estimate_memory(req.memory_inputs(tp, **overrides))
    except ValueError:
        return None


@dataclass(frozen=True)
class _Need:
    """What a refused request needs: one max_model_len request, or (require_max_num_seqs) max_num_seqs of
    them.
    """

    req: PlanRequest
    seqs: int | None

    def verdict(self, mem: MemoryEstimate | None) -> tuple[bool, str]:
        if mem is None or mem.kv_cache_available_bytes <= 0:
            return False, "no room left for the KV cache"
        if self.seqs is None:
            ok = mem.fits_one_request
            return ok, f"{mem.kv_cache_tokens:,} KV tokens" + ("" if ok else ", still short")
        conc = mem.concurrency_for(_sizing_length(self.req), self.req.prefix_reuse_fraction)
        ok = mem.fits_one_request and conc >= self.seqs
        return ok, f"room for {conc:,.1f} of the {self.seqs} requests" + ("" if ok else ", still short")


def _suggestions(req: PlanRequest, opt: _Option, need: _Need) -> list[str]:
    """Each setting that could make it fit, with the value computed (vLLM's template: which knob, to what)."""
    mem, tp = opt.memory, opt.tp
    out: list[str] = []
    length = req.resolved_max_model_len
    if need.seqs is None:
        largest_len = mem.largest_max_model_len()
        if 16 <= largest_len < length:
            out.append(f"lower max_model_len to <= {largest_len:,} (fits at TP={tp} as configured)")
    else:
        largest_len = max(0, (mem.num_blocks - 1) // need.seqs) * mem.block_size
        out.insert(0, f"lower max_num_seqs to <= {max(1, opt.cap)} or unset require_max_num_seqs")
        if 16 <= largest_len < length:
            out.append(f"lower max_model_len to <= {largest_len:,} so {need.seqs} requests fit")
    if req.accelerator == "cpu":
        blocks = need.seqs * cdiv(length, mem.block_size) if need.seqs else cdiv(length, mem.block_size)
        need_gib = bytes_to_gib((blocks + 1) * mem.kv_bytes_per_block)
        out.append(f"raise cpu_kv_cache_space_gib to >= {math.ceil(need_gib * 100) / 100:,.2f}")
        if req.kv_cache_dtype == "auto":
            ok, text = need.verdict(_alternative(req, tp, kv_cache_dtype="fp8"))
            out.append(f"kv_cache_dtype='fp8' -> {text}")
        return out
    if mem.quantization.bytes_per_weight > 1.05:
        fp8 = _alternative(req, tp, quantization="fp8")
        if fp8 is not None:
            gpu = req.cluster.gpu
            kind = (
                "" if gpu is None or gpu.fp8_dense_tflops else f" (weight-only Marlin kernels on {gpu.name})"
            )
            _, text = need.verdict(fp8)
            out.append(
                f"quantize: quantization='fp8'{kind} -> weights {_gib(fp8.weights_bytes)}/GPU at TP={tp}, "
                f"{text}"
            )
        awq = _alternative(req, tp, quantization="awq_marlin")
        if awq is not None:
            _, text = need.verdict(awq)
            out.append(
                f"or serve an int4 AWQ/GPTQ checkpoint -> weights {_gib(awq.weights_bytes)}/GPU, {text}"
            )
    if req.kv_cache_dtype == "auto" and mem.kv_cache_available_bytes > 0:
        kv8 = _alternative(req, tp, kv_cache_dtype="fp8")
        if kv8 is not None:
            _, text = need.verdict(kv8)
            out.append(
                f"kv_cache_dtype='fp8' halves KV bytes per token ({mem.kv_bytes_per_token:,} -> "
                f"{kv8.kv_bytes_per_token:,}): {text}"
            )
    if req.gpu_memory_utilization < 0.95:
        ok, text = need.verdict(_alternative(req, tp, gpu_memory_utilization=0.95))
        if ok:
            out.append(f"raise gpu_memory_utilization to 0.95 -> {text}")
    # More GPUs: the smallest TP that would fit, whatever the cluster has.
    gpus_per_node = req.cluster.gpus_per_node
    for bigger in (t for t in TP_CANDIDATES if t > tp):
        if valid_tensor_parallel_sizes(req.model, 16)[bigger] is not None:
            continue
        alt = _alternative(req, bigger)
        ok, text = need.verdict(alt)
        if ok and alt is not None:
            where = (
                ""
                if bigger <= gpus_per_node
                else f"; nodes here have {gpus_per_node} GPU(s), so add GPUs per node"
            )
            out.append(
                f"more GPUs: tensor_parallel_size={bigger} fits ({_gib(alt.weights_bytes)} weights/GPU, "
                f"{text}){where}"
            )
            break
    else:
        out.append(
            "more GPUs alone will not do: it does not fit even at TP=8 in one node, and headroom does not "
            "plan pipeline parallelism across nodes; quantize"
        )
    return out


def _refuse(req: PlanRequest, opt: _Option, options: list[_Option], strict_seqs: bool = False) -> Plan:
    """A Plan(fits=False) in vLLM's error template: need vs supply with units, what would fit, what to
    change.
    """
    mem, tp = opt.memory, opt.tp
    gpu = req.cluster.gpu
    length = req.resolved_max_model_len
    on_gpu = req.accelerator == "gpu"
    unit = "per GPU" if on_gpu else "per replica"
    where = f"{req.cluster.total_gpus} x {gpu.name if gpu else 'GPU'}" if on_gpu else "the CPU backend"
    weights_text = f"{_gib(mem.weights_bytes + mem.draft_weights_bytes)} of weights {unit} at TP={tp}"
    reasons = [
        f"won't fit: {req.model.name} ({mem.quantization.description}, {weights_text}, max_model_len "
        f"{length:,}, max_num_seqs {req.max_num_seqs}) on {where}"
    ]
    one_request_bytes = cdiv(length, mem.block_size) * mem.kv_bytes_per_block
    if mem.kv_cache_available_bytes <= 0:
        overhead = mem.activation_peak_bytes + mem.non_torch_bytes
        reasons.append(
            f"Weights need {_gib(mem.weights_bytes + mem.draft_weights_bytes)} per GPU and "
            f"activations/runtime {_gib(overhead)}, which is larger than the budget of "
            f"{_gib(mem.requested_bytes)} (gpu_memory_utilization {mem.gpu_memory_utilization:g} x "
            f"{_gib(mem.gpu_memory_bytes)}); no memory is left for the KV cache (short by "
            f"{_gib(-mem.kv_cache_available_bytes)})."
        )
    elif not mem.fits_one_request:
        supply = "cpu_kv_cache_space_gib" if not on_gpu else "available KV cache memory"
        reasons.append(
            f"To serve at least one request with max_model_len ({length:,}), {_gib(one_request_bytes)} KV "
            f"cache is needed {unit}, which is larger than the {supply} "
            f"({_gib(mem.kv_cache_available_bytes)} = {mem.kv_cache_tokens:,} tokens). Based on the "
            f"available memory, the largest max_model_len that fits is {mem.largest_max_model_len():,}."
        )
    seqs_need = req.max_num_seqs * one_request_bytes
    max_seqs_fit = max(0, int(mem.max_concurrency)) if mem.num_blocks > 1 else 0
    if strict_seqs or req.max_num_seqs > max(1, max_seqs_fit):
        sizing = _sizing_length(req)
        reasons.append(
            f"max_num_seqs={req.max_num_seqs} requests of {length:,} tokens need {_gib(seqs_need)} of KV "
            f"cache {unit}; the KV cache holds {_gib(max(0, mem.kv_cache_bytes))} = {mem.kv_cache_tokens:,} "
            f"tokens, so at most {max_seqs_fit} fit at max_model_len"
            + (
                f" and {opt.kv_concurrency:.1f} at the typical {sizing:,}-token request"
                if sizing != length
                else ""
            )
            + (" (require_max_num_seqs is set, so it is not lowered)" if strict_seqs else "")
            + "."
        )
    need = _Need(req, req.max_num_seqs if strict_seqs else None)
    reasons.append("Change one of: " + "; ".join(_suggestions(req, opt, need)) + ".")
    return Plan(
        fits=False,
        tensor_parallel_size=tp,
        replicas=0,
        bundles=(),
        placement_strategy="STRICT_PACK" if tp > 1 else "PACK",
        max_num_seqs=max_seqs_fit,
        gpu_memory_utilization=req.gpu_memory_utilization,
        kv_cache_tokens_per_replica=mem.kv_cache_tokens,
        max_concurrency_per_replica=mem.max_concurrency,
        weights_gib_per_gpu=bytes_to_gib(mem.weights_bytes + mem.draft_weights_bytes),
        kv_bytes_per_token=mem.kv_bytes_per_token,
        reasons=tuple(reasons),
        warnings=tuple(mem.notes),
        accelerator=req.accelerator,
        gpu_type=gpu.name if gpu and on_gpu else None,
        max_model_len=length,
        max_num_batched_tokens=mem.max_num_batched_tokens,
        memory=mem,
        alternatives=tuple(o.summary() for o in options),
    )


def _refuse_invalid_tp(req: PlanRequest, tp: int, why: str) -> Plan:
    gpu = req.cluster.gpu
    valid = [
        t for t, w in valid_tensor_parallel_sizes(req.model, req.cluster.gpus_per_node).items() if w is None
    ]
    hint = f"use one of {valid} or null to let the planner choose" if valid else "use nodes with more GPUs"
    return Plan(
        fits=False,
        tensor_parallel_size=tp,
        replicas=0,
        bundles=(),
        placement_strategy="STRICT_PACK" if tp > 1 else "PACK",
        max_num_seqs=0,
        gpu_memory_utilization=req.gpu_memory_utilization,
        kv_cache_tokens_per_replica=0,
        max_concurrency_per_replica=0.0,
        weights_gib_per_gpu=0.0,
        kv_bytes_per_token=0,
        reasons=(f"won't fit: tensor_parallel_size={tp} is not possible here: {why}", f"Change: {hint}."),
        accelerator=req.accelerator,
        gpu_type=gpu.name if gpu else None,
        max_model_len=req.resolved_max_model_len,
    )


def _plan_cpu(req: PlanRequest) -> Plan:
    warnings: list[str] = []
    space = req.cpu_kv_cache_space_gib
    if space is None:
        space = 4.0
        warnings.append(
            "cpu_kv_cache_space_gib not set; planned with 4 GiB (set it: vLLM's CPU default varies)"
        )
    if req.tensor_parallel_size not in (None, 1):
        return _refuse_invalid_tp(
            req, req.tensor_parallel_size, "the CPU accelerator runs one rank per replica"
        )
    mem = estimate_memory(req.memory_inputs(1, cpu_kv_cache_space_gib=space))
    length = req.resolved_max_model_len
    kv_conc = mem.concurrency_for(_sizing_length(req), req.prefix_reuse_fraction)
    cap = max(0, min(req.max_num_seqs, int(kv_conc) if math.isfinite(kv_conc) else req.max_num_seqs))
    opt = _Option(1, mem, req.cluster.nodes, kv_conc, cap, 0, None)
    if not opt.fits or (req.require_max_num_seqs and cap < req.max_num_seqs):
        return _refuse(req, opt, [opt], strict_seqs=opt.fits)
    max_num_seqs = req.max_num_seqs
    if cap < req.max_num_seqs:
        max_num_seqs = max(1, cap)
        warnings.append(
            f"max_num_seqs lowered from {req.max_num_seqs} to {max_num_seqs}: {space:g} GiB of CPU KV cache "
            f"holds {mem.kv_cache_tokens:,} tokens = {kv_conc:.1f} requests of {_sizing_length(req):,} "
            "tokens"
        )
    typical = (
        mem.concurrency_for(req.typical_request_tokens, req.prefix_reuse_fraction)
        if req.typical_request_tokens
        else None
    )
    reasons = (
        f"CPU backend: one rank per replica, {req.cluster.nodes} replica(s); {space:g} GiB KV cache "
        f"(cpu_kv_cache_space_gib) = {mem.kv_cache_tokens:,} tokens in {mem.block_size}-token blocks",
        "latency is not modelled on CPU; measure it with the tuning ladder",
    )
    return Plan(
        fits=True,
        tensor_parallel_size=1,
        replicas=req.cluster.nodes,
        bundles=({"CPU": req.num_cpus_per_replica if req.num_cpus_per_replica >= 1 else 1},),
        placement_strategy="PACK",
        max_num_seqs=max_num_seqs,
        gpu_memory_utilization=req.gpu_memory_utilization,
        kv_cache_tokens_per_replica=mem.kv_cache_tokens,
        max_concurrency_per_replica=mem.max_concurrency,
        weights_gib_per_gpu=bytes_to_gib(mem.weights_bytes),
        kv_bytes_per_token=mem.kv_bytes_per_token,
        reasons=reasons,
        warnings=tuple(warnings),
        accelerator="cpu",
        max_model_len=length,
        max_num_batched_tokens=mem.max_num_batched_tokens,
        max_concurrency_at_typical_length=typical,
        planned_concurrency_per_replica=max_num_seqs,
        memory=mem,
    )


# ============================================================================================ rendering
def render_plan_table(plan: Plan) -> str:
    """The plan as a plain-text table (the CLI may dress it up with Rich)."""
    rows: list[tuple[str, str]] = [("fits", "yes" if plan.fits else "NO")]
    where = f"{plan.gpu_type} x{plan.tensor_parallel_size}" if plan.accelerator == "gpu" else "CPU"
    rows += [
        ("accelerator", where),
        ("tensor_parallel_size", str(plan.tensor_parallel_size)),
        ("replicas", str(plan.replicas)),
        ("placement", f"{plan.placement_strategy} {list(plan.bundles)}" if plan.bundles else "-"),
        ("max_model_len", f"{plan.max_model_len:,}"),
        ("max_num_seqs", str(plan.max_num_seqs)),
        (
            "max_num_batched_tokens",
            f"{plan.max_num_batched_tokens:,}" if plan.max_num_batched_tokens else "-",
        ),
        ("gpu_memory_utilization", f"{plan.gpu_memory_utilization:g}"),
        ("weights per GPU", f"{plan.weights_gib_per_gpu:,.2f} GiB"),
        ("KV bytes per token", f"{plan.kv_bytes_per_token:,} ({plan.kv_bytes_per_token / 1024:,.1f} KiB)"),
        ("KV cache per replica", f"{plan.kv_cache_tokens_per_replica:,} tokens"),
        ("max concurrency", f"{plan.max_concurrency_per_replica:,.2f} at {plan.max_model_len:,} tokens"),
    ]
    if plan.max_concurrency_at_typical_length is not None:
        rows.append(("  at typical length", f"{plan.max_concurrency_at_typical_length:,.2f}"))
    mem = plan.memory
    if mem is not None and plan.accelerator == "gpu":
        rows += [
            ("budget per GPU", _gib(mem.requested_bytes)),
            ("  activation peak", _gib(mem.activation_peak_bytes)),
            ("  non-torch", _gib(mem.non_torch_bytes)),
            (
                "  CUDA graphs",
                _gib(mem.cudagraph_bytes) + ("" if mem.cudagraph_subtracted else " (outside budget)"),
            ),
            ("  draft weights", _gib(mem.draft_weights_bytes)),
            ("  KV cache", _gib(mem.kv_cache_bytes)),
        ]
    if plan.estimated_tpot_p50_ms is not None:
        rows += [
            ("planned concurrency", str(plan.planned_concurrency_per_replica)),
            ("est. TPOT p50", f"{plan.estimated_tpot_p50_ms:,.1f} ms"),
            ("est. TTFT p95", f"{plan.estimated_ttft_p95_ms:,.0f} ms" if plan.estimated_ttft_p95_ms else "-"),
            ("est. output tok/s/GPU", f"{plan.estimated_output_tokens_per_s_per_gpu or 0:,.0f}"),
        ]
    width = max(len(k) for k, _ in rows)
    lines = [f"{k.ljust(width)}  {v}" for k, v in rows]
    rule = "-" * max(len(line) for line in lines)
    out = [rule, *lines, rule]
    out += [f"reason: {r}" for r in plan.reasons]
    out += [f"warning: {w}" for w in plan.warnings]
    return "\n".join(out)
