"""headroom's configuration: typed, validated once at the edge, with errors that say how to fix them.

A deployment is described by YAML files merged in order (``configs/base.yaml`` then ``configs/<env>.yaml``)
and validated into a frozen :class:`HeadroomConfig`. Every problem found is reported at once, each naming
the dotted field path, the value given and the values accepted, e.g.::

    configs/prod.yaml: engine.max_num_seq: unknown key 'max_num_seq' (did you mean 'max_num_seqs'?); ...
    configs/prod.yaml: engine.gpu_memory_utilization: must be between 0.05 and 0.99, got 1.5

This module is pure: it imports neither ray, vllm nor torch, so the CLI, the planner and the unit tests
load it in milliseconds.
"""

from __future__ import annotations

import difflib
import json
import re
import types
import typing
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import annotated_types
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import PydanticCustomError

from serve_app.tiny_model import EMBEDDED_PREFIX

__all__ = [
    "DEFAULT_CONFIG_DIR",
    "DRAFT_MODEL_METHODS",
    "EMBEDDED_PREFIX",
    "PARALLEL_DRAFT_METHODS",
    "SPECULATIVE_METHODS",
    "AutoscalingSection",
    "ConfigError",
    "DeploymentSection",
    "EngineSection",
    "HeadroomConfig",
    "ModelSection",
    "ResourcesSection",
    "SLOSection",
    "SpeculativeSection",
    "available_envs",
    "deep_merge",
    "load_config",
    "load_env_config",
    "load_yaml",
    "parse_config",
]

DEFAULT_CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
"""The repository's ``configs/`` directory (``base.yaml`` plus one ``<env>.yaml`` per environment)."""


SpeculativeMethod = Literal["ngram", "draft_model", "eagle", "eagle3", "mtp", "dflash", "dspark"]
SPECULATIVE_METHODS: tuple[str, ...] = typing.get_args(SpeculativeMethod)
DRAFT_MODEL_METHODS: tuple[str, ...] = ("draft_model", "eagle", "eagle3", "dflash", "dspark")
"""Methods that run a separate draft checkpoint, so ``draft_model`` is required."""
PARALLEL_DRAFT_METHODS: tuple[str, ...] = ("draft_model", "eagle", "eagle3", "dflash", "dspark")
"""The parallel-draft family: methods that can propose all draft tokens in one draft pass."""

_ROOT = "(top level)"


# --------------------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------------------


class ConfigError(ValueError):
    """A configuration that cannot be used, with every problem found.

    ``problems`` is a list of ``(field path, message)`` pairs, the path dotted (``engine.speculative.method``)
    or a location in a file (``line 3, column 7``). ``str(err)`` prints one line per problem,
    ``"<source>: <path>: <message>"``, where source is the file that set the offending value when it is
    known, else the ``source`` given (the file names joined with ``+``, or ``config``).
    """

    def __init__(
        self,
        problems: Sequence[tuple[str, str]],
        source: str = "config",
        sources: Sequence[str] | None = None,
    ) -> None:
        self.problems: list[tuple[str, str]] = [(str(p), str(m)) for p, m in problems]
        self.source = source
        if sources is not None and len(sources) != len(self.problems):
            raise ValueError("sources must have one entry per problem")
        self.sources: list[str] = list(sources) if sources is not None else [source] * len(self.problems)
        super().__init__(self._render())

    def _render(self) -> str:
        return "\n".join(
            f"{src}: {path}: {msg}" for src, (path, msg) in zip(self.sources, self.problems, strict=True)
        )

    def __str__(self) -> str:
        return self._render()

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.problems, self.source, self.sources))


class _FieldProblems(ValueError):
    """Raised by validators: ``(path relative to the validated model, message)`` pairs, all reported."""

    def __init__(self, problems: list[tuple[str, str]]) -> None:
        self.problems = problems
        super().__init__("; ".join(f"{path}: {msg}" for path, msg in problems))


def _raise_if(problems: list[tuple[str, str]]) -> None:
    if problems:
        raise _FieldProblems(problems)


def _choices(values: Iterable[object]) -> str:
    return ", ".join(_show(v) for v in values)


# --------------------------------------------------------------------------------------------------------
# Sections
# --------------------------------------------------------------------------------------------------------

_SECTION_CONFIG = ConfigDict(extra="forbid", frozen=True, strict=True)

_SERVED_NAME_PATTERN = r"^[A-Za-z0-9._/:-]{1,128}$"
# Also the ladder's --app-name check: a Serve application name that is a valid route prefix too.
APP_NAME_PATTERN = r"^[a-z0-9][a-z0-9-]{0,62}$"
APP_NAME_HINT = "1 to 63 characters from lowercase letters, digits and '-', not starting with '-'"
_PATTERN_HINTS = {
    _SERVED_NAME_PATTERN: "1 to 128 characters from letters, digits and . _ / : -",
    APP_NAME_PATTERN: APP_NAME_HINT,
}


