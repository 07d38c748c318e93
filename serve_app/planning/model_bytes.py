"""What a model takes on one tensor-parallel rank, per parameter and per token: weights, KV bytes per token,
and the drafter's share of both.

Weights: parameter counts from config.json, laid out per tensor-parallel rank as vLLM's layers shard them
(``QKVParallelLinear`` replicates KV heads when tp > num_key_value_heads; norms, MoE routers and MLA's
``kv_a_proj_with_mqa`` are replicated; the vocabulary is padded to a multiple of 64 and split), times the
bytes of the dtype or quantization scheme. Embeddings, lm_head, norms and routers stay unquantized. MoE
counts every expert (all are resident; the seed: "MoE weights by TOTAL params"). Plus vLLM's rotary cos/sin
cache and, for MLA, the decode-time ``W_UK_T``/``W_UV`` copies of ``kv_b_proj``.

The memory model (:mod:`serve_app.planning.memory`) adds the runtime buffers and turns what is left into KV
blocks; the latency model reads the same counts. Pure: imports neither ray, vllm nor torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from serve_app.config.vocabulary import (
    DRAFT_HEAD_METHODS,
    GIB_BYTES,
    QUANTIZATION_METHODS,
    Accelerator,
)
from serve_app.planning.shape import ModelShape

__all__ = [
    "DEFAULT_VOCAB_PADDING_SIZE",
    "QuantScheme",
    "SpeculativeSpec",
    "WeightBreakdown",
    "active_parameter_count",
    "bytes_to_gib",
    "cdiv",
    "draft_kv_bytes_per_token_per_gpu",
    "draft_weight_bytes_per_gpu",
    "dtype_bytes",
    "kv_bytes_per_token_per_gpu",
    "kv_bytes_per_token_per_layer",
    "kv_cache_dtype_bytes",
    "kv_heads_per_gpu",
    "padded_vocab_size",
    "parameter_count",
    "resolve_model_dtype",
    "resolve_quantization",
    "weight_breakdown_per_gpu",
    "weight_bytes_per_gpu",
]

# vllm/model_executor/layers/vocab_parallel_embedding.py: DEFAULT_VOCAB_PADDING_SIZE = 64.
DEFAULT_VOCAB_PADDING_SIZE = 64

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
        f"quantization {method!r} is not modelled; known: {', '.join(QUANTIZATION_METHODS)} (or null for the "
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
    # vLLM's parallel_drafting: all draft tokens of a step from one drafter pass (latency model only;
    # vocabulary.drafts_in_one_pass decides it together with the method).
    parallel_drafting: bool = False


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
    if spec.method in DRAFT_HEAD_METHODS:
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
    if spec.method in DRAFT_HEAD_METHODS:
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
