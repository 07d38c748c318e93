"""GPU memory model of one vLLM replica: weights + activation peak + runtime buffers + draft model + KV cache.

The seed article's budget, made exact where vLLM is exact:

    GPU memory x gpu_memory_utilization = weights + peak activation + non-torch buffers [+ CUDA graphs]
                                          + draft model/head + KV cache

and the KV cache is whole blocks,
``num_blocks = available_bytes // (block_size x bytes_per_token_all_layers)``
(``get_kv_cache_config_from_groups`` in ``vllm/v1/core/kv_cache_utils.py``), reported as
``int(num_blocks / cdiv(max_model_len, block_size) x max_model_len)`` tokens ("GPU KV cache size: N tokens").

Where each number comes from:

* Weights and KV bytes per token: :mod:`serve_app.planning.model_bytes` (parameter counts from config.json,
  sharded per tensor-parallel rank as vLLM's layers shard them, times the bytes of the dtype or quantization).
* Activation peak, non-torch buffers, CUDA graphs: measured on one H200 with vLLM 0.26 (dummy weights,
  2026-11-29; logs summarised in ``tests/data/memory_points/``) and written as formulas of the shape, so no
  constant is tuned per model. See :func:`activation_peak_bytes`, :func:`non_torch_bytes`,
  :func:`cudagraph_bytes`.
* The budget is ``ceil(total_memory x gpu_memory_utilization)`` (``request_memory`` in
  ``vllm/v1/worker/utils.py``), total as torch reports it.

vLLM 0.26 (the GPU build headroom deploys) has two model runners. Model runner V2 (dense models, and the
MoE architectures in ``DEFAULT_V2_MODEL_RUNNER_ARCHITECTURES``) captures CUDA graphs *after* allocating the KV
cache, inside the ``1 - gpu_memory_utilization`` headroom, so their memory is not subtracted (the dense
reference point only reproduces that way). The V1 runner, which vLLM 0.26 picks for the other MoE
architectures (Qwen3-MoE, Mixtral), profiles the graphs first and subtracts that estimate from the KV budget
(``profile_cudagraph_memory`` and ``VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS`` in
``determine_available_memory``; measured on Qwen3-30B-A3B). ``MemoryInputs.subtract_cudagraph_estimate`` =
True models newer vLLM, which subtracts the estimate for every model.

A KV cache size given directly (``kv_cache_memory_bytes``, vLLM's ``--kv-cache-memory-bytes``; on the CPU
backend also VLLM_CPU_KVCACHE_SPACE) replaces the profiled budget; on CPU blocks hold 128 tokens
(``vllm/platforms/cpu.py``; measured with the CPU build: 512 MiB at 512 bytes/token -> 1,048,576 tokens).

Pure: imports neither ray, vllm nor torch.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from serve_app.config.vocabulary import DRAFT_HEAD_METHODS, GIB_BYTES, Accelerator
from serve_app.planning.model_bytes import (
    QuantScheme,
    SpeculativeSpec,
    bytes_to_gib,
    cdiv,
    draft_kv_bytes_per_token_per_gpu,
    draft_weight_bytes_per_gpu,
    dtype_bytes,
    kv_bytes_per_token_per_gpu,
    padded_vocab_size,
    resolve_model_dtype,
    resolve_quantization,
    weight_bytes_per_gpu,
)
from serve_app.planning.shape import ModelShape

__all__ = [
    "CPU_BLOCK_SIZE_TOKENS",
    "CUDA_CONTEXT_BYTES",
    "DEFAULT_V2_MODEL_RUNNER_ARCHITECTURES",
    "GPU_BLOCK_SIZE_TOKENS",
    "MemoryEstimate",
    "MemoryInputs",
    "activation_peak_bytes",
    "cudagraph_bytes",
    "cudagraph_capture_sizes",
    "default_max_num_batched_tokens",
    "estimate_memory",
    "largest_max_model_len",
    "blocks_for_requests",
    "max_concurrency_for_length",
    "non_torch_bytes",
    "requested_memory_bytes",
    "uses_v1_model_runner",
    "vllm_reported_kv_tokens",
]

# vLLM's KV block on CUDA (CacheConfig default block_size) and on CPU (vllm/platforms/cpu.py sets 128).
GPU_BLOCK_SIZE_TOKENS = 16
CPU_BLOCK_SIZE_TOKENS = 128

# Measured (H200, vLLM 0.26, Qwen3-0.6B and Qwen3-8B alike, the logs in tests/data/memory_points/h200_*.json):
# "non-torch forward increase memory: 0.22GiB" -
# cuBLAS/cuDNN workspaces and attention-backend buffers created during the profile run. It did not change with
# model size, so it is a constant at TP=1.
NON_TORCH_BYTES_TP1 = int(0.22 * GIB_BYTES)
# Allowance for TP > 1, kept deliberately pessimistic. The TP=2 fixtures (h200x2_qwen3_8b_tp2_*.json, vLLM
# 0.26) measured LESS, not more: "non-torch forward increase memory: 0.07GiB" compiled, 0.06 eager, per rank.
# The NCCL and custom all-reduce buffers (about 1.02 GiB per rank) are allocated before vLLM's init snapshot
# (cuda_memory=1.53GiB vs 0.51 at TP=1), i.e. outside the utilization budget, not inside the profile run.
# The figure costs ~0.6 GiB of KV per rank at TP=2 (-0.5 % tokens, inside the fixtures' tolerance); lowering
# it to the measured 0.07 GiB also needs test_tp2_halves_kv_per_token_and_adds_nccl_allowance changed.
NON_TORCH_EXTRA_BYTES_TP = int(0.5 * GIB_BYTES)
# Measured: the CUDA context and allocator state held before vLLM's first snapshot ("worker init memory
# snapshot: ... cuda_memory=0.51GiB" on the H200). It sits outside gpu_memory_utilization's accounting, so it
# must fit in the 1 - utilization headroom together with the CUDA graphs.
CUDA_CONTEXT_BYTES = int(0.51 * GIB_BYTES)
# Calibrated on the one logged figure (Qwen3-8B, H200, vLLM 0.26: 0.61 GiB for 51 piecewise + 35 full decode
# graphs of 36 layers): about 206 KiB of graph-pool memory per captured graph per decoder layer.
CUDAGRAPH_BYTES_PER_GRAPH_LAYER = int(0.61 * GIB_BYTES / ((51 + 35) * 36))

# vllm/config/vllm.py (0.26): MoE architectures that still run on model runner V2 by default; every other MoE
# architecture runs on the V1 runner (``VllmConfig.use_v2_model_runner``).
DEFAULT_V2_MODEL_RUNNER_ARCHITECTURES = frozenset(
    {
        "DeepseekV2ForCausalLM",
        "GraniteMoeForCausalLM",
        "InklingForCausalLM",
        "InklingForConditionalGeneration",
        "LongcatFlashNgramForCausalLM",
        "Qwen2MoeForCausalLM",
    }
)


# ------------------------------------------------------------------------------- activations, runtime
def default_max_num_batched_tokens(
    gpu_memory_bytes: int,
    gpu_name: str = "",
    accelerator: Accelerator = "gpu",
    world_size: int = 1,
    max_model_len: int | None = None,
    enable_chunked_prefill: bool = True,
) -> int:
    """vLLM's default step token budget for the OpenAI server context, which headroom's engine uses
    (``EngineArgs.get_batch_defaults``): 16384 on GPUs of >= 160 GiB, 8192 on >= 70 GiB ones except A100,
    2048 elsewhere; 2048 x world size on CPU. Without chunked prefill a whole prompt must fit one step."""
    if accelerator == "cpu":
        budget = 2048 * world_size
    elif gpu_memory_bytes >= 160 * GIB_BYTES:
        budget = 16384
    elif gpu_memory_bytes >= 70 * GIB_BYTES and "a100" not in gpu_name.lower():
        budget = 8192
    else:
        budget = 2048
    if not enable_chunked_prefill and max_model_len is not None:
        budget = max(budget, max_model_len)
    return budget


def activation_peak_bytes(
    shape: ModelShape,
    max_num_batched_tokens: int,
    tensor_parallel_size: int = 1,
    dtype: str = "auto",
    accelerator: Accelerator = "gpu",
) -> int:
    """Transient torch memory of vLLM's profile run ("torch peak memory increase"), per rank.

    The larger of two phases, both fitted to measurements (H200, vLLM 0.26, torch.compile on) rather than to
    any one model:

    * an embedding-table-sized transient plus two hidden-state rows per batched token:
      ``(vocab_padded / tp x H + 2 x T x H) x bytes``. It reproduces the logged peak of Qwen3-8B at 2048 and
      8192 tokens (1.19, 1.29 GiB) and of Qwen3-0.6B at 8192 (0.32 GiB) to 0.01 GiB; it did not change with
      max_num_seqs (64 vs 256), so it is not the sampler.
    * the MLP peak of the compiled forward: per batched token the gate_up output (2I), the activation (I) and
      four hidden-size tensors, ``T x (3 I/tp + 4 H) x bytes``; 1.62 GiB predicted vs 1.59 GiB logged for
      Qwen3-8B at 16384 tokens.
    * MoE layers: fused_moe's three caches per routed token, ``top_k x (3 I_moe/tp + H)``, plus the shared
      experts' MLP (unmeasured), come ON TOP of the embedding-sized phase. Measured on Qwen3-30B-A3B (top-8,
      I_moe 768, H 2048; vLLM 0.26's V1 runner): 0.75 GiB at 2048 and 1.15 GiB at 8192 batched tokens, a slope
      of 0.40 GiB per 6144 tokens = 34,950 bf16 elements per token against top_k x (3 I_moe + H) = 34,816;
      predicted 0.73 and 1.17 GiB.
    """
    tp = tensor_parallel_size
    act = dtype_bytes(resolve_model_dtype(shape, dtype, accelerator))
    hidden, tokens = shape.hidden_size, max_num_batched_tokens
    phase_embedding = (padded_vocab_size(shape.vocab_size) // tp * hidden + 2 * tokens * hidden) * act
    dense_per_token = 3 * shape.intermediate_size // tp + 4 * hidden if shape.num_dense_layers else 0
    phase_mlp = tokens * dense_per_token * act
    if shape.is_moe:
        routed = shape.num_experts_per_tok * (3 * shape.moe_intermediate_size // tp + hidden)
        shared = 3 * shape.shared_expert_intermediate_size // tp
        phase_embedding += tokens * (routed + shared) * act
    return int(max(phase_embedding, phase_mlp))


def non_torch_bytes(tensor_parallel_size: int = 1) -> int:
    """Memory allocated outside torch during the profile run (cuBLAS workspaces, NCCL, custom all-reduce)."""
    return NON_TORCH_BYTES_TP1 + (NON_TORCH_EXTRA_BYTES_TP if tensor_parallel_size > 1 else 0)


def cudagraph_capture_sizes(
    max_num_seqs: int, max_num_batched_tokens: int, num_speculative_tokens: int = 0
) -> list[int]:
    """Batch sizes vLLM captures (``VllmConfig._set_cudagraph_sizes``): [1, 2, 4], then every 8 below 256,
    every 16 from 256, up to min(2 x max_num_seqs x decode query length, 512, max_num_batched_tokens)."""
    query_len = 1 + num_speculative_tokens
    largest = min(max_num_seqs * query_len * 2, 512, max_num_batched_tokens)
    sizes = [s for s in (1, 2, 4) if s <= largest]
    sizes += list(range(8, min(largest + 1, 256), 8))
    sizes += list(range(256, largest + 1, 16))
    if max_num_batched_tokens <= largest and max_num_batched_tokens not in sizes:
        sizes.append(max_num_batched_tokens)
    return sorted(set(sizes))


def cudagraph_bytes(
    shape: ModelShape,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    num_speculative_tokens: int = 0,
    enforce_eager: bool = False,
) -> int:
    """Graph-pool memory of vLLM's CUDA graphs (FULL_AND_PIECEWISE): one piecewise graph per capture size and
    one full decode graph per size up to the decode batch, each costing CUDAGRAPH_BYTES_PER_GRAPH_LAYER per
    decoder layer (calibrated on the one logged figure, 0.61 GiB for Qwen3-8B).

    The same figure stands for the V1 runner's profiled estimate where that is subtracted; it overstates it
    there: 0.81 GiB predicted for Qwen3-30B-A3B against "Estimated CUDA graph memory: 0.49 GiB total"
    (82 MiB + 50 x 6 MiB piecewise, 134 MiB + 34 x 2 MiB full, pools overlaid), i.e. 0.5 % fewer KV tokens.
    """
    if enforce_eager:
        return 0
    sizes = cudagraph_capture_sizes(max_num_seqs, max_num_batched_tokens, num_speculative_tokens)
    decode_tokens = max_num_seqs * (1 + num_speculative_tokens)
    full_graphs = sum(1 for s in sizes if s <= decode_tokens)
    return (len(sizes) + full_graphs) * shape.num_hidden_layers * CUDAGRAPH_BYTES_PER_GRAPH_LAYER


def uses_v1_model_runner(shape: ModelShape) -> bool:
    """Whether vLLM 0.26 runs this model on its V1 GPU model runner, which subtracts a profiled CUDA graph
    estimate from the KV budget (``VllmConfig.use_v2_model_runner``): MoE architectures outside
    DEFAULT_V2_MODEL_RUNNER_ARCHITECTURES. Measured: Qwen3-30B-A3B logs "Estimated CUDA graph memory: 0.49
    GiB total" and its available KV is 0.49 GiB less than the profile alone leaves; Qwen3-8B (V2) subtracts
    nothing.

    vLLM 0.26 also falls back to V1 for speculative methods V2 lacks (ngram, draft_model) and for hybrid or
    attention-free models; those paths are not measured and not modelled here.
    """
    if not shape.is_moe:
        return False
    return not any(arch in DEFAULT_V2_MODEL_RUNNER_ARCHITECTURES for arch in shape.architectures)


def requested_memory_bytes(gpu_memory_bytes: int, gpu_memory_utilization: float) -> int:
    """vLLM's budget: ``ceil(total_memory x gpu_memory_utilization)`` (``request_memory``)."""
    return math.ceil(gpu_memory_bytes * gpu_memory_utilization)


