"""What the planner is asked: the model, its engine settings, the expected traffic and SLOs, and the cluster.

Pure: imports neither ray, vllm nor torch.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, InstanceOf, field_validator, model_validator

from serve_app.config.vocabulary import (
    DRAFT_MODEL_FORWARD_METHODS,
    GIB_BYTES,
    PARALLEL_DRAFTING_METHODS,
    Accelerator,
    KVCacheDtype,
    ModelDtype,
    Quantization,
    SpeculativeMethod,
    TensorParallelSize,
)
from serve_app.config.workload import WorkloadSection
from serve_app.planning import catalogue
from serve_app.planning.catalogue import GpuSpec
from serve_app.planning.memory import MemoryInputs
from serve_app.planning.model_bytes import SpeculativeSpec
from serve_app.planning.shape import ModelShape

__all__ = ["CPU_KV_CACHE_SPACE_DEFAULT_GIB", "ClusterSpec", "PlanRequest"]

# Acceptance rate assumed per drafted token when the user gives none: n-gram drafts hit less often.
DEFAULT_ACCEPTANCE_RATE = {"ngram": 0.4}
DEFAULT_MODEL_ACCEPTANCE_RATE = 0.6
# The CPU backend's KV cache when the config gives none (vLLM's own default depends on the node's RAM).
CPU_KV_CACHE_SPACE_DEFAULT_GIB = 4.0

_FROZEN = ConfigDict(frozen=True, extra="forbid", arbitrary_types_allowed=True)


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
    parallel_drafting: bool = Field(
        default=False, description="Propose all draft tokens in one drafter pass (the config's setting)."
    )
    speculative_acceptance_rate: float | None = Field(
        default=None,
        gt=0,
        lt=1,
        description=(
            "Assumed probability each draft token is accepted (latency estimate); null: 0.4 ngram, 0.6 else."
        ),
    )
    dtype: ModelDtype = Field(default="auto", description="Weight dtype.")
    quantization: Quantization | None = Field(
        default=None, description="Weight quantization; null uses the checkpoint's own quantization_config."
    )
    kv_cache_dtype: KVCacheDtype = Field(
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
    enable_prefix_caching: bool = Field(
        default=True, description="Store shared prefixes once (workload.prefix_reuse_fraction applies)."
    )
    gpu_memory_utilization: float = Field(
        default=0.9, ge=0.05, le=0.99, description="vLLM's memory budget share."
    )
    enforce_eager: bool = Field(default=False, description="No CUDA graphs: no graph memory, slower steps.")
    workload: WorkloadSection = Field(
        default_factory=WorkloadSection,
        description="The expected request: sizes max_num_seqs and the latency estimate.",
    )
    ttft_p95_ms: float | None = Field(default=None, gt=0, description="TTFT SLO at p95; null: no TTFT bound.")
    tpot_p50_ms: float | None = Field(default=None, gt=0, description="TPOT SLO at p50; null: no TPOT bound.")
    tensor_parallel_size: TensorParallelSize | None = Field(
        default=None, description="Force a tensor-parallel size; null lets the planner choose."
    )
    cluster: ClusterSpec = Field(default_factory=ClusterSpec, description="Nodes and GPUs available.")
    accelerator: Accelerator = Field(default="gpu", description="vLLM's CUDA or CPU backend.")
    cpu_kv_cache_space_gib: float | None = Field(
        default=None,
        gt=0,
        description=f"CPU backend: KV cache size in GiB; null: {CPU_KV_CACHE_SPACE_DEFAULT_GIB:g}.",
    )
    num_cpus_per_replica: float = Field(default=1, ge=0, description="CPUs in each replica's first bundle.")
    require_max_num_seqs: bool = Field(
        default=False,
        description=(
            "Refuse instead of lowering max_num_seqs when the KV cache cannot hold that many sequences of "
            "the expected context."
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
        if method in DRAFT_MODEL_FORWARD_METHODS and self.draft_model is None:
            raise ValueError(
                f"speculative_method {method!r} needs draft_model (the draft checkpoint's shape)"
            )
        if self.parallel_drafting and method not in PARALLEL_DRAFTING_METHODS:
            raise ValueError(f"parallel_drafting needs one of {', '.join(PARALLEL_DRAFTING_METHODS)}")
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
        return SpeculativeSpec(
            self.speculative_method,
            self.num_speculative_tokens,
            self.draft_model,
            rate,
            self.parallel_drafting,
        )

    @property
    def prompt_tokens(self) -> int:
        """The expected prompt, clipped so that it leaves room for one output token."""
        return min(self.workload.prompt_tokens, self.resolved_max_model_len - 1)

    @property
    def output_tokens(self) -> int:
        room = max(1, self.resolved_max_model_len - self.prompt_tokens)
        return min(self.workload.output_tokens, room)

    @property
    def expected_context_tokens(self) -> int:
        """KV tokens an expected sequence holds when it finishes (prompt + output, within max_model_len)."""
        return self.prompt_tokens + self.output_tokens

    @property
    def prefix_reuse_fraction(self) -> float:
        """The shared share of each request that the KV cache stores once: none without prefix caching."""
        return self.workload.prefix_reuse_fraction if self.enable_prefix_caching else 0.0

    def memory_inputs(self, tensor_parallel_size: int, **overrides: Any) -> MemoryInputs:
        gpu = self.cluster.gpu
        on_cpu = self.accelerator == "cpu"
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
            cpu_kv_cache_space_gib=(
                (self.cpu_kv_cache_space_gib or CPU_KV_CACHE_SPACE_DEFAULT_GIB) if on_cpu else None
            ),
            enforce_eager=self.enforce_eager or on_cpu,
            subtract_cudagraph_estimate=self.subtract_cudagraph_estimate,
        )
        fields.update(overrides)
        return MemoryInputs(**fields)