class ModelSection(BaseModel):
    """What to serve: the checkpoint, the name clients call it by, its dtype and context length."""

    model_config = _SECTION_CONFIG

    source: str = Field(
        ...,
        min_length=1,
        max_length=4096,
        description=(
            "The model to serve. 'embedded:tiny-qwen3' is a tiny Qwen3-shaped model headroom generates "
            "itself (CPU smoke runs, CI); a local directory containing config.json serves that checkpoint; "
            "any other string is a catalogue name such as 'Qwen/Qwen3-8B'."
        ),
    )
    served_name: str | None = Field(
        default=None,
        pattern=_SERVED_NAME_PATTERN,
        description=(
            "Name clients put in the OpenAI 'model' field. null derives it from source (its last path "
            "component, 'embedded:' stripped). Set it to keep a stable name across checkpoint changes."
        ),
    )
    tokenizer: str | None = Field(
        default=None,
        min_length=1,
        max_length=4096,
        description=(
            "Tokenizer name or local path. null uses the model's own tokenizer; change it only for "
            "checkpoints that ship without one."
        ),
    )
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        default="auto",
        description=(
            "Weight and activation dtype. 'auto' takes the checkpoint's torch_dtype (bfloat16 for most "
            "current models); float32 doubles weight memory and is only for CPU debugging."
        ),
    )
    quantization: (
        Literal["fp8", "awq", "gptq", "awq_marlin", "gptq_marlin", "compressed-tensors", "bitsandbytes"]
        | None
    ) = Field(
        default=None,
        description=(
            "Weight quantization method passed to vLLM. null serves the weights as stored (a checkpoint's "
            "own quantization_config still applies). 'fp8' roughly halves weight memory on Hopper GPUs."
        ),
    )
    max_model_len: int | None = Field(
        default=None,
        ge=16,
        le=1_048_576,
        description=(
            "Longest sequence (prompt + output) in tokens. null uses the model's max_position_embeddings. "
            "Lower it to admit more concurrent sequences into the same KV cache."
        ),
    )
    dummy_weights: bool = Field(
        default=False,
        description=(
            "Load random weights of the real shape (vLLM load_format='dummy') to measure memory, "
            "latency and throughput before the real weights are available. Outputs are gibberish."
        ),
    )


class SpeculativeSection(BaseModel):
    """Speculative decoding: a cheap drafter proposes tokens that the target model verifies in one step."""

    model_config = _SECTION_CONFIG

    method: SpeculativeMethod = Field(
        ...,
        description=(
            "How drafts are made: 'ngram' looks them up in the prompt (no extra model); 'draft_model' runs "
            "a small model of the same family; 'eagle'/'eagle3' run EAGLE draft heads; 'mtp' uses the "
            "model's own multi-token-prediction layers; 'dflash'/'dspark' run parallel-draft checkpoints."
        ),
    )
    num_speculative_tokens: int = Field(
        ...,
        ge=1,
        le=16,
        description=(
            "Draft tokens proposed per step. More pays off only while most are accepted; every rejected "
            "token is wasted compute that shows up in TTFT under load. 2-5 is typical."
        ),
    )
    prompt_lookup_min: int | None = Field(
        default=None,
        ge=1,
        le=16,
        description="ngram only: shortest n-gram matched in the prompt. null lets vLLM choose.",
    )
    prompt_lookup_max: int | None = Field(
        default=None,
        ge=1,
        le=16,
        description=(
            "ngram only: longest n-gram matched in the prompt; must be >= prompt_lookup_min. "
            "null lets vLLM choose."
        ),
    )
    draft_model: str | None = Field(
        default=None,
        min_length=1,
        max_length=4096,
        description=(
            "Draft checkpoint: a catalogue name, a local directory or 'embedded:tiny-qwen3-draft'. "
            f"Required for {', '.join(DRAFT_MODEL_METHODS)}; not allowed for ngram; optional for mtp "
            "(null = the target model's own MTP layers)."
        ),
    )
    parallel_drafting: bool = Field(
        default=False,
        description=(
            "Propose all draft tokens in one pass of the drafter instead of one pass per token. Only the "
            f"parallel-draft family supports it: {', '.join(PARALLEL_DRAFT_METHODS)}."
        ),
    )

    @model_validator(mode="after")
    def _check_method_fields(self) -> SpeculativeSection:
        problems: list[tuple[str, str]] = []
        method = self.method
        if method != "ngram":
            for name in ("prompt_lookup_min", "prompt_lookup_max"):
                value = getattr(self, name)
                if value is not None:
                    msg = f"{name} ({value}) is only used by method 'ngram', not by method {method!r}; "
                    problems.append((name, msg + "remove it or set method: ngram"))
        elif (
            self.prompt_lookup_min is not None
            and self.prompt_lookup_max is not None
            and self.prompt_lookup_max < self.prompt_lookup_min
        ):
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            msg = f"prompt_lookup_max ({hi}) must be >= prompt_lookup_min ({lo})"
            problems.append(("prompt_lookup_max", msg))
        if method in DRAFT_MODEL_METHODS and self.draft_model is None:
            msg = (
                f"draft_model is required when method is {method!r} (methods that run a draft checkpoint: "
                f"{_choices(DRAFT_MODEL_METHODS)}); set it to a catalogue name or a local directory"
            )
            problems.append(("draft_model", msg))
        if method == "ngram" and self.draft_model is not None:
            msg = (
                f"draft_model ({self.draft_model!r}) is not allowed when method is 'ngram', which drafts "
                "from the prompt itself; remove it (set it to null when a base file sets it) or use one of "
                f"{_choices(DRAFT_MODEL_METHODS)}"
            )
            problems.append(("draft_model", msg))
        if self.parallel_drafting and method not in PARALLEL_DRAFT_METHODS:
            msg = (
                "parallel_drafting is only supported by the parallel-draft family "
                f"({_choices(PARALLEL_DRAFT_METHODS)}), not by method {method!r}; set it to false"
            )
            problems.append(("parallel_drafting", msg))
        _raise_if(problems)
        return self