# ------------------------------------------------------------------------------------ blocks, tokens
def vllm_reported_kv_tokens(num_blocks: int, block_size: int, max_model_len: int) -> int:
    """The "GPU KV cache size: N tokens" figure: ``int(num_blocks / cdiv(L, block) x L)``
    (``get_kv_cache_capacity``); equal to num_blocks x block_size when L is a multiple of the block."""
    if num_blocks <= 0:
        return 0
    return int(num_blocks / cdiv(max_model_len, block_size) * max_model_len)


def _shared_and_private_blocks(
    block_size: int, request_tokens: int, prefix_reuse_fraction: float
) -> tuple[int, int]:
    """(blocks of the prefix shared by all requests, blocks each request holds alone).

    With prefix caching, the first ``prefix_reuse_fraction`` of every request is one shared prefix stored
    once; only whole blocks are shared (a partly filled block is private), so the shared part rounds down
    to whole blocks.
    """
    per_request = cdiv(request_tokens, block_size)
    shared = int(request_tokens * max(0.0, min(prefix_reuse_fraction, 1.0))) // block_size
    return shared, per_request - shared


def max_concurrency_for_length(
    num_blocks: int, block_size: int, request_tokens: int, prefix_reuse_fraction: float = 0.0
) -> float:
    """Requests of ``request_tokens`` tokens that fit at once (shared prefix stored once, see
    :func:`_shared_and_private_blocks`). With no reuse this is vLLM's "Maximum concurrency for L tokens per
    request".
    """
    if num_blocks <= 0 or request_tokens <= 0:
        return 0.0
    shared, private = _shared_and_private_blocks(block_size, request_tokens, prefix_reuse_fraction)
    if private <= 0:  # everything shared: the cache holds the prefix once and any number of readers
        return math.inf if num_blocks >= shared else 0.0
    return max(0.0, (num_blocks - shared) / private)


