"""The shape of a model, read from its HuggingFace ``config.json``: what the memory model needs, nothing more.

One source of truth per fact: every number here comes from the checkpoint's own config (or, for the built-in
catalogue, a verbatim copy of it). Field names follow HuggingFace; where families disagree (``num_experts``
vs ``num_local_experts`` vs ``n_routed_experts``) the shape stores one canonical name and says which keys it
reads. Multimodal configs that nest the language model under ``text_config`` are flattened.

Pure: imports neither ray, vllm nor torch.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["ModelShape", "ModelShapeError"]


class ModelShapeError(ValueError):
    """A config.json lacks a field the memory model needs, or holds an impossible value."""


def _first(d: Mapping[str, Any], *keys: str, default: Any = None) -> Any:
    """The first of ``keys`` in ``d`` with a non-null value (families spell the same fact differently)."""
    for key in keys:
        value = d.get(key)
        if value is not None:
            return value
    return default


def _flatten_text_config(d: Mapping[str, Any]) -> dict[str, Any]:
    """Language-model fields of a multimodal config live under text_config (or llm_config); lift them up.

    The outer architectures/model_type name the checkpoint as vLLM loads it, so they win where both exist;
    shape fields come from the nested config.
    """
    nested = _first(d, "text_config", "llm_config", "language_config")
    if not isinstance(nested, Mapping):
        return dict(d)
    merged = dict(d)
    for key, value in nested.items():
        if key in ("architectures", "model_type") and merged.get(key):
            continue
        merged[key] = value
    return merged


@dataclass(frozen=True)
class ModelShape:
    """Architecture numbers of one decoder-only transformer, as vLLM sees them.

    Build it with :meth:`from_hf_config` (a config.json dict) or :meth:`from_dir` (a checkpoint directory);
    the catalogue (:mod:`serve_app.planning.catalogue`) holds config.json dicts of common models.
    """

    name: str
    architectures: tuple[str, ...]
    model_type: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    intermediate_size: int
    tie_word_embeddings: bool
    torch_dtype: str
    max_position_embeddings: int
    attention_bias: bool = False
    # Qwen3-style per-head RMSNorm on q and k (two vectors of head_dim per layer).
    qk_norm: bool = False
    # Fraction of head_dim that is rotated (partial rotary, e.g. some GLM/Phi models); sizes vLLM's cos/sin
    # cache.
    partial_rotary_factor: float = 1.0
    sliding_window: int | None = None
    # --- mixture of experts (0 experts = dense) ---
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    # Sum of all shared experts' intermediate sizes (DeepSeek: n_shared_experts * moe_intermediate_size;
    # Qwen2-MoE: shared_expert_intermediate_size).
    shared_expert_intermediate_size: int = 0
    # DeepSeek: the first k layers are dense MLPs.
    first_k_dense_replace: int = 0
    # Every n-th layer is MoE (Qwen-MoE decoder_sparse_step, DeepSeek moe_layer_freq).
    moe_layer_freq: int = 1
    # Qwen-MoE layers forced dense.
    mlp_only_layers: tuple[int, ...] = ()
    # --- multi-head latent attention (DeepSeek-V2/V3); kv_lora_rank None = ordinary attention ---
    kv_lora_rank: int | None = None
    q_lora_rank: int | None = None
    qk_rope_head_dim: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    # Multi-token-prediction layers shipped in the checkpoint (DeepSeek-V3 num_nextn_predict_layers).
    num_nextn_predict_layers: int = 0
    quantization_config: Mapping[str, Any] | None = field(default=None, compare=False)

    # ------------------------------------------------------------------ derived facts
    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank is not None

    def is_moe_layer(self, layer_index: int) -> bool:
        """Whether decoder layer ``layer_index`` holds experts, by the family's own rule."""
        if not self.is_moe or layer_index < self.first_k_dense_replace or layer_index in self.mlp_only_layers:
            return False
        # Qwen-MoE: (i + 1) % decoder_sparse_step == 0; DeepSeek: i % moe_layer_freq == 0 past the dense
        # layers. Both mean "every layer" at frequency 1, which is what the catalogue models use.
        if self.moe_layer_freq <= 1:
            return True
        return (layer_index + 1) % self.moe_layer_freq == 0

    @property
    def num_moe_layers(self) -> int:
        return sum(1 for i in range(self.num_hidden_layers) if self.is_moe_layer(i))

    @property
    def num_dense_layers(self) -> int:
        return self.num_hidden_layers - self.num_moe_layers

    @property
    def rotary_dim(self) -> int:
        """Width of vLLM's cos/sin cache rows (MLA rotates only qk_rope_head_dim)."""
        if self.is_mla:
            return self.qk_rope_head_dim
        return int(self.head_dim * self.partial_rotary_factor)

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any], name: str | None = None) -> ModelShape:
        """Parse a HuggingFace config.json dict. Raises :class:`ModelShapeError` naming the missing key."""
        d = _flatten_text_config(config)
        label = name or str(d.get("_name_or_path") or d.get("model_type") or "model")
        fields = _attention_fields(d, label)
        fields.update(_mlp_fields(d, fields["hidden_size"]))
        fields.update(_mla_fields(d, fields["head_dim"]))
        fields.update(_checkpoint_fields(d))
        return cls(name=label, **fields)

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelShape:
        """Read ``<path>/config.json`` (and an old-style ``quantize_config.json`` of GPTQ checkpoints)."""
        root = Path(path)
        config_path = root / "config.json"
        if not config_path.is_file():
            raise ModelShapeError(
                f"{root}: no config.json there; point at a HuggingFace checkpoint directory"
            )
        try:
            config = json.loads(config_path.read_text())
        except json.JSONDecodeError as exc:
            raise ModelShapeError(f"{config_path}: not valid JSON ({exc})") from exc
        quant_path = root / "quantize_config.json"
        if "quantization_config" not in config and quant_path.is_file():
            legacy = json.loads(quant_path.read_text())
            legacy.setdefault("quant_method", "gptq")
            config["quantization_config"] = legacy
        return cls.from_hf_config(config, name=root.name)