class EngineSection(BaseModel):
    """vLLM engine settings of one replica: batching, memory, caching, parallelism, speculation."""

    model_config = _SECTION_CONFIG

    max_num_seqs: int = Field(
        default=256,
        ge=1,
        le=8192,
        description=(
            "Continuous batching: the most sequences the scheduler runs in one step. Higher raises "
            "throughput until KV cache or compute saturates, then TTFT and TPOT climb; lower it when TPOT "
            "misses its SLO. The planner may lower it further to what the KV cache holds."
        ),
    )
    gpu_memory_utilization: float = Field(
        default=0.9,
        ge=0.05,
        le=0.99,
        description=(
            "Fraction of each GPU's memory vLLM may use for weights, activations and KV cache; the rest "
            "is left for CUDA graphs and other processes. Raise it for more KV tokens, lower it when the "
            "GPU is shared or the engine runs out of memory at start."
        ),
    )
    enable_prefix_caching: bool = Field(
        default=True,
        description=(
            "Reuse the KV blocks of shared prompt prefixes (system prompts, few-shot examples, multi-turn "
            "history); in the lab it halved TTFT p50 on a 2048-token shared prefix. Turn off only for "
            "traffic with no shared prefixes."
        ),
    )
    enable_chunked_prefill: bool = Field(
        default=True,
        description=(
            "Split long prompts into chunks of at most max_num_batched_tokens that run alongside decodes, "
            "so one long prefill does not stall every running stream (protects TPOT). With it off, each "
            "prompt must fit in one step's budget."
        ),
    )
    max_num_batched_tokens: int | None = Field(
        default=None,
        ge=16,
        le=1_048_576,
        description=(
            "Token budget of one scheduler step (prefill chunks + decode tokens); null lets vLLM choose. "
            "Larger speeds prefill (TTFT) but lengthens the steps decodes share (TPOT). Must be >= "
            "max_num_seqs, and >= model.max_model_len when chunked prefill is off."
        ),
    )
    enforce_eager: bool = Field(
        default=False,
        description=(
            "Skip CUDA graph capture and compilation: faster start and less memory, slower decode. "
            "Use it on the CPU backend and for quick experiments; keep it false in production on GPUs."
        ),
    )
    kv_cache_dtype: Literal["auto", "fp8", "fp8_e4m3", "fp8_e5m2"] = Field(
        default="auto",
        description=(
            "Storage dtype of the KV cache. 'auto' uses the model dtype; the fp8 variants halve KV bytes "
            "per token (about twice the KV tokens) at a small accuracy cost."
        ),
    )
    tensor_parallel_size: Literal[1, 2, 4, 8] | None = Field(
        default=None,
        description=(
            "GPUs each replica's model is sharded across (1, 2, 4 or 8). null lets the planner pick the "
            "smallest size whose weights and KV cache fit. Must be 1 or null on the CPU accelerator."
        ),
    )
    allreduce_rms_fusion: bool = Field(
        default=False,
        description=(
            "vLLM's fused all-reduce + RMSNorm pass (flashinfer) for tensor_parallel_size > 1. Off by "
            "default: on H200 pairs without NVLink multicast vLLM 0.26 picks flashinfer's mnnvl backend "
            "for it and crashes in its first forward (tests/data/memory_points/tp2_attempts.md). Turn it "
            "on where multicast is available and a TP=2 engine starts with it."
        ),
    )
    cpu_kv_cache_space_gib: float | None = Field(
        default=None,
        ge=0.0625,
        le=1024,
        description=(
            "KV cache size in GiB for vLLM's CPU backend (VLLM_CPU_KVCACHE_SPACE). Only used when "
            "resources.accelerator is 'cpu'; on GPUs gpu_memory_utilization sizes the cache."
        ),
    )
    seed: int = Field(
        default=0,
        ge=0,
        le=2**32 - 1,
        description="Random seed for sampling and dummy weights; change it to repeat a measurement.",
    )
    speculative: SpeculativeSection | None = Field(
        default=None,
        description=(
            "Speculative decoding; null turns it off. It lowers TPOT at light load but spends compute "
            "every step: in the lab ngram tripled TTFT p50 at concurrency 64. Judge TTFT and TPOT together."
        ),
    )

    @field_validator("tensor_parallel_size", mode="before")
    @classmethod
    def _no_bool_tp(cls, value: object) -> object:
        # true == 1 in Python, so the literal check alone would accept "tensor_parallel_size: true".
        if isinstance(value, bool):
            raise PydanticCustomError("int_type", "Input should be a valid integer")
        return value

    @model_validator(mode="after")
    def _check_budget(self) -> EngineSection:
        budget = self.max_num_batched_tokens
        if budget is not None and budget < self.max_num_seqs:
            msg = (
                f"max_num_batched_tokens ({budget}) must be >= max_num_seqs ({self.max_num_seqs}): every "
                "running sequence needs at least one token of the step budget; raise max_num_batched_tokens "
                "or lower max_num_seqs"
            )
            _raise_if([("max_num_batched_tokens", msg)])
        return self


