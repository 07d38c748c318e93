"""Built-in catalogue: config.json of common models, and the GPUs the planner knows.

Model entries are verbatim copies of each checkpoint's published ``config.json`` on the HuggingFace Hub
(``serve_app/planning/model_configs/<org>__<name>.json``), so planning works without downloading anything.
A local checkpoint directory is always read instead when the user gives one (see :meth:`ModelShape.from_dir`).

GPU entries hold what the memory model and the roofline latency model need. ``memory_bytes`` is the total
that ``torch.cuda.get_device_properties(0).total_memory`` reports (vLLM sizes ``gpu_memory_utilization``
against it), which is less than the marketing figure: the H200 value was measured in the lab; the others are
the totals seen in PyTorch's out-of-memory messages ("GPU 0 has a total capacity of 79.15 GiB") and vary by
about 0.1 GiB with driver and ECC settings. TFLOPs are dense (no sparsity) tensor-core figures from the
vendor datasheets; bandwidths are datasheet HBM/GDDR and GPU-to-GPU (NVLink, or PCIe Gen4 x16) figures.

Pure: imports neither ray, vllm nor torch.
"""

from __future__ import annotations

import copy
import difflib
import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from serve_app.config.vocabulary import EMBEDDED_PREFIX, GIB_BYTES
from serve_app.planning.shape import ModelShape

__all__ = [
    "GPUS",
    "EMBEDDED_MODELS",
    "CatalogueKeyError",
    "EmbeddedShape",
    "embedded_config",
    "embedded_name",
    "GpuSpec",
    "get",
    "gpu",
    "gpu_names",
    "names",
    "shape",
]

_CATALOGUE_DIR = Path(__file__).resolve().parent / "model_configs"


class CatalogueKeyError(KeyError):
    """A name that is not in the catalogue; the message lists what is, with the closest match first."""

    def __str__(self) -> str:  # KeyError would repr() the message and show it in quotes
        return str(self.args[0]) if self.args else ""


def _did_you_mean(wanted: str, known: list[str], kind: str) -> CatalogueKeyError:
    lowered = {k.lower(): k for k in known}
    close = difflib.get_close_matches(wanted.lower(), list(lowered), n=3, cutoff=0.5)
    hint = f" Did you mean {' or '.join(repr(lowered[c]) for c in close)}?" if close else ""
    return CatalogueKeyError(
        f"{kind} {wanted!r} is not in headroom's catalogue.{hint} Known: {', '.join(known)}. "
        + (
            "For another model, point model.source at a local checkpoint directory holding config.json."
            if kind == "model"
            else "For another GPU, give its memory as resources.gpu_memory_gib."
        )
    )


# ---------------------------------------------------------------------------------------------- models
@cache
def _model_files() -> dict[str, Path]:
    # File names encode "org/name" as "org__name" (a slash cannot appear in a file name).
    return {p.stem.replace("__", "/", 1): p for p in sorted(_CATALOGUE_DIR.glob("*.json"))}


def names() -> list[str]:
    """Catalogue model names, e.g. ``'Qwen/Qwen3-8B'``."""
    return list(_model_files())


def _resolve(name: str) -> str:
    files = _model_files()
    if name in files:
        return name
    # Accept any capitalisation, and the bare model name without its organisation when that is unique.
    by_lower = {k.lower(): k for k in files}
    if name.lower() in by_lower:
        return by_lower[name.lower()]
    suffix = [k for k in files if k.split("/", 1)[-1].lower() == name.lower()]
    if len(suffix) == 1:
        return suffix[0]
    raise _did_you_mean(name, list(files), "model")


@cache
def _load(resolved: str) -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(_model_files()[resolved].read_text())
    return loaded


def get(name: str) -> dict[str, Any]:
    """The published config.json dict of catalogue model ``name`` (a fresh copy the caller may change).

    Raises :class:`CatalogueKeyError` (a ``KeyError``) listing the known names and the closest match.
    """
    return copy.deepcopy(_load(_resolve(name)))


def shape(name: str) -> ModelShape:
    """The :class:`ModelShape` of catalogue model ``name``."""
    resolved = _resolve(name)
    return ModelShape.from_hf_config(_load(resolved), name=resolved)