# ------------------------------------------------------------------ config.json readers
def _need(d: Mapping[str, Any], label: str, *keys: str) -> Any:
    value = _first(d, *keys)
    if value is None:
        raise ModelShapeError(
            f"{label}: config.json has none of {', '.join(repr(k) for k in keys)}; the memory model "
            "cannot size this model without it"
        )
    return value


def _attention_fields(d: Mapping[str, Any], label: str) -> dict[str, Any]:
    """Width, depth, heads and vocabulary: the fields every decoder has."""
    hidden = int(_need(d, label, "hidden_size", "d_model", "n_embd"))
    layers = int(_need(d, label, "num_hidden_layers", "n_layer", "num_layers"))
    heads = int(_need(d, label, "num_attention_heads", "n_head", "num_heads"))
    # Older configs (Llama-1/2-7B, Mistral-v0.1 style MHA) omit num_key_value_heads: MHA means kv = heads.
    kv_heads = int(_first(d, "num_key_value_heads", "num_kv_heads", "n_head_kv", default=heads))
    if hidden <= 0 or layers <= 0 or heads <= 0 or kv_heads <= 0:
        raise ModelShapeError(
            f"{label}: hidden_size ({hidden}), num_hidden_layers ({layers}), num_attention_heads "
            f"({heads}) and num_key_value_heads ({kv_heads}) must all be positive"
        )
    model_type = str(d.get("model_type") or "")
    return dict(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=int(_first(d, "head_dim", default=0) or hidden // heads),
        vocab_size=int(_need(d, label, "vocab_size", "padded_vocab_size")),
        model_type=model_type,
        # Qwen2 carries a qkv bias without saying so in config.json; others declare attention_bias.
        attention_bias=bool(_first(d, "attention_bias", "qkv_bias", default=model_type == "qwen2")),
        qk_norm=model_type in ("qwen3", "qwen3_moe"),
    )


def _mlp_fields(d: Mapping[str, Any], hidden: int) -> dict[str, Any]:
    """The MLP, and the experts of MoE models: three spellings of the expert count across families."""
    num_experts = int(_first(d, "num_experts", "num_local_experts", "n_routed_experts", default=0) or 0)
    moe_inter = int(_first(d, "moe_intermediate_size", default=0) or 0)
    intermediate = int(_first(d, "intermediate_size", "ffn_dim", "n_inner", default=0) or 4 * hidden)
    if num_experts and not moe_inter:
        # Mixtral stores the expert width in intermediate_size.
        moe_inter = intermediate
    shared_inter = int(_first(d, "shared_expert_intermediate_size", default=0) or 0)
    n_shared = int(_first(d, "n_shared_experts", "num_shared_experts", default=0) or 0)
    if n_shared and not shared_inter:
        shared_inter = n_shared * moe_inter
    return dict(
        intermediate_size=intermediate,
        num_experts=num_experts,
        num_experts_per_tok=int(_first(d, "num_experts_per_tok", "moe_topk", default=0) or 0),
        moe_intermediate_size=moe_inter,
        shared_expert_intermediate_size=shared_inter,
        first_k_dense_replace=int(_first(d, "first_k_dense_replace", default=0) or 0),
        moe_layer_freq=int(_first(d, "decoder_sparse_step", "moe_layer_freq", default=1) or 1),
        mlp_only_layers=tuple(int(i) for i in (d.get("mlp_only_layers") or ())),
    )


def _mla_fields(d: Mapping[str, Any], head_dim: int) -> dict[str, Any]:
    """Multi-head latent attention (DeepSeek-V2/V3); nothing for ordinary attention."""
    kv_lora_rank = _first(d, "kv_lora_rank")
    if kv_lora_rank is None:
        return {}
    # MLA: the head width that matters is qk_nope + qk_rope (vLLM's q/k), v has its own width.
    qk_nope = int(_first(d, "qk_nope_head_dim", default=0) or 0)
    qk_rope = int(_first(d, "qk_rope_head_dim", default=0) or 0)
    return dict(
        head_dim=qk_nope + qk_rope or head_dim,
        kv_lora_rank=int(kv_lora_rank),
        q_lora_rank=int(d["q_lora_rank"]) if d.get("q_lora_rank") else None,
        qk_rope_head_dim=qk_rope,
        qk_nope_head_dim=qk_nope,
        v_head_dim=int(_first(d, "v_head_dim", default=0) or 0),
    )


def _checkpoint_fields(d: Mapping[str, Any]) -> dict[str, Any]:
    """Dtype, positions, rotary and sliding window, quantization, architecture names."""
    quant = _first(d, "quantization_config", "compression_config")
    rope_scaling = d.get("rope_scaling") or {}
    partial_rotary = float(_first(d, "partial_rotary_factor", default=1.0) or 1.0)
    if isinstance(rope_scaling, Mapping) and rope_scaling.get("partial_rotary_factor"):
        partial_rotary = float(rope_scaling["partial_rotary_factor"])
    sliding = d.get("sliding_window") if d.get("use_sliding_window", True) else None
    max_pos = _first(d, "max_position_embeddings", "n_positions", "max_sequence_length", default=2048)
    return dict(
        architectures=tuple(str(a) for a in (d.get("architectures") or ())),
        tie_word_embeddings=bool(_first(d, "tie_word_embeddings", default=False)),
        torch_dtype=str(_first(d, "torch_dtype", "dtype", default="bfloat16")).replace("torch.", ""),
        max_position_embeddings=int(max_pos),
        partial_rotary_factor=partial_rotary,
        sliding_window=int(sliding) if sliding else None,
        num_nextn_predict_layers=int(_first(d, "num_nextn_predict_layers", default=0) or 0),
        quantization_config=dict(quant) if isinstance(quant, Mapping) else None,
    )