class AutoscalingSection(BaseModel):
    """Bounds and knobs of the replica autoscaler (the TTFT-headroom policy, or Ray's default)."""

    model_config = _SECTION_CONFIG

    min_replicas: int = Field(
        default=1,
        ge=0,
        le=1024,
        description=(
            "Replicas kept with no traffic. 0 allows scale to zero, and the next request then waits a "
            "full cold start (64-255 s in the lab)."
        ),
    )
    max_replicas: int = Field(
        default=1,
        ge=1,
        le=1024,
        description="Most replicas the autoscaler may run; caps cost and GPU use. Must be >= min_replicas.",
    )
    initial_replicas: int | None = Field(
        default=None,
        ge=0,
        le=1024,
        description=(
            "Replicas started at deploy time, within [min_replicas, max_replicas]; null starts "
            "min_replicas. Set it to pre-warm capacity for a known traffic peak."
        ),
    )
    policy: Literal["ttft_headroom", "ray_queue_length"] = Field(
        default="ttft_headroom",
        description=(
            "ttft_headroom: headroom's policy (autoscale/policy.py), sized from TTFT against the SLO, "
            "queueing, arrival trend and KV use. ray_queue_length: Ray Serve's default, which scales on "
            "ongoing requests per replica and knows nothing of latency."
        ),
    )
    replica_startup_s: float = Field(
        default=90,
        ge=1,
        le=3600,
        description=(
            "Seconds from asking for a replica to it serving: the lead time the policy plans for. Measure "
            "it: a Qwen3-8B replica on an H200 served 66-74 s after it was asked for with warm compile "
            "caches, 217 s cold, 140 s at TP=2 (results/gpu)."
        ),
    )
    window_s: float = Field(
        default=30,
        ge=2,
        le=600,
        description="Seconds of requests each replica's TTFT percentiles and arrival rate cover.",
    )
    upscale_cooldown_s: float = Field(
        default=60,
        ge=0,
        le=3600,
        description=(
            "Seconds after a scale-up completes during which TTFT and queue length (still draining the "
            "backlog) cannot trigger another one; arrival-rate growth still can."
        ),
    )
    downscale_sustain_s: float = Field(
        default=180,
        ge=0,
        le=86400,
        description=(
            "Seconds load must stay low enough for one replica fewer before one is removed. Keep it long: "
            "a removed replica takes replica_startup_s to bring back."
        ),
    )
    downscale_cooldown_s: float = Field(
        default=30, ge=0, le=86400, description="Least seconds between two scale-downs."
    )
    per_replica_capacity_rps: float | None = Field(
        default=None,
        gt=0,
        le=1_000_000,
        description=(
            "Requests per second one replica serves within the SLO, from the tuning ladder; null leaves "
            "sizing to TTFT and queueing alone."
        ),
    )
    target_ongoing_requests: float | None = Field(
        default=None,
        gt=0,
        le=100_000,
        description=(
            "ray_queue_length only: ongoing requests per replica Ray aims for; null uses 80% of the "
            "planned max_num_seqs (Ray's own default of 2 starves a batching engine)."
        ),
    )

    @model_validator(mode="after")
    def _check_bounds(self) -> AutoscalingSection:
        problems: list[tuple[str, str]] = []
        lo, hi, initial = self.min_replicas, self.max_replicas, self.initial_replicas
        if hi < lo:
            problems.append(("max_replicas", f"max_replicas ({hi}) must be >= min_replicas ({lo})"))
        elif initial is not None and not lo <= initial <= hi:
            msg = f"initial_replicas ({initial}) must be between min_replicas ({lo}) and max_replicas ({hi})"
            problems.append(("initial_replicas", msg))
        _raise_if(problems)
        return self


class DeploymentSection(BaseModel):
    """The Ray Serve deployment: how many replicas, admission control, health checks and shutdown."""

    model_config = _SECTION_CONFIG

    num_replicas: int | None = Field(
        default=None,
        ge=1,
        le=1024,
        description=(
            "Fixed number of replicas. Mutually exclusive with autoscaling; when neither is given this "
            "is filled in as 1."
        ),
    )
    autoscaling: AutoscalingSection | None = Field(
        default=None,
        description=(
            "Let the TTFT-headroom policy choose the replica count within these bounds. Mutually "
            "exclusive with num_replicas."
        ),
    )
    max_ongoing_requests: int = Field(
        default=256,
        ge=1,
        le=100_000,
        description=(
            "Ray Serve's admission limit per replica: requests beyond it wait in Serve instead of the "
            "engine queue. Set it at or a little above engine.max_num_seqs, so batches stay full while "
            "overload stays visible to the autoscaler."
        ),
    )
    health_check_period_s: float = Field(
        default=10,
        ge=1,
        le=600,
        description="Seconds between health checks of each replica.",
    )
    health_check_timeout_s: float = Field(
        default=30,
        ge=1,
        le=3600,
        description=(
            "Seconds a health check may take before the replica is marked unhealthy and replaced. "
            "Raise it if replicas are restarted under heavy load."
        ),
    )
    graceful_shutdown_timeout_s: float = Field(
        default=20,
        ge=0,
        le=3600,
        description=(
            "Seconds a stopping replica gets to finish in-flight requests before it is killed; raise it "
            "for long generations."
        ),
    )

    @model_validator(mode="before")
    @classmethod
    def _default_one_replica(cls, data: object) -> object:
        if isinstance(data, Mapping) and data.get("num_replicas") is None and data.get("autoscaling") is None:
            return {**data, "num_replicas": 1}
        return data

    @model_validator(mode="after")
    def _check_exclusive(self) -> DeploymentSection:
        if self.num_replicas is not None and self.autoscaling is not None:
            msg = (
                f"num_replicas ({self.num_replicas}) and autoscaling are mutually exclusive: give "
                "num_replicas for a fixed fleet or autoscaling for a variable one, not both (when a base "
                "file sets one, set the other to null in the overlay)"
            )
            _raise_if([("num_replicas", msg)])
        return self

    @property
    def autoscaling_enabled(self) -> bool:
        return self.autoscaling is not None


