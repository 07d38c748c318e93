"""GPU memory model of one vLLM replica: weights + activation peak + runtime buffers + draft model + KV cache.

The seed article's budget, made exact where vLLM is exact:

    GPU memory x gpu_memory_utilization = weights + peak activation + non-torch buffers [+ CUDA graphs]
                                          + draft model/head + KV cache

and the KV cache is whole blocks,
``num_blocks = available_bytes // (block_size x bytes_per_token_all_layers)``
(``get_kv_cache_config_from_groups`` in ``vllm/v1/core/kv_cache_utils.py``), reported as
``int(num_blocks / cdiv(max_model_len, block_size) x max_model_len)`` tokens ("GPU KV cache size: N tokens").

Where each number comes from:

* Weights: parameter counts from config.json, laid out per tensor-parallel rank as vLLM's layers shard them
  (``QKVParallelLinear`` replicates KV heads when tp > num_key_value_heads; norms, MoE routers and MLA's
  ``kv_a_proj_with_mqa`` are replicated; the vocabulary is padded to a multiple of 64 and split), times the
  bytes of the dtype or quantization scheme. Embeddings, lm_head, norms and routers stay unquantized. MoE
  counts every expert (all are resident; the seed: "MoE weights by TOTAL params"). Plus vLLM's rotary cos/sin
  cache and, for MLA, the decode-time ``W_UK_T``/``W_UV`` copies of ``kv_b_proj``.
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
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from serve_app.planning.shape import ModelShape

__all__ = [
    "CPU_BLOCK_SIZE_TOKENS",
    "CUDA_CONTEXT_BYTES",
    "DEFAULT_V2_MODEL_RUNNER_ARCHITECTURES",
    "DEFAULT_VOCAB_PADDING_SIZE",
    "GIB_BYTES",
    "GPU_BLOCK_SIZE_TOKENS",
    "MemoryEstimate",
    "MemoryInputs",
    "QuantScheme",
    "SpeculativeSpec",
    "WeightBreakdown",
    "activation_peak_bytes",
    "active_parameter_count",
    "blocks_for_tokens",
    "bytes_to_gib",
    "cdiv",
    "cudagraph_bytes",
    "cudagraph_capture_sizes",
    "default_max_num_batched_tokens",
    "draft_kv_bytes_per_token_per_gpu",
    "draft_weight_bytes_per_gpu",
    "dtype_bytes",
    "estimate_memory",
    "kv_bytes_per_token_per_gpu",
    "kv_bytes_per_token_per_layer",
    "kv_cache_dtype_bytes",
    "kv_heads_per_gpu",
    "largest_max_model_len",
    "max_concurrency_for_length",
    "non_torch_bytes",
    "padded_vocab_size",
    "parameter_count",
    "requested_memory_bytes",
    "resolve_model_dtype",
    "resolve_quantization",
    "uses_v1_model_runner",
    "vllm_reported_kv_tokens",
    "weight_breakdown_per_gpu",
    "weight_bytes_per_gpu",
]

GIB_BYTES = 1 << 30
# vllm/model_executor/layers/vocab_parallel_embedding.py: DEFAULT_VOCAB_PADDING_SIZE = 64.
DEFAULT_VOCAB_PADDING_SIZE = 64
# vLLM's KV block on CUDA (CacheConfig default block_size) and on CPU (vllm/platforms/cpu.py sets 128).
GPU_BLOCK_SIZE_TOKENS = 16
CPU_BLOCK_SIZE_TOKENS = 128

# Measured (H200, vLLM 0.26, Qwen3-0.6B and Qwen3-8B alike): "non-torch forward increase memory: 0.22GiB" -
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

# Bytes per element of the dtypes vLLM accepts for weights, activations and KV cache.
_DTYPE_BYTES: dict[str, float] = {
    "float32": 4,
    "float": 4,
    "bfloat16": 2,
    "float16": 2,
    "half": 2,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
    "fp8_inc": 1,
    "int8": 1,
}

Accelerator = Literal["gpu", "cpu"]


def cdiv(a: int, b: int) -> int:
    """Ceiling division, as ``vllm.utils.math_utils.cdiv``."""
    return -(a // -b)


def bytes_to_gib(n_bytes: float) -> float:
    return n_bytes / GIB_BYTES


def dtype_bytes(dtype: str) -> float:
    """Bytes per element of ``dtype`` ('bfloat16' -> 2, 'fp8' -> 1). Raises ValueError listing known
    dtypes.
    """
    key = dtype.replace("torch.", "").lower()
    if key not in _DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}; known: {', '.join(sorted(_DTYPE_BYTES))}")
    return _DTYPE_BYTES[key]


def resolve_model_dtype(shape: ModelShape, dtype: str = "auto", accelerator: Accelerator = "gpu") -> str:
    """The activation/weight dtype vLLM runs: 'auto' takes config.json's torch_dtype, float32 checkpoints
    are served in bfloat16 on GPU (vLLM downcasts float32 to the half type by default)."""
    if dtype != "auto":
        return dtype
    resolved = shape.torch_dtype.replace("torch.", "")
    if resolved in ("float32", "float") and accelerator == "gpu":
        return "bfloat16"
    return resolved


def kv_cache_dtype_bytes(kv_cache_dtype: str, model_dtype: str) -> float:
    """Bytes per KV element: 'auto' follows the model dtype; the fp8 variants store one byte."""
    return dtype_bytes(model_dtype if kv_cache_dtype == "auto" else kv_cache_dtype)


def padded_vocab_size(vocab_size: int, pad_to: int = DEFAULT_VOCAB_PADDING_SIZE) -> int:
    """vLLM pads embedding and lm_head rows to a multiple of 64 (``pad_vocab_size``)."""
    return cdiv(vocab_size, pad_to) * pad_to


# ------------------------------------------------------------------------------------------ quantization
@dataclass(frozen=True)
class QuantScheme:
    """How many bytes one quantized linear weight takes, scales and zero points included."""

    method: str | None
    bytes_per_weight: float
    description: str


_QUANT_METHODS = ("fp8", "awq", "awq_marlin", "gptq", "gptq_marlin", "compressed-tensors", "bitsandbytes")


def _int_group_bytes(bits: int, group_size: int) -> float:
    # Packed int weights plus, per group of group_size inputs, one fp16 scale and one packed zero point
    # (AWQ qzeros / GPTQ qzeros). group_size -1 means one group per output channel: negligible overhead.
    overhead = (2 + bits / 8) / group_size if group_size > 0 else 0.0
    return bits / 8 + overhead


def resolve_quantization(shape: ModelShape, quantization: str | None, model_dtype: str) -> QuantScheme:
    """The weight format vLLM will load: ``quantization`` if given, else the checkpoint's quantization_config.

    Only decoder linear layers are quantized; embeddings, lm_head, norms and MoE routers keep ``model_dtype``.
    """
    config: Mapping[str, Any] = shape.quantization_config or {}
    method = quantization or (str(config.get("quant_method")) if config.get("quant_method") else None)
    if method is None:
        return QuantScheme(None, dtype_bytes(model_dtype), f"unquantized {model_dtype}")
    method = method.lower()
    bits = int(config.get("bits", config.get("w_bit", 4)) or 4)
    group = int(config.get("group_size", config.get("q_group_size", 128)) or 128)
    if method == "fp8":
        block = config.get("weight_block_size")
        if block:
            # Block-wise fp8 checkpoints (e.g. Qwen3-*-FP8, DeepSeek-V3) carry one fp32 scale per block.
            scale = 4 / (int(block[0]) * int(block[1]))
            return QuantScheme("fp8", 1 + scale, f"fp8 weights, {block[0]}x{block[1]} block scales")
        return QuantScheme("fp8", 1.0, "fp8 weights, per-tensor scales")
    if method in ("awq", "awq_marlin", "gptq", "gptq_marlin"):
        family = method.split("_")[0]
        return QuantScheme(method, _int_group_bytes(bits, group), f"{family} int{bits}, group size {group}")
    if method == "compressed-tensors":
        groups = config.get("config_groups") or {}
        weights: Mapping[str, Any] = {}
        for group_cfg in groups.values():
            weights = group_cfg.get("weights") or {}
            break
        ct_bits = int(weights.get("num_bits", 8) or 8)
        ct_group = int(weights.get("group_size") or -1)
        if weights.get("type") == "float":
            return QuantScheme(method, ct_bits / 8, f"compressed-tensors float{ct_bits}")
        return QuantScheme(method, _int_group_bytes(ct_bits, ct_group), f"compressed-tensors int{ct_bits}")
    if method == "bitsandbytes":
        if config.get("load_in_8bit"):
            return QuantScheme(method, 1.0 + 4 / 64, "bitsandbytes int8")
        # NF4 with one fp32 absmax per 64 weights (double quantization shrinks it further).
        return QuantScheme(method, 0.5 + 4 / 64, "bitsandbytes nf4")
    raise ValueError(
        f"quantization {method!r} is not modelled; known: {', '.join(_QUANT_METHODS)} (or null for the "
        "checkpoint's own quantization_config)"
    )


# --------------------------------------------------------------------------------------------- weights
@dataclass(frozen=True)
class WeightBreakdown:
    """Parameters held by one tensor-parallel rank, grouped by how they are stored."""

    embedding_params: int
    lm_head_params: int
    # Decoder linear layers (attention projections, MLPs, experts): these take the quantized format.
    linear_params: int
    # Norms, MoE routers, biases: replicated or tiny, always in the model dtype.
    unquantized_params: int
    # MLA only: W_UK_T and W_UV, model-dtype copies of kv_b_proj that vLLM builds for decode.
    mla_absorbed_params: int
    # vLLM's rotary cos/sin cache (one shared buffer of max_position_embeddings x rotary_dim).
    rotary_cache_elements: int

    @property
    def total_params(self) -> int:
        return self.embedding_params + self.lm_head_params + self.linear_params + self.unquantized_params


def kv_heads_per_gpu(shape: ModelShape, tensor_parallel_size: int = 1) -> int:
    """KV heads each rank stores: heads are split across ranks, and replicated when tp > num_key_value_heads
    (``ModelConfig.get_num_kv_heads``: ``max(1, total // tp)``). MLA caches one latent 'head'."""
    if shape.is_mla:
        return 1
    return max(1, shape.num_key_value_heads // tensor_parallel_size)


def _check_tp(shape: ModelShape, tp: int) -> None:
    if tp < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {tp}")
    if shape.num_attention_heads % tp:
        raise ValueError(
            f"{shape.name}: num_attention_heads ({shape.num_attention_heads}) is not divisible by "
            f"tensor_parallel_size ({tp}); vLLM requires it"
        )


def _attention_params_per_rank(shape: ModelShape, tp: int) -> tuple[int, int, int]:
    """(linear, replicated-or-small, mla_absorbed) parameters of one attention block on one rank."""
    hidden, heads_rank = shape.hidden_size, shape.num_attention_heads // tp
    if shape.is_mla:
        assert shape.kv_lora_rank is not None
        nope, rope, v_dim, kv_rank = (
            shape.qk_nope_head_dim,
            shape.qk_rope_head_dim,
            shape.v_head_dim,
            shape.kv_lora_rank,
        )
        linear = 0
        small = kv_rank  # kv_a_layernorm
        if shape.q_lora_rank:
            # q_a_proj is a ReplicatedLinear; q_b_proj is column-parallel.
            linear += hidden * shape.q_lora_rank + shape.q_lora_rank * heads_rank * (nope + rope)
            small += shape.q_lora_rank  # q_a_layernorm
        else:
            linear += hidden * heads_rank * (nope + rope)
        linear += hidden * (
            kv_rank + rope
        )  # kv_a_proj_with_mqa: ReplicatedLinear, every rank holds all of it
        kv_b = kv_rank * heads_rank * (nope + v_dim)
        linear += kv_b + heads_rank * v_dim * hidden  # kv_b_proj and o_proj, both sharded
        return linear, small, kv_b
    head_dim = shape.head_dim
    kv_rank = kv_heads_per_gpu(shape, tp)
    q_width, kv_width = heads_rank * head_dim, kv_rank * head_dim
    linear = hidden * (q_width + 2 * kv_width) + q_width * hidden  # qkv_proj + o_proj
    small = (q_width + 2 * kv_width) if shape.attention_bias else 0
    if shape.qk_norm:
        small += 2 * head_dim  # q_norm, k_norm (replicated)
    return linear, small, 0


def _mlp_params_per_rank(shape: ModelShape, tp: int, moe_layer: bool) -> tuple[int, int]:
    """(linear, unquantized) parameters of one MLP/MoE block on one rank (experts sharded by TP, no EP)."""
    hidden = shape.hidden_size
    if not moe_layer:
        return 3 * hidden * shape.intermediate_size // tp, 0
    experts = shape.num_experts * 3 * hidden * shape.moe_intermediate_size // tp
    shared = 3 * hidden * shape.shared_expert_intermediate_size // tp
    router = hidden * shape.num_experts  # ReplicatedLinear gate, kept unquantized
    return experts + shared, router


def weight_breakdown_per_gpu(shape: ModelShape, tensor_parallel_size: int = 1) -> WeightBreakdown:
    """Parameters one rank holds, as vLLM shards them (see the module docstring for the rules)."""
    tp = tensor_parallel_size
    _check_tp(shape, tp)
    hidden = shape.hidden_size
    vocab_rows = padded_vocab_size(shape.vocab_size) // tp
    embedding = vocab_rows * hidden
    lm_head = 0 if shape.tie_word_embeddings else vocab_rows * hidden
    attn_linear, attn_small, absorbed = _attention_params_per_rank(shape, tp)
    layers = shape.num_hidden_layers
    linear = attn_linear * layers
    small = (attn_small + 2 * hidden) * layers + hidden  # + input/post-attention norms, final norm
    for i in range(layers):
        mlp_linear, mlp_small = _mlp_params_per_rank(shape, tp, shape.is_moe_layer(i))
        linear += mlp_linear
        small += mlp_small
    return WeightBreakdown(
        embedding_params=embedding,
        lm_head_params=lm_head,
        linear_params=linear,
        unquantized_params=small,
        mla_absorbed_params=absorbed * layers,
        rotary_cache_elements=shape.max_position_embeddings * shape.rotary_dim,
    )


def weight_bytes_per_gpu(
    shape: ModelShape,
    tensor_parallel_size: int = 1,
    dtype: str = "auto",
    quantization: str | None = None,
    accelerator: Accelerator = "gpu",
) -> int:
    """Bytes of weights one rank loads ("Model loading took X GiB" in vLLM's log)."""
    model_dtype = resolve_model_dtype(shape, dtype, accelerator)
    act = dtype_bytes(model_dtype)
    scheme = resolve_quantization(shape, quantization, model_dtype)
    b = weight_breakdown_per_gpu(shape, tensor_parallel_size)
    plain = b.embedding_params + b.lm_head_params + b.unquantized_params + b.mla_absorbed_params
    return int((plain + b.rotary_cache_elements) * act + b.linear_params * scheme.bytes_per_weight)


def parameter_count(shape: ModelShape) -> int:
    """Total parameters as model cards count them (unpadded vocab, lm_head once unless tied, all experts)."""
    b = weight_breakdown_per_gpu(shape, 1)
    padding_rows = padded_vocab_size(shape.vocab_size) - shape.vocab_size
    lm_head_rows = 0 if shape.tie_word_embeddings else padding_rows
    return b.total_params - (padding_rows + lm_head_rows) * shape.hidden_size


def active_parameter_count(shape: ModelShape) -> int:
    """Parameters one token's forward pass touches: for MoE only top-k experts (plus shared ones) count.

    Drives compute (FLOPs) in the latency model; memory always counts every expert.
    """
    total = parameter_count(shape)
    if not shape.is_moe:
        return total
    per_expert = 3 * shape.hidden_size * shape.moe_intermediate_size
    idle_experts = max(0, shape.num_experts - shape.num_experts_per_tok)
    return total - shape.num_moe_layers * idle_experts * per_expert


# -------------------------------------------------------------------------------------------- KV cache
def kv_bytes_per_token_per_layer(
    shape: ModelShape,
    tensor_parallel_size: int = 1,
    kv_cache_dtype: str = "auto",
    model_dtype: str = "bfloat16",
) -> int:
    """KV bytes one token takes in one attention layer on one rank.

    Standard attention: K and V, ``2 x kv_heads_per_gpu x head_dim x bytes``. MLA: one latent of
    ``kv_lora_rank + qk_rope_head_dim`` per token, the same on every rank (not split by TP).
    """
    kv_bytes = kv_cache_dtype_bytes(kv_cache_dtype, model_dtype)
    if shape.is_mla:
        assert shape.kv_lora_rank is not None
        return int((shape.kv_lora_rank + shape.qk_rope_head_dim) * kv_bytes)
    return int(2 * kv_heads_per_gpu(shape, tensor_parallel_size) * shape.head_dim * kv_bytes)


def kv_bytes_per_token_per_gpu(
    shape: ModelShape,
    tensor_parallel_size: int = 1,
    kv_cache_dtype: str = "auto",
    dtype: str = "auto",
    accelerator: Accelerator = "gpu",
) -> int:
    """KV bytes one token takes across all layers on one rank (Qwen3-8B bf16, TP=1: 147,456 = 144 KiB)."""
    model_dtype = resolve_model_dtype(shape, dtype, accelerator)
    per_layer = kv_bytes_per_token_per_layer(shape, tensor_parallel_size, kv_cache_dtype, model_dtype)
    return per_layer * shape.num_hidden_layers


# ------------------------------------------------------------------------------------------ speculation
@dataclass(frozen=True)
class SpeculativeSpec:
    """Speculative decoding as the memory and latency models see it.

    ``draft`` is the draft checkpoint's shape (draft_model, dflash, dspark; an EAGLE head's own config when
    known). ngram drafts from the prompt and costs no GPU memory.
    """

    method: str
    num_speculative_tokens: int
    draft: ModelShape | None = None
    # Assumed probability that each drafted token is accepted (latency model only).
    acceptance_rate: float = 0.6


_HEAD_METHODS = ("eagle", "eagle3")


def _eagle_head_params_per_rank(
    target: ModelShape, tp: int, method: str, head: ModelShape | None
) -> tuple[int, int]:
    """(weights, decoder layers) of an EAGLE head when its checkpoint is unknown or given.

    An EAGLE head is one (EAGLE-3: one, sometimes more) decoder layer of the target's width plus an ``fc``
    that fuses hidden states (EAGLE: 2H x H; EAGLE-3: 3H x H). vLLM shares the target's embedding and, for
    EAGLE-1/2, its lm_head; EAGLE-3 heads carry their own lm_head over a smaller draft vocabulary
    (32,000 is usual).
    """
    shape = head or target
    hidden = shape.hidden_size
    layers = head.num_hidden_layers if head else 1
    attn, attn_small, _ = _attention_params_per_rank(shape, tp)
    mlp = 3 * hidden * shape.intermediate_size // tp  # heads are dense even for MoE targets
    fc = (3 if method == "eagle3" else 2) * hidden * hidden
    lm_head = 0
    if method == "eagle3":
        draft_vocab = 32_000 if head is None else head.vocab_size
        lm_head = padded_vocab_size(draft_vocab) // tp * hidden
    return layers * (attn + attn_small + mlp + 4 * hidden) + fc + lm_head, layers


def draft_weight_bytes_per_gpu(
    target: ModelShape,
    spec: SpeculativeSpec | None,
    tensor_parallel_size: int = 1,
    dtype: str = "auto",
    accelerator: Accelerator = "gpu",
) -> int:
    """Extra weight bytes per rank that speculative decoding loads (the drafter runs at the target's TP)."""
    if spec is None or spec.method == "ngram":
        return 0
    act = dtype_bytes(resolve_model_dtype(target, dtype, accelerator))
    tp = tensor_parallel_size
    if spec.method in _HEAD_METHODS:
        params, _ = _eagle_head_params_per_rank(target, tp, spec.method, spec.draft)
        return int(params * act)
    if spec.method == "mtp" and spec.draft is None:
        # The checkpoint's own next-token-prediction layers: one decoder layer each (MoE where the model is),
        # plus eh_proj (2H x H) and two norms; embedding and lm_head are shared with the target.
        n = max(1, target.num_nextn_predict_layers)
        attn, attn_small, absorbed = _attention_params_per_rank(target, tp)
        mlp, router = _mlp_params_per_rank(target, tp, moe_layer=target.is_moe)
        per_layer = attn + attn_small + absorbed + mlp + router + 2 * target.hidden_size * target.hidden_size
        return int(n * per_layer * act)
    if spec.draft is None:
        raise ValueError(f"speculative method {spec.method!r} needs the draft model's shape (config.json)")
    tp_draft = tp if spec.draft.num_attention_heads % tp == 0 else 1
    return weight_bytes_per_gpu(spec.draft, tp_draft, dtype, None, accelerator)


def draft_kv_bytes_per_token_per_gpu(
    target: ModelShape,
    spec: SpeculativeSpec | None,
    tensor_parallel_size: int = 1,
    kv_cache_dtype: str = "auto",
    dtype: str = "auto",
    accelerator: Accelerator = "gpu",
) -> int:
    """KV bytes per token the drafter's attention layers add. vLLM puts them in the same block pool as the
    target's layers, so every KV block holds both and the token capacity shrinks accordingly."""
    if spec is None or spec.method == "ngram":
        return 0
    tp = tensor_parallel_size
    model_dtype = resolve_model_dtype(target, dtype, accelerator)
    if spec.method in _HEAD_METHODS:
        shape = spec.draft or target
        _, layers = _eagle_head_params_per_rank(target, tp, spec.method, spec.draft)
        return layers * kv_bytes_per_token_per_layer(shape, tp, kv_cache_dtype, model_dtype)
    if spec.method == "mtp" and spec.draft is None:
        n = max(1, target.num_nextn_predict_layers)
        return n * kv_bytes_per_token_per_layer(target, tp, kv_cache_dtype, model_dtype)
    if spec.draft is None:
        raise ValueError(f"speculative method {spec.method!r} needs the draft model's shape (config.json)")
    tp_draft = tp if spec.draft.num_attention_heads % tp == 0 else 1
    return kv_bytes_per_token_per_gpu(spec.draft, tp_draft, kv_cache_dtype, dtype, accelerator)


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
def blocks_for_tokens(tokens: int, block_size: int) -> int:
    return cdiv(tokens, block_size)


def vllm_reported_kv_tokens(num_blocks: int, block_size: int, max_model_len: int) -> int:
    """The "GPU KV cache size: N tokens" figure: ``int(num_blocks / cdiv(L, block) x L)``
    (``get_kv_cache_capacity``); equal to num_blocks x block_size when L is a multiple of the block."""
    if num_blocks <= 0:
        return 0
    return int(num_blocks / cdiv(max_model_len, block_size) * max_model_len)


def max_concurrency_for_length(
    num_blocks: int, block_size: int, request_tokens: int, prefix_reuse_fraction: float = 0.0
) -> float:
    """Requests of ``request_tokens`` tokens that fit at once.

    With prefix caching, the first ``prefix_reuse_fraction`` of every request is one shared prefix stored
    once; only whole blocks are shared (a partly filled block is private), so the shared part rounds down
    to whole blocks.
    With no reuse this is vLLM's "Maximum concurrency for L tokens per request".
    """
    if num_blocks <= 0 or request_tokens <= 0:
        return 0.0
    per_request = cdiv(request_tokens, block_size)
    shared = int(request_tokens * max(0.0, min(prefix_reuse_fraction, 1.0))) // block_size
    private = per_request - shared
    if private <= 0:  # everything shared: the cache holds the prefix once and any number of readers
        return math.inf if num_blocks >= shared else 0.0
    return max(0.0, (num_blocks - shared) / private)


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
    notes: tuple[str, ...] = field(default=())

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

    @property
    def non_kv_bytes(self) -> int:
        graphs = self.cudagraph_bytes if self.cudagraph_subtracted else 0
        return (
            self.weights_bytes
            + self.draft_weights_bytes
            + self.activation_peak_bytes
            + self.non_torch_bytes
            + graphs
        )

    def concurrency_for(self, request_tokens: int, prefix_reuse_fraction: float = 0.0) -> float:
        return max_concurrency_for_length(
            self.num_blocks, self.block_size, request_tokens, prefix_reuse_fraction
        )

    def largest_max_model_len(self) -> int:
        return largest_max_model_len(self.num_blocks, self.block_size)

    def gib(self, name: str) -> float:
        return bytes_to_gib(float(getattr(self, name)))

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["quantization"] = asdict(self.quantization)
        d["notes"] = list(self.notes)
        d.update(
            kv_bytes_per_token=self.kv_bytes_per_token,
            kv_cache_tokens=self.kv_cache_tokens,
            max_concurrency=round(self.max_concurrency, 2),
            weights_gib=round(self.gib("weights_bytes"), 3),
            kv_cache_gib=round(bytes_to_gib(self.kv_cache_bytes), 3),
        )
        return d


def estimate_memory(inputs: MemoryInputs) -> MemoryEstimate:
    """One replica's memory budget per rank, with vLLM's arithmetic (see the module docstring)."""
    shape, tp, accel = inputs.model, inputs.tensor_parallel_size, inputs.accelerator
    model_dtype = resolve_model_dtype(shape, inputs.dtype, accel)
    scheme = resolve_quantization(shape, inputs.quantization, model_dtype)
    block = inputs.block_size or (CPU_BLOCK_SIZE_TOKENS if accel == "cpu" else GPU_BLOCK_SIZE_TOKENS)
    max_len = inputs.max_model_len or shape.max_position_embeddings
    budget_tokens = inputs.max_num_batched_tokens or default_max_num_batched_tokens(
        inputs.gpu_memory_bytes, inputs.gpu_name, accel, tp, max_len, inputs.enable_chunked_prefill
    )
    spec = inputs.speculative
    num_spec = spec.num_speculative_tokens if spec else 0
    notes: list[str] = []

    weights = weight_bytes_per_gpu(shape, tp, model_dtype, inputs.quantization, accel)
    draft_weights = draft_weight_bytes_per_gpu(shape, spec, tp, model_dtype, accel)
    target_kv = kv_bytes_per_token_per_gpu(shape, tp, inputs.kv_cache_dtype, model_dtype, accel)
    draft_kv = draft_kv_bytes_per_token_per_gpu(shape, spec, tp, inputs.kv_cache_dtype, model_dtype, accel)
    activation = activation_peak_bytes(shape, budget_tokens, tp, model_dtype, accel)
    if spec is not None and spec.draft is not None and spec.method not in _HEAD_METHODS:
        # The drafter's own profile forward runs after the target's; the peak is the larger of the two.
        activation = max(activation, activation_peak_bytes(spec.draft, budget_tokens, 1, model_dtype, accel))
    bytes_per_block = (target_kv + draft_kv) * block

    if accel == "cpu":
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
        requested = available
        graphs, non_torch, headroom = 0, 0, 0
        subtracted = False
    else:
        if inputs.gpu_memory_bytes <= 0:
            raise ValueError("gpu_memory_bytes must be > 0 on the GPU accelerator (use the GPU catalogue)")
        requested = requested_memory_bytes(inputs.gpu_memory_bytes, inputs.gpu_memory_utilization)
        non_torch = non_torch_bytes(tp)
        graphs = cudagraph_bytes(shape, inputs.max_num_seqs, budget_tokens, num_spec, inputs.enforce_eager)
        subtracted = (inputs.subtract_cudagraph_estimate or uses_v1_model_runner(shape)) and graphs > 0
        available = (
            requested - weights - draft_weights - activation - non_torch - (graphs if subtracted else 0)
        )
        outside_budget = inputs.gpu_memory_bytes - requested
        headroom = outside_budget - CUDA_CONTEXT_BYTES - (0 if subtracted else graphs)
        if inputs.kv_cache_memory_bytes is not None:
            # vLLM still runs the profile forward, then takes the given size as the KV budget, whatever
            # gpu_memory_utilization says; the graphs are captured afterwards in what is left.
            available = int(inputs.kv_cache_memory_bytes)
            used = weights + draft_weights + activation + non_torch + available
            headroom = inputs.gpu_memory_bytes - used - CUDA_CONTEXT_BYTES - graphs
    num_blocks = available // bytes_per_block if available > 0 else 0
    return MemoryEstimate(
        tensor_parallel_size=tp,
        accelerator=accel,
        model_dtype=model_dtype,
        quantization=scheme,
        block_size=block,
        max_model_len=max_len,
        max_num_seqs=inputs.max_num_seqs,
        max_num_batched_tokens=budget_tokens,
        gpu_memory_bytes=inputs.gpu_memory_bytes,
        gpu_memory_utilization=inputs.gpu_memory_utilization,
        requested_bytes=requested,
        weights_bytes=weights,
        draft_weights_bytes=draft_weights,
        activation_peak_bytes=activation,
        non_torch_bytes=non_torch,
        cudagraph_bytes=graphs,
        cudagraph_subtracted=subtracted,
        kv_cache_available_bytes=available,
        target_kv_bytes_per_token=target_kv,
        draft_kv_bytes_per_token=draft_kv,
        num_blocks=num_blocks,
        headroom_after_graphs_bytes=headroom,
        notes=tuple(notes),
    )
