"""headroom's configuration: typed, validated once at the edge, with errors that say how to fix them.

A deployment is described by YAML files merged in order (``configs/base.yaml`` then ``configs/<env>.yaml``)
and validated into a frozen :class:`HeadroomConfig`. Every problem found is reported at once, each naming
the dotted field path, the value given and the values accepted, e.g.::

    configs/prod.yaml: engine.max_num_seq: unknown key 'max_num_seq' (did you mean 'max_num_seqs'?); ...
    configs/prod.yaml: engine.gpu_memory_utilization: must be between 0.05 and 0.99, got 1.5

Pure: it imports neither ray, vllm nor torch, so the CLI, the planner and the unit tests load it in
milliseconds. Errors are rendered by :mod:`serve_app.config.errors`, files read by
:mod:`serve_app.config.loading`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from autoscale.settings import AutoscalingSettings
from serve_app.config.errors import choices, raise_if
from serve_app.config.security import SecuritySection
from serve_app.config.vocabulary import (
    APP_NAME_PATTERN,
    DRAFT_CHECKPOINT_METHODS,
    EMBEDDED_PREFIX,
    PARALLEL_DRAFTING_METHODS,
    SERVED_NAME_PATTERN,
    Accelerator,
    KVCacheDtype,
    ModelDtype,
    Quantization,
    Routing,
    SpeculativeMethod,
    TensorParallelSize,
)
from serve_app.config.workload import WorkloadSection

_SECTION_CONFIG = ConfigDict(extra="forbid", frozen=True, strict=True)


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
        pattern=SERVED_NAME_PATTERN,
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
    dtype: ModelDtype = Field(
        default="auto",
        description=(
            "Weight and activation dtype. 'auto' takes the checkpoint's torch_dtype (bfloat16 for most "
            "current models); float32 doubles weight memory and is only for CPU debugging."
        ),
    )
    quantization: Quantization | None = Field(
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
            f"Required for {', '.join(DRAFT_CHECKPOINT_METHODS)}; not allowed for ngram; optional for mtp "
            "(null = the target model's own MTP layers)."
        ),
    )
    parallel_drafting: bool = Field(
        default=False,
        description=(
            "Propose all draft tokens in one pass of the drafter instead of one pass per token. Only the "
            f"parallel-draft family supports it: {', '.join(PARALLEL_DRAFTING_METHODS)}."
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
        if method in DRAFT_CHECKPOINT_METHODS and self.draft_model is None:
            msg = (
                f"draft_model is required when method is {method!r} (methods that run a draft checkpoint: "
                f"{choices(DRAFT_CHECKPOINT_METHODS)}); set it to a catalogue name or a local directory"
            )
            problems.append(("draft_model", msg))
        if method == "ngram" and self.draft_model is not None:
            msg = (
                f"draft_model ({self.draft_model!r}) is not allowed when method is 'ngram', which drafts "
                "from the prompt itself; remove it (set it to null when a base file sets it) or use one of "
                f"{choices(DRAFT_CHECKPOINT_METHODS)}"
            )
            problems.append(("draft_model", msg))
        if self.parallel_drafting and method not in PARALLEL_DRAFTING_METHODS:
            msg = (
                "parallel_drafting is only supported by the parallel-draft family "
                f"({choices(PARALLEL_DRAFTING_METHODS)}), not by method {method!r}; set it to false"
            )
            problems.append(("parallel_drafting", msg))
        raise_if(problems)
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
            "history); on an H200 it gave x6.9 throughput on shared-prefix prompts at concurrency 64 "
            "(results/gpu/ladder-shared-prefix/report.md). Turn off only for "
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
    kv_cache_dtype: KVCacheDtype = Field(
        default="auto",
        description=(
            "Storage dtype of the KV cache. 'auto' uses the model dtype; the fp8 variants halve KV bytes "
            "per token (about twice the KV tokens) at a small accuracy cost."
        ),
    )
    tensor_parallel_size: TensorParallelSize | None = Field(
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
            "every step, which raises TTFT under load. Judge TTFT and TPOT together (`headroom ladder`)."
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
            raise_if([("max_num_batched_tokens", msg)])
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
    autoscaling: AutoscalingSettings | None = Field(
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
    routing: Routing = Field(
        default="least_loaded",
        description=(
            "How requests are spread over replicas. 'least_loaded': HAProxy sends each request straight to "
            "the replica with the fewest connections (one hop). 'prefix_affinity': a small router tells "
            "HAProxy, per POST, the replica that served the same session, conversation opening or prompt "
            "start before (rendezvous hashing), unless that replica is over its bounded share of the load, "
            "so prefixes meet a warm prefix cache; it costs one side call per POST (a few ms) and is meant "
            "for 2+ replicas with multi-turn or session traffic. It has not paid in any run so far "
            "(results/bench_routing on the CPU box; results/gpu/2026-12-01/routing on 2 H200s)."
        ),
    )
    access_log: bool = Field(
        default=True,
        description=(
            "Ray Serve's access log: a line per request in each replica's log (docs/serving.md, Logs), "
            "like vllm serve's uvicorn access log. Writing it costs the replica's event loop about 90 us "
            "of CPU per request on a 2-core box (results/serve_request/report.md); turn it off where "
            "HAProxy, a gateway or the clients already log requests."
        ),
    )
    inter_token_latency_histogram: bool = Field(
        default=False,
        description=(
            "Export vLLM's per-token histogram vllm:inter_token_latency_seconds. vLLM observes it once per "
            "generated token, and through Ray's metrics each observation costs several microseconds on the "
            "replica's event loop, the thread that streams every response: on an H200 at 15,000 tokens/s "
            "it was the largest cost only headroom's replica had (9% of that thread's time, "
            "results/gpu/2026-12-04e/diag/frame_share.md). Off, per-request TPOT is still exported "
            "(vllm:request_time_per_output_token_seconds, headroom_tpot_seconds)."
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
            raise_if([("num_replicas", msg)])
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

    accelerator: Accelerator = Field(
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
    security: SecuritySection = Field(
        default_factory=SecuritySection,
        description="What the deployment exposes: API keys, routes, request limits, overload refusal.",
    )
    workload: WorkloadSection = Field(default_factory=WorkloadSection, description=WorkloadSection.__doc__)

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
        raise_if(problems)
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