class SLOSection(BaseModel):
    """Service-level objectives: what the autoscaler defends and the tuning ladder grades against."""

    model_config = _SECTION_CONFIG

    ttft_p95_ms: float = Field(
        default=1000,
        gt=0,
        le=600_000,
        description=(
            "Target time to first token at p95, in milliseconds. The autoscaler adds replicas as measured "
            "TTFT eats into this headroom; the tuning ladder marks settings that miss it."
        ),
    )
    tpot_p50_ms: float = Field(
        default=100,
        gt=0,
        le=60_000,
        description="Target time per output token (inter-token latency) at p50, in milliseconds.",
    )
    max_error_rate: float = Field(
        default=0.01,
        ge=0,
        le=1,
        description="Largest acceptable fraction of failed requests (0 to 1) in a load-test step.",
    )


class ResourcesSection(BaseModel):
    """Hardware per replica: accelerator kind, GPU model and memory, CPUs."""

    model_config = _SECTION_CONFIG

    accelerator: Literal["cpu", "gpu"] = Field(
        default="gpu",
        description="'gpu' runs vLLM's CUDA backend; 'cpu' runs its CPU backend (the embedded default, CI).",
    )
    gpu_type: str | None = Field(
        default=None,
        min_length=1,
        max_length=64,
        description=(
            "GPU model to plan for and schedule on, e.g. H200, H100-80GB, A100-80GB, L40S; null takes "
            "whatever the cluster has."
        ),
    )
    gpu_memory_gib: float | None = Field(
        default=None,
        gt=0,
        le=1024,
        description=(
            "Memory of one GPU in GiB as torch reports it (H200: 139.8); null takes it from the detected "
            "GPU. The planner sizes weights and KV cache against gpu_memory_gib * gpu_memory_utilization."
        ),
    )
    num_cpus_per_replica: float = Field(
        default=1,
        ge=0,
        le=256,
        description=(
            "CPUs reserved for each replica in its Ray placement group (tokenization, detokenization, "
            "HTTP streaming). Raise it when CPU-bound on detokenization at high concurrency."
        ),
    )


class HeadroomConfig(BaseModel):
    """One headroom deployment: the model, its engine, the Ray Serve deployment, SLOs and resources."""

    model_config = _SECTION_CONFIG

    name: str = Field(
        default="headroom",
        pattern=APP_NAME_PATTERN,
        description="Ray Serve application name; also prefixes metric labels and rendered file names.",
    )
    route_prefix: str = Field(
        default="/",
        min_length=1,
        max_length=256,
        description=(
            "HTTP path the application is served under; '/' serves /v1/... at the root. Starts with '/', "
            "no trailing '/' (other than '/' itself)."
        ),
    )
    model: ModelSection = Field(
        ..., description="What to serve: the checkpoint, its served name, dtype and length."
    )
    engine: EngineSection = Field(
        default_factory=EngineSection,
        description="vLLM engine settings of each replica: batching, memory, speculation.",
    )
    deployment: DeploymentSection = Field(
        default_factory=DeploymentSection,
        description="Ray Serve replicas (fixed or autoscaled), admission and health checks.",
    )
    slo: SLOSection = Field(
        default_factory=SLOSection,
        description="Latency and error targets the autoscaler and the tuning ladder use.",
    )
    resources: ResourcesSection = Field(
        default_factory=ResourcesSection,
        description="Hardware each replica runs on: accelerator, GPU type and memory, CPUs.",
    )

    @field_validator("route_prefix")
    @classmethod
    def _check_route_prefix(cls, value: str) -> str:
        if not value.startswith("/"):
            raise ValueError(f"must start with '/', got {value!r}")
        if value != "/" and value.endswith("/"):
            raise ValueError(f"must not end with '/' (except '/' itself), got {value!r}")
        if any(ch in value for ch in "{}? #"):
            raise ValueError(f"must be a plain path without '{{', '}}', '?', '#' or spaces, got {value!r}")
        return value

    @model_validator(mode="after")
    def _check_cross_section(self) -> HeadroomConfig:
        problems: list[tuple[str, str]] = []
        engine, model, resources = self.engine, self.model, self.resources
        budget, max_len = engine.max_num_batched_tokens, model.max_model_len
        if (
            not engine.enable_chunked_prefill
            and budget is not None
            and max_len is not None
            and budget < max_len
        ):
            msg = (
                f"max_num_batched_tokens ({budget}) must be >= model.max_model_len ({max_len}) when "
                "engine.enable_chunked_prefill is false, because every prompt must then fit in one step; "
                "set engine.enable_chunked_prefill: true or raise max_num_batched_tokens to at least "
                f"{max_len}"
            )
            problems.append(("engine.max_num_batched_tokens", msg))
        tp = engine.tensor_parallel_size
        if resources.accelerator == "cpu" and tp is not None and tp > 1:
            msg = (
                f"tensor_parallel_size ({tp}) needs resources.accelerator 'gpu'; with accelerator 'cpu' "
                "each replica is one engine process, so only 1 or null is accepted"
            )
            problems.append(("engine.tensor_parallel_size", msg))
        _raise_if(problems)
        return self

    @property
    def served_model_name(self) -> str:
        """The name clients use in the OpenAI ``model`` field: served_name, or one derived from source."""
        if self.model.served_name is not None:
            return self.model.served_name
        return _derive_served_name(self.model.source)