# ------------------------------------------------------------------------------------- embedded models
@dataclass(frozen=True)
class EmbeddedShape:
    """The few numbers that make a Qwen3 model tiny. head_dim 32/64 are CPU-attention sizes vLLM supports."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    seed: int


# The models headroom generates itself (serve_app/models/embedded.py writes their files from these).
EMBEDDED_MODELS: dict[str, EmbeddedShape] = {
    "tiny-qwen3": EmbeddedShape(128, 384, 2, 4, 2, 32, seed=1),
    # The draft shares the tokenizer and the architecture family (the seeds' requirement for draft_model).
    "tiny-qwen3-draft": EmbeddedShape(64, 192, 1, 2, 1, 32, seed=2),
}
EMBEDDED_VOCAB_SIZE = 2048
EMBEDDED_MAX_POSITION_EMBEDDINGS = 4096


def embedded_name(source: str) -> str:
    """``tiny-qwen3`` for ``embedded:tiny-qwen3``; ValueError listing the embedded models otherwise."""
    name = source.removeprefix(EMBEDDED_PREFIX)
    if name not in EMBEDDED_MODELS:
        raise ValueError(
            f"unknown embedded model {source!r}; available: "
            + ", ".join(EMBEDDED_PREFIX + n for n in sorted(EMBEDDED_MODELS))
        )
    return name


def embedded_config(name: str) -> dict[str, Any]:
    """The shape fields of an embedded model's config.json (Qwen3Config keyword arguments)."""
    s = EMBEDDED_MODELS[name]
    return {
        "vocab_size": EMBEDDED_VOCAB_SIZE,
        "hidden_size": s.hidden_size,
        "intermediate_size": s.intermediate_size,
        "num_hidden_layers": s.num_hidden_layers,
        "num_attention_heads": s.num_attention_heads,
        "num_key_value_heads": s.num_key_value_heads,
        "head_dim": s.head_dim,
        "max_position_embeddings": EMBEDDED_MAX_POSITION_EMBEDDINGS,
        "tie_word_embeddings": True,
    }


def embedded_shape(source: str) -> ModelShape:
    """The :class:`ModelShape` of an embedded model, without generating its files."""
    name = embedded_name(source)
    config = {**embedded_config(name), "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]}
    return ModelShape.from_hf_config({**config, "torch_dtype": "bfloat16"}, name=name)


# ------------------------------------------------------------------------------------------------ GPUs
@dataclass(frozen=True)
class GpuSpec:
    """One GPU model: memory as torch reports it, and the throughput figures of the roofline latency model."""

    name: str
    memory_bytes: int
    bf16_dense_tflops: float
    hbm_bandwidth_gb_per_s: float
    # GPU-to-GPU bandwidth per direction that a tensor-parallel all-reduce can use (NVLink or PCIe).
    interconnect_gb_per_s: float
    # None where the GPU has no fp8 tensor cores (Ampere): fp8 weights then run as weight-only (Marlin)
    # kernels.
    fp8_dense_tflops: float | None = None
    # Latency of one small all-reduce (decode-sized), which dominates TP cost at small batch.
    allreduce_latency_us: float = 10.0

    @property
    def memory_gib(self) -> float:
        return self.memory_bytes / GIB_BYTES


def _gib(value: float) -> int:
    return int(round(value * GIB_BYTES))


GPUS: dict[str, GpuSpec] = {
    g.name: g
    for g in (
        # Measured: torch total_memory on the lab H200 (vLLM 0.26 run, 2026-11-29) = 150,109,880,320 bytes
        # (139.80 GiB; tests/data/memory_points/h200_qwen3_8b_bf16.json), with which tests/unit/test_memory.py
        # reproduces that point's KV-cache tokens.
        GpuSpec(
            "H200", 150_109_880_320, 989.0, 4800.0, 450.0, fp8_dense_tflops=1979.0, allreduce_latency_us=8.0
        ),
        GpuSpec(
            "H100-80GB", _gib(79.19), 989.0, 3350.0, 450.0, fp8_dense_tflops=1979.0, allreduce_latency_us=8.0
        ),
        GpuSpec("A100-80GB", _gib(79.15), 312.0, 2039.0, 300.0, allreduce_latency_us=10.0),
        GpuSpec("A100-40GB", _gib(39.49), 312.0, 1555.0, 300.0, allreduce_latency_us=10.0),
        # PCIe cards: all-reduce goes over PCIe Gen4 x16 (about 25 GB/s usable per direction).
        GpuSpec("L40S", _gib(44.39), 362.0, 864.0, 25.0, fp8_dense_tflops=733.0, allreduce_latency_us=25.0),
        GpuSpec("L4", _gib(22.05), 121.0, 300.0, 25.0, fp8_dense_tflops=242.0, allreduce_latency_us=25.0),
    )
}

_GPU_ALIASES = {
    "H200-141GB": "H200",
    "H100": "H100-80GB",
    "H100-SXM": "H100-80GB",
    "H100 80GB HBM3": "H100-80GB",  # as nvidia-smi names it
    "A100": "A100-80GB",
    "A100-SXM4-80GB": "A100-80GB",
    "A100-SXM4-40GB": "A100-40GB",
}


def gpu_names() -> list[str]:
    return list(GPUS)


def gpu(name: str) -> GpuSpec:
    """The :class:`GpuSpec` for ``name``: case-insensitive; an 'NVIDIA ' prefix and aliases ('H100') work."""
    key = name.strip()
    if key.upper().startswith("NVIDIA "):
        key = key[len("NVIDIA ") :]
    by_upper = {k.upper(): k for k in GPUS} | {a.upper(): t for a, t in _GPU_ALIASES.items()}
    if key.upper() in by_upper:
        return GPUS[by_upper[key.upper()]]
    raise _did_you_mean(name, list(GPUS), "GPU")