def blocks_for_requests(
    requests: int, block_size: int, request_tokens: int, prefix_reuse_fraction: float = 0.0
) -> int:
    """KV blocks ``requests`` requests of ``request_tokens`` tokens hold at once: the inverse of
    :func:`max_concurrency_for_length` (the seeds' KV cache = concurrency x context x bytes per token)."""
    shared, private = _shared_and_private_blocks(block_size, request_tokens, prefix_reuse_fraction)
    return shared + requests * max(0, private)


def largest_max_model_len(num_blocks: int, block_size: int) -> int:
    """Longest max_model_len one request can have: vLLM keeps one null block back from the pool
    (``check_enough_kv_cache_memory`` plans against usable blocks)."""
    return max(0, (num_blocks - 1) * block_size)


# ------------------------------------------------------------------------------------------ estimate
@dataclass(frozen=True)
class MemoryInputs:
    """Everything that decides one replica's memory budget, with vLLM's defaults."""

    model: ModelShape
    # Total memory of one GPU as torch reports it (catalogue: GpuSpec.memory_bytes). Unused on CPU.
    gpu_memory_bytes: int = 0
    gpu_name: str = ""
    gpu_memory_utilization: float = 0.9
    tensor_parallel_size: int = 1
    dtype: str = "auto"
    quantization: str | None = None
    kv_cache_dtype: str = "auto"
    # None: the model's max_position_embeddings, as vLLM does.
    max_model_len: int | None = None
    max_num_seqs: int = 256
    # None: vLLM's default for the OpenAI server context (see default_max_num_batched_tokens).
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool = True
    speculative: SpeculativeSpec | None = None
    accelerator: Accelerator = "gpu"
    # CPU backend only: KV cache size in GiB (VLLM_CPU_KVCACHE_SPACE).
    cpu_kv_cache_space_gib: float | None = None
    # vLLM's --kv-cache-memory-bytes (GPU or CPU): the KV cache size, replacing the profiled budget.
    kv_cache_memory_bytes: int | None = None
    enforce_eager: bool = False
    # False = vLLM 0.26: on model runner V2 graphs are captured after the KV cache, in the 1 - utilization
    # headroom; its V1 runner (MoE outside DEFAULT_V2_MODEL_RUNNER_ARCHITECTURES) subtracts them even so.
    # True = newer vLLM, which subtracts the estimate for every model.
    subtract_cudagraph_estimate: bool = False
    # None: 16 on GPU, 128 on CPU.
    block_size: int | None = None