def _derive_served_name(source: str) -> str:
    text = source.strip().removeprefix(EMBEDDED_PREFIX)
    tail = re.split(r"[/\\]", text.rstrip("/\\"))[-1]
    tail = re.sub(r"[^A-Za-z0-9._:-]", "-", tail)[:128]
    return tail or "model"


# --------------------------------------------------------------------------------------------------------
# Turning pydantic's error dicts into messages an operator can act on
# --------------------------------------------------------------------------------------------------------

_EXPECTED_TYPE = {
    "int_type": "an integer",
    "int_parsing": "an integer",
    "int_from_float": "an integer",
    "float_type": "a number",
    "float_parsing": "a number",
    "finite_number": "a finite number",
    "bool_type": "true or false",
    "bool_parsing": "true or false",
    "string_type": "a string",
    "model_type": "a mapping",
    "model_attributes_type": "a mapping",
    "dict_type": "a mapping",
}
_RANGE_ERRORS = {  # pydantic error type -> (comparison, ctx key)
    "greater_than": (">", "gt"),
    "greater_than_equal": (">=", "ge"),
    "less_than": ("<", "lt"),
    "less_than_equal": ("<=", "le"),
}


def _type_name(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, Mapping):
        return "mapping"
    if isinstance(value, (list, tuple)):
        return "list"
    return type(value).__name__


def _show(value: object, limit: int = 80) -> str:
    """A value as it would look in YAML, shortened: null, true, 1.5, 'text', {...}, [...]."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        text = str(int(value))
    elif isinstance(value, (int, float, str)):
        text = repr(value)
    else:
        try:
            text = json.dumps(value, default=str)
        except (TypeError, ValueError):
            text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _unwrap_optional(annotation: object) -> tuple[list[object], bool]:
    """The non-None members of an annotation and whether None is accepted."""
    origin = typing.get_origin(annotation)
    if origin is typing.Union or origin is types.UnionType:
        members = list(typing.get_args(annotation))
        nullable = type(None) in members
        return [m for m in members if m is not type(None)], nullable
    return [annotation], False


def _model_class(annotation: object) -> type[BaseModel] | None:
    for member in _unwrap_optional(annotation)[0]:
        if isinstance(member, type) and issubclass(member, BaseModel):
            return member
    return None


def _literal_choices(annotation: object) -> tuple[object, ...] | None:
    for member in _unwrap_optional(annotation)[0]:
        if typing.get_origin(member) is Literal:
            return typing.get_args(member)
    return None


def _walk(root: type[BaseModel], loc: Sequence[object]) -> tuple[type[BaseModel] | None, Any]:
    """The model class owning the last element of loc and that element's FieldInfo (None when unknown)."""
    owner: type[BaseModel] | None = root
    info = None
    for i, part in enumerate(loc):
        if owner is None or not isinstance(part, str) or part not in owner.model_fields:
            return (owner if i == len(loc) - 1 else None), None
        info = owner.model_fields[part]
        if i < len(loc) - 1:
            owner = _model_class(info.annotation)
    return owner, info


def _section_at(root: type[BaseModel], loc: Sequence[object]) -> type[BaseModel] | None:
    """The model class validated at loc (the root for an empty loc)."""
    if not loc:
        return root
    _, info = _walk(root, loc)
    return _model_class(info.annotation) if info is not None else None


def _field_homes(root: type[BaseModel], prefix: str = "") -> dict[str, list[str]]:
    """Every field name in the tree mapped to the dotted paths where it lives."""
    homes: dict[str, list[str]] = {}
    for name, info in root.model_fields.items():
        path = f"{prefix}{name}"
        homes.setdefault(name, []).append(path)
        sub = _model_class(info.annotation)
        if sub is not None:
            for key, paths in _field_homes(sub, f"{path}.").items():
                homes.setdefault(key, []).extend(paths)
    return homes


def _bounds(info: Any) -> str | None:
    """'between 0.05 and 0.99', '> 0 and <= 600000', '>= 0' from a field's annotated_types metadata."""
    lower: tuple[str, Any] | None = None
    upper: tuple[str, Any] | None = None
    for meta in getattr(info, "metadata", ()):
        if isinstance(meta, annotated_types.Ge):
            lower = (">=", meta.ge)
        elif isinstance(meta, annotated_types.Gt):
            lower = (">", meta.gt)
        elif isinstance(meta, annotated_types.Le):
            upper = ("<=", meta.le)
        elif isinstance(meta, annotated_types.Lt):
            upper = ("<", meta.lt)
    if lower and upper:
        if lower[0] == ">=" and upper[0] == "<=":
            return f"between {_show(lower[1])} and {_show(upper[1])}"
        return f"{lower[0]} {_show(lower[1])} and {upper[0]} {_show(upper[1])}"
    if lower:
        return f"{lower[0]} {_show(lower[1])}"
    if upper:
        return f"{upper[0]} {_show(upper[1])}"
    return None


def _first_sentence(text: str | None) -> str:
    if not text:
        return ""
    sentence = re.split(r"(?<=\.)\s", text.strip(), maxsplit=1)[0]
    return sentence[:1].lower() + sentence[1:].rstrip(".")


