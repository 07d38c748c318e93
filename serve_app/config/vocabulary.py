"""headroom's vocabulary: every closed set of words and every unit, defined once.

The config schema, the planner, the memory model, model resolution and the engine flags all speak these
words; nothing else spells them out. Pure: no imports beyond the standard library.
"""

from __future__ import annotations

import typing
from typing import Literal

# --- units ----------------------------------------------------------------------------------------------
GIB_BYTES = 1 << 30
"""Bytes in one GiB: vLLM and torch report memory in GiB, and so does every headroom message."""

# --- model and engine -----------------------------------------------------------------------------------
Accelerator = Literal["gpu", "cpu"]
"""vLLM's CUDA backend or its CPU backend (the embedded default, CI)."""

ModelDtype = Literal["auto", "bfloat16", "float16", "float32"]
KVCacheDtype = Literal["auto", "fp8", "fp8_e4m3", "fp8_e5m2"]
Quantization = Literal[
    "fp8", "awq", "gptq", "awq_marlin", "gptq_marlin", "compressed-tensors", "bitsandbytes"
]
QUANTIZATION_METHODS: tuple[str, ...] = typing.get_args(Quantization)

TensorParallelSize = Literal[1, 2, 4, 8]
TENSOR_PARALLEL_SIZES: tuple[int, ...] = typing.get_args(TensorParallelSize)
"""The sizes the planner considers within one node."""

# --- speculative decoding -------------------------------------------------------------------------------
SpeculativeMethod = Literal["ngram", "draft_model", "eagle", "eagle3", "mtp", "dflash", "dspark"]
SPECULATIVE_METHODS: tuple[str, ...] = typing.get_args(SpeculativeMethod)

DRAFT_CHECKPOINT_METHODS: tuple[str, ...] = ("draft_model", "eagle", "eagle3", "dflash", "dspark")
"""Methods that run a separate draft checkpoint, so ``speculative.draft_model`` is required."""
DRAFT_HEAD_METHODS: tuple[str, ...] = ("eagle", "eagle3")
"""Drafters that are a head on the target's hidden states: sized as a head, sharing its embedding."""
DRAFT_MODEL_FORWARD_METHODS: tuple[str, ...] = ("draft_model", "dflash", "dspark")
"""Drafters that are whole models of their own: each draft pass is a full forward of that model."""
SEPARATE_TOKENIZER_METHODS: tuple[str, ...] = ("draft_model",)
"""Drafters that tokenize for themselves: tokenizer and architecture family must match the target's."""
PARALLEL_DRAFTING_METHODS: tuple[str, ...] = ("draft_model", "eagle", "eagle3", "dflash", "dspark")
"""Methods that accept ``parallel_drafting`` (vLLM: EAGLE and draft-model methods)."""
ALWAYS_PARALLEL_METHODS: tuple[str, ...] = ("dflash", "dspark")
"""Methods that always propose every draft token in one pass (vLLM turns parallel_drafting on for them)."""


def drafts_in_one_pass(method: str, parallel_drafting: bool) -> bool:
    """Whether all draft tokens of a step come from one pass of the drafter."""
    return method in ALWAYS_PARALLEL_METHODS or (parallel_drafting and method in PARALLEL_DRAFTING_METHODS)


# --- model sources --------------------------------------------------------------------------------------
EMBEDDED_PREFIX = "embedded:"
"""``model.source`` prefix of the models headroom generates itself (``embedded:tiny-qwen3``)."""


def is_embedded(source: str) -> bool:
    return source.startswith(EMBEDDED_PREFIX)


# --- names ----------------------------------------------------------------------------------------------
SERVED_NAME_PATTERN = r"^[A-Za-z0-9._/:-]{1,128}$"
SERVED_NAME_HINT = "1 to 128 characters from letters, digits and . _ / : -"
APP_NAME_PATTERN = r"^[a-z0-9][a-z0-9-]{0,62}$"
"""A Serve application name that is a valid route prefix too (also the ladder's --app-name)."""
APP_NAME_HINT = "1 to 63 characters from lowercase letters, digits and '-', not starting with '-'"

# --- network security -----------------------------------------------------------------------------------
MetricsAccess = Literal["open", "api_key"]
"""Who may read a replica's /metrics: anyone (Prometheus without credentials) or API-key holders only."""

OptionalRouteGroup = Literal["tokenize", "docs"]
"""Routes of vLLM's app a config may open beside the OpenAI ones: /tokenize + /detokenize, and the
OpenAPI document with its pages (/openapi.json, /docs, /redoc)."""
OPTIONAL_ROUTE_GROUPS: tuple[str, ...] = typing.get_args(OptionalRouteGroup)

OverloadStatus = Literal[429, 503]
"""The status of a request refused because its replica's queue is full (both carry Retry-After)."""

ENV_VAR_NAME_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]{0,127}$"
ENV_VAR_NAME_HINT = "the NAME of an environment variable: letters, digits and '_', not starting with a digit"