@dataclass(frozen=True)
class MemoryEstimate:
    """The budget of one replica, per GPU (rank), in bytes; ``*_gib`` properties for display."""

    tensor_parallel_size: int
    accelerator: Accelerator
    model_dtype: str
    quantization: QuantScheme
    block_size: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    gpu_memory_bytes: int
    gpu_memory_utilization: float
    requested_bytes: int
    weights_bytes: int
    draft_weights_bytes: int
    activation_peak_bytes: int
    non_torch_bytes: int
    cudagraph_bytes: int
    cudagraph_subtracted: bool
    kv_cache_available_bytes: int
    target_kv_bytes_per_token: int
    draft_kv_bytes_per_token: int
    num_blocks: int
    # Memory outside the utilization budget left after CUDA graphs and the CUDA context (GPU only).
    headroom_after_graphs_bytes: int

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes one token takes in every KV block on this rank (target layers + drafter layers)."""
        return self.target_kv_bytes_per_token + self.draft_kv_bytes_per_token

    @property
    def kv_bytes_per_block(self) -> int:
        return self.kv_bytes_per_token * self.block_size

    @property
    def kv_cache_tokens(self) -> int:
        """vLLM's logged "KV cache size: N tokens"."""
        return vllm_reported_kv_tokens(self.num_blocks, self.block_size, self.max_model_len)

    @property
    def kv_cache_bytes(self) -> int:
        return max(0, self.num_blocks) * self.kv_bytes_per_block

    @property
    def max_concurrency(self) -> float:
        """vLLM's "Maximum concurrency for max_model_len tokens per request"."""
        return max_concurrency_for_length(self.num_blocks, self.block_size, self.max_model_len)

    @property
    def fits_one_request(self) -> bool:
        """vLLM starts only if one max_model_len request fits besides the null block."""
        return self.num_blocks - 1 >= cdiv(self.max_model_len, self.block_size)

    def concurrency_for(self, request_tokens: int, prefix_reuse_fraction: float = 0.0) -> float:
        return max_concurrency_for_length(
            self.num_blocks, self.block_size, request_tokens, prefix_reuse_fraction
        )

    @property
    def seqs_without_preemption(self) -> int:
        """The worst-case guarantee: sequences that fit at once beside vLLM's null block even if every one
        reaches max_model_len, so none is ever preempted."""
        return max(0, (self.num_blocks - 1) // cdiv(self.max_model_len, self.block_size))

    def largest_max_model_len(self) -> int:
        return largest_max_model_len(self.num_blocks, self.block_size)

    def gib(self, name: str) -> float:
        return bytes_to_gib(float(getattr(self, name)))

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["quantization"] = asdict(self.quantization)
        d.update(
            kv_bytes_per_token=self.kv_bytes_per_token,
            kv_cache_tokens=self.kv_cache_tokens,
            max_concurrency=round(self.max_concurrency, 2),
            weights_gib=round(self.gib("weights_bytes"), 3),
            kv_cache_gib=round(bytes_to_gib(self.kv_cache_bytes), 3),
        )
        return d


@dataclass(frozen=True)
class _Budget:
    """The memory budget of one rank and what it leaves for KV blocks (bytes)."""

    requested_bytes: int
    kv_cache_available_bytes: int
    non_torch_bytes: int = 0
    cudagraph_bytes: int = 0
    cudagraph_subtracted: bool = False
    headroom_after_graphs_bytes: int = 0


def _cpu_budget(inputs: MemoryInputs) -> _Budget:
    """The CPU backend's KV cache is the size given: no profiling, no graphs."""
    if inputs.kv_cache_memory_bytes is not None:
        available = int(inputs.kv_cache_memory_bytes)
    elif inputs.cpu_kv_cache_space_gib is not None:
        available = int(inputs.cpu_kv_cache_space_gib * GIB_BYTES)
    else:
        # Without it vLLM's CPU worker takes gpu_memory_utilization of the node's RAM minus the process's
        # resident size at that moment, which no pure model can know.
        raise ValueError(
            "cpu_kv_cache_space_gib (VLLM_CPU_KVCACHE_SPACE) or kv_cache_memory_bytes is required on the "
            "CPU accelerator"
        )
    return _Budget(requested_bytes=available, kv_cache_available_bytes=available)


def _gpu_budget(inputs: MemoryInputs, resident_bytes: int, budget_tokens: int) -> _Budget:
    """vLLM's profiled budget on a GPU rank; ``resident_bytes``: weights, draft weights, activation peak."""
    if inputs.gpu_memory_bytes <= 0:
        raise ValueError("gpu_memory_bytes must be > 0 on the GPU accelerator (use the GPU catalogue)")
    shape, tp = inputs.model, inputs.tensor_parallel_size
    num_spec = inputs.speculative.num_speculative_tokens if inputs.speculative else 0
    requested = requested_memory_bytes(inputs.gpu_memory_bytes, inputs.gpu_memory_utilization)
    non_torch = non_torch_bytes(tp)
    graphs = cudagraph_bytes(shape, inputs.max_num_seqs, budget_tokens, num_spec, inputs.enforce_eager)
    subtracted = (inputs.subtract_cudagraph_estimate or uses_v1_model_runner(shape)) and graphs > 0
    available = requested - resident_bytes - non_torch - (graphs if subtracted else 0)
    outside_budget = inputs.gpu_memory_bytes - requested
    headroom = outside_budget - CUDA_CONTEXT_BYTES - (0 if subtracted else graphs)
    if inputs.kv_cache_memory_bytes is not None:
        # vLLM still runs the profile forward, then takes the given size as the KV budget, whatever
        # gpu_memory_utilization says; the graphs are captured afterwards in what is left.
        available = int(inputs.kv_cache_memory_bytes)
        used = resident_bytes + non_torch + available
        headroom = inputs.gpu_memory_bytes - used - CUDA_CONTEXT_BYTES - graphs
    return _Budget(requested, available, non_torch, graphs, subtracted, headroom)


def _activation_peak(inputs: MemoryInputs, model_dtype: str, budget_tokens: int) -> int:
    shape, spec, accel = inputs.model, inputs.speculative, inputs.accelerator
    activation = activation_peak_bytes(shape, budget_tokens, inputs.tensor_parallel_size, model_dtype, accel)
    if spec is not None and spec.draft is not None and spec.method not in DRAFT_HEAD_METHODS:
        # The drafter's own profile forward runs after the target's; the peak is the larger of the two.
        activation = max(activation, activation_peak_bytes(spec.draft, budget_tokens, 1, model_dtype, accel))
    return activation


def estimate_memory(inputs: MemoryInputs) -> MemoryEstimate:
    """One replica's memory budget per rank, with vLLM's arithmetic (see the module docstring)."""
    shape, tp, accel, spec = inputs.model, inputs.tensor_parallel_size, inputs.accelerator, inputs.speculative
    model_dtype = resolve_model_dtype(shape, inputs.dtype, accel)
    block = inputs.block_size or (CPU_BLOCK_SIZE_TOKENS if accel == "cpu" else GPU_BLOCK_SIZE_TOKENS)
    max_len = inputs.max_model_len or shape.max_position_embeddings
    budget_tokens = inputs.max_num_batched_tokens or default_max_num_batched_tokens(
        inputs.gpu_memory_bytes, inputs.gpu_name, accel, tp, max_len, inputs.enable_chunked_prefill
    )
    weights = weight_bytes_per_gpu(shape, tp, model_dtype, inputs.quantization, accel)
    draft_weights = draft_weight_bytes_per_gpu(shape, spec, tp, model_dtype, accel)
    target_kv = kv_bytes_per_token_per_gpu(shape, tp, inputs.kv_cache_dtype, model_dtype, accel)
    draft_kv = draft_kv_bytes_per_token_per_gpu(shape, spec, tp, inputs.kv_cache_dtype, model_dtype, accel)
    activation = _activation_peak(inputs, model_dtype, budget_tokens)
    if accel == "cpu":
        budget = _cpu_budget(inputs)
    else:
        budget = _gpu_budget(inputs, weights + draft_weights + activation, budget_tokens)
    available = budget.kv_cache_available_bytes
    return MemoryEstimate(
        tensor_parallel_size=tp,
        accelerator=accel,
        model_dtype=model_dtype,
        quantization=resolve_quantization(shape, inputs.quantization, model_dtype),
        block_size=block,
        max_model_len=max_len,
        max_num_seqs=inputs.max_num_seqs,
        max_num_batched_tokens=budget_tokens,
        gpu_memory_bytes=inputs.gpu_memory_bytes,
        gpu_memory_utilization=inputs.gpu_memory_utilization,
        requested_bytes=budget.requested_bytes,
        weights_bytes=weights,
        draft_weights_bytes=draft_weights,
        activation_peak_bytes=activation,
        non_torch_bytes=budget.non_torch_bytes,
        cudagraph_bytes=budget.cudagraph_bytes,
        cudagraph_subtracted=budget.cudagraph_subtracted,
        kv_cache_available_bytes=available,
        target_kv_bytes_per_token=target_kv,
        draft_kv_bytes_per_token=draft_kv,
        num_blocks=available // ((target_kv + draft_kv) * block) if available > 0 else 0,
        headroom_after_graphs_bytes=budget.headroom_after_graphs_bytes,
    )