def _did_you_mean(given: object, options: Iterable[object]) -> str:
    """' (did you mean 'x'?)' for the closest option, or '' when none is close."""
    if not isinstance(given, str):
        return ""
    texts = {str(o): o for o in options}
    match = difflib.get_close_matches(given, list(texts), n=1, cutoff=0.6)
    if not match:
        lowered = {k.lower(): k for k in texts}
        if given.lower() in lowered:
            match = [lowered[given.lower()]]
    return f" (did you mean {_show(texts[match[0]])}?)" if match else ""


def _got(value: object) -> str:
    """'got 5 (integer)', or 'got null'."""
    return "got null" if value is None else f"got {_show(value)} ({_type_name(value)})"


def _explain(err: Mapping[str, Any], root: type[BaseModel]) -> list[tuple[tuple[Any, ...], str]]:
    """Turns one pydantic error dict into (loc, message) pairs; see the module docstring for the style."""
    etype: str = err["type"]
    loc: tuple[Any, ...] = tuple(err.get("loc", ()))
    given = err.get("input")
    ctx: Mapping[str, Any] = err.get("ctx") or {}

    if etype == "value_error":
        cause = ctx.get("error")
        if isinstance(cause, _FieldProblems):
            return [(loc + tuple(path.split(".")), msg) for path, msg in cause.problems]
        return [(loc, re.sub(r"^Value error, ", "", err.get("msg", str(cause))))]

    if etype == "extra_forbidden":
        owner = _section_at(root, loc[:-1])
        key = loc[-1] if loc else given
        allowed = sorted(owner.model_fields) if owner is not None else []
        hint = _did_you_mean(key, allowed)
        if not hint and isinstance(key, str):
            homes = [p for p in _field_homes(root).get(key, []) if p != ".".join(map(str, loc))]
            if homes:
                hint = f" ('{key}' belongs at {' or '.join(homes)})"
        return [(loc, f"unknown key {_show(key)}{hint}; allowed keys here: {', '.join(allowed)}")]

    if etype == "invalid_key":
        return [(loc, f"keys must be strings, {_got(given)}")]

    owner, info = _walk(root, loc)
    annotation = getattr(info, "annotation", None)
    nullable = _unwrap_optional(annotation)[1] if info is not None else False
    or_null = " or null" if nullable else ""
    choices = _literal_choices(annotation) if info is not None else None

    if etype == "missing":
        if choices is not None:
            return [(loc, f"required key is missing; one of: {_choices(choices)}")]
        what = _first_sentence(getattr(info, "description", None))
        section = _model_class(annotation)
        if section is not None:
            keys = ", ".join(sorted(section.model_fields))
            what = f"{what}; a mapping with keys: {keys}" if what else f"a mapping with keys: {keys}"
        return [(loc, "required key is missing" + (f" ({what})" if what else ""))]

    if etype == "literal_error":
        accepted = _choices(choices) if choices is not None else str(ctx.get("expected", "?"))
        hint = _did_you_mean(given, choices or ())
        return [(loc, f"must be one of {accepted}{or_null}, got {_show(given)}{hint}")]

    if etype in _RANGE_ERRORS:
        bound_text = _bounds(info)
        if bound_text is None:  # no metadata found: fall back to the one bound pydantic reports
            symbol, ctx_key = _RANGE_ERRORS[etype]
            bound_text = f"{symbol} {_show(ctx.get(ctx_key))}"
        return [(loc, f"must be {bound_text}, got {_show(given)}")]

    if etype in _EXPECTED_TYPE:
        section = _model_class(annotation) if info is not None else (root if not loc else None)
        if section is not None:
            expected = (
                f"a mapping of {'.'.join(map(str, loc)) or 'top-level'} settings "
                f"(keys: {', '.join(sorted(section.model_fields))})"
            )
        elif choices is not None:
            expected = f"one of {_choices(choices)}"
        else:
            expected = _EXPECTED_TYPE[etype]
            bound_text = _bounds(info)
            if bound_text is not None:
                expected += f" {bound_text}"
        return [(loc, f"expected {expected}{or_null}, {_got(given)}")]

    if etype == "string_pattern_mismatch":
        pattern = str(ctx.get("pattern", ""))
        rule = _PATTERN_HINTS.get(pattern, f"must match {pattern}")
        return [(loc, f"got {_show(given)}, which is not allowed: {rule} (pattern {pattern})")]

    if etype == "string_too_short":
        if ctx.get("min_length") == 1:
            return [(loc, f"must be a non-empty string{or_null}, got {_show(given)}")]
        return [(loc, f"must be at least {ctx.get('min_length')} characters, got {_show(given)}")]

    if etype == "string_too_long":
        return [
            (loc, f"must be at most {ctx.get('max_length')} characters, got {len(str(given))} characters")
        ]

    return [(loc, f"{err.get('msg', etype)}, got {_show(given)}")]


def _dotted(loc: Sequence[object]) -> str:
    return ".".join(str(part) for part in loc) or _ROOT


# --------------------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------------------


def deep_merge(base: Mapping[str, Any], overlay: Mapping[str, Any]) -> dict[str, Any]:
    """Overlay onto base, returning a new dict; neither input is modified.

    Mappings merge key by key, recursively; anything else in the overlay (scalars, lists, a mapping over a
    scalar) replaces the base value. An explicit null in the overlay sets the value to None, e.g.
    ``speculative: null`` turns off speculation a base file configured.
    """
    merged: dict[str, Any] = {key: _copy(value) for key, value in base.items()}
    for key, value in overlay.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = _copy(value)
    return merged


def _copy(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy(v) for v in value]
    return value


class _StrictLoader(yaml.SafeLoader):  # type: ignore[misc,unused-ignore]
    """SafeLoader that rejects duplicate keys in a mapping (PyYAML silently keeps the last one)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    first = seen.get(key)
                except TypeError:  # unhashable key; the base loader reports it
                    continue
                if first is not None:
                    raise yaml.constructor.ConstructorError(
                        "while constructing a mapping",
                        node.start_mark,
                        f"found duplicate key {key!r} (first set on line {first})",
                        key_node.start_mark,
                    )
                seen[key] = key_node.start_mark.line + 1
        mapping: dict[Any, Any] = super().construct_mapping(node, deep=deep)
        return mapping


def load_yaml(path: str | Path) -> dict[str, Any]:
    """Reads one YAML config file: an empty file is ``{}``; anything but a mapping at the top is an error.

    Raises ConfigError naming the file, and the line and column of YAML syntax errors.
    """
    source = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError([("(file)", "file not found")], source) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError([("(file)", f"cannot read: {exc}")], source) from None
    try:
        data = yaml.load(text, Loader=_StrictLoader)  # a SafeLoader subclass: no arbitrary objects
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark is not None else "(file)"
        detail = exc.problem or exc.context or "syntax error"
        context = f" ({exc.context})" if exc.context and exc.problem else ""
        raise ConfigError([(where, f"invalid YAML: {detail}{context}")], source) from None
    except yaml.YAMLError as exc:
        raise ConfigError([("(file)", f"invalid YAML: {exc}")], source) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError([(_ROOT, _not_a_mapping(data))], source)
    return data


def _not_a_mapping(data: object) -> str:
    keys = ", ".join(HeadroomConfig.model_fields)
    return f"expected a mapping of settings (keys: {keys}), got a {_type_name(data)}: {_show(data, 40)}"


def _locate(loc: Sequence[object], layers: Sequence[tuple[str, Mapping[str, Any]]]) -> str | None:
    """The last layer whose data contains the full loc, i.e. the file that set the offending value."""
    for source, data in reversed(layers):
        node: Any = data
        for part in loc:
            if not isinstance(node, Mapping) or part not in node:
                break
            node = node[part]
        else:
            return str(source)
    return None


def _validate(data: object, layers: Sequence[tuple[str, Mapping[str, Any]]], source: str) -> HeadroomConfig:
    if not isinstance(data, Mapping):
        raise ConfigError([(_ROOT, _not_a_mapping(data))], source)
    try:
        return HeadroomConfig.model_validate(dict(data))
    except ValidationError as exc:
        problems: list[tuple[str, str]] = []
        sources: list[str] = []
        for err in exc.errors():
            for loc, message in _explain(err, HeadroomConfig):
                problems.append((_dotted(loc), message))
                sources.append((_locate(loc, layers) or source) if loc else source)
        raise ConfigError(problems, source, sources) from None


def parse_config(data: Mapping[str, Any], source: str = "config") -> HeadroomConfig:
    """Validates an already-merged config mapping; raises ConfigError listing every problem."""
    return _validate(data, [(source, data)] if isinstance(data, Mapping) else [], source)


def load_config(*paths: str | Path) -> HeadroomConfig:
    """Loads YAML files, merges them in order (later files win, see deep_merge) and validates the result.

    Each problem is attributed to the last file that set the offending key (or all files, joined with
    ' + ', when none did, e.g. a missing required key).
    """
    if not paths:
        raise ConfigError([(_ROOT, "no config files given")])
    layers = [(str(p), load_yaml(p)) for p in paths]
    merged: dict[str, Any] = {}
    for _, data in layers:
        merged = deep_merge(merged, data)
    return _validate(merged, layers, " + ".join(source for source, _ in layers))


def load_config_files(*paths: str | Path) -> HeadroomConfig:
    """load_config, where one file that sits next to a base.yaml is an overlay on it.

    So `configs/prod.yaml` means base.yaml + prod.yaml, as `--env prod` does; several files, or base.yaml
    itself, are taken as given.
    """
    if len(paths) == 1:
        path = Path(paths[0])
        base = path.parent / "base.yaml"
        if path.name != "base.yaml" and base.is_file():
            return load_config(base, path)
    return load_config(*paths)


def available_envs(config_dir: str | Path = DEFAULT_CONFIG_DIR) -> list[str]:
    """The environments in config_dir: the names of its ``*.yaml`` files other than ``base.yaml``, sorted."""
    directory = Path(config_dir)
    if not directory.is_dir():
        return []
    return sorted(p.stem for p in directory.glob("*.yaml") if p.stem != "base" and p.is_file())


def load_env_config(env: str, config_dir: str | Path = DEFAULT_CONFIG_DIR) -> HeadroomConfig:
    """Loads ``<config_dir>/base.yaml`` overlaid with ``<config_dir>/<env>.yaml`` (e.g. env='prod')."""
    directory = Path(config_dir)
    if not directory.is_dir():
        raise ConfigError([("(dir)", "config directory not found")], str(directory))
    envs = available_envs(directory)
    if env not in envs:
        hint = _did_you_mean(env, envs)
        listed = ", ".join(envs) if envs else "none"
        msg = (
            f"unknown environment {env!r}{hint}; available environments: {listed} "
            "(the *.yaml files other than base.yaml)"
        )
        raise ConfigError([("env", msg)], str(directory))
    base = directory / "base.yaml"
    if not base.is_file():
        raise ConfigError([("(file)", "base.yaml not found; every environment overlays it")], str(base))
    return load_config(base, directory / f"{env}.yaml")
