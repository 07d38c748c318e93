"""The one place where a headroom config and its plan become vLLM engine arguments.

The output is the flag list `vllm serve` takes, so the same list builds our replicas' engines (parsed by
vLLM's own argument parser), `headroom engine-args` prints, and the bare `vllm serve` that the overhead
benchmark compares against. `plan_engine` is the one step from a config to what the plan decides for each
engine; the deployment and `headroom engine-args` both take it. Pure: imports neither vLLM nor Ray.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from serve_app.config import HeadroomConfig
from serve_app.config.vocabulary import GIB_BYTES
from serve_app.models.resolve import ResolvedModels
from serve_app.planning.from_config import plan_config
from serve_app.planning.request import ClusterSpec
from serve_app.planning.result import Plan


def speculative_config(cfg: HeadroomConfig, draft_path: str | None) -> dict | None:
    """vLLM's `--speculative-config` for the config's speculative section, or None when it is off."""
    spec = cfg.engine.speculative
    if spec is None:
        return None
    out: dict = {"method": spec.method, "num_speculative_tokens": spec.num_speculative_tokens}
    if draft_path is not None:
        out["model"] = draft_path
    if spec.prompt_lookup_min is not None:
        out["prompt_lookup_min"] = spec.prompt_lookup_min
    if spec.prompt_lookup_max is not None:
        out["prompt_lookup_max"] = spec.prompt_lookup_max
    if spec.parallel_drafting:
        out["parallel_drafting"] = True
    return out


@dataclass(frozen=True)
class PlannedEngine:
    """What the plan decides for each engine (serve_app.planning); the rest comes from the config."""

    tensor_parallel_size: int
    max_num_seqs: int


def plan_engine(
    cfg: HeadroomConfig, models: ResolvedModels, cluster: ClusterSpec
) -> tuple[Plan, PlannedEngine]:
    """The plan for `cfg` on `cluster`, made from the resolved model directories as the replicas see them,
    and what it decides for each engine. The caller refuses a plan that does not fit."""
    result = plan_config(cfg, cluster, models.model_path, models.draft_path)
    return result, PlannedEngine(result.tensor_parallel_size, result.max_num_seqs)


def vllm_cli_args(cfg: HeadroomConfig, models: ResolvedModels, planned: PlannedEngine) -> list[str]:
    """The `vllm serve` flags that configure an engine exactly as `cfg` and its plan say."""
    m, e = cfg.model, cfg.engine
    args = ["--model", models.model_path, "--served-model-name", cfg.served_model_name]
    if m.tokenizer:
        args += ["--tokenizer", m.tokenizer]
    args += ["--dtype", m.dtype]
    if m.quantization:
        args += ["--quantization", m.quantization]
    if m.max_model_len:
        args += ["--max-model-len", str(m.max_model_len)]
    if m.dummy_weights:
        args += ["--load-format", "dummy"]
    args += ["--max-num-seqs", str(planned.max_num_seqs), "--seed", str(e.seed)]
    args.append("--enable-prefix-caching" if e.enable_prefix_caching else "--no-enable-prefix-caching")
    args.append("--enable-chunked-prefill" if e.enable_chunked_prefill else "--no-enable-chunked-prefill")
    if e.max_num_batched_tokens:
        args += ["--max-num-batched-tokens", str(e.max_num_batched_tokens)]
    if e.enforce_eager:
        args.append("--enforce-eager")
    if e.kv_cache_dtype != "auto":
        args += ["--kv-cache-dtype", e.kv_cache_dtype]
    if cfg.resources.accelerator == "cpu":
        # The CPU backend sizes its KV cache from this (gpu_memory_utilization would reserve a share of RAM).
        if e.cpu_kv_cache_space_gib is not None:
            args += ["--kv-cache-memory-bytes", str(int(e.cpu_kv_cache_space_gib * GIB_BYTES))]
        # Imported in the worker process: it requests the AMX registers vLLM's CPU attention uses.
        args += ["--worker-extension-cls", "serve_app.serving.cpu_worker.RequestAMXTiles"]
    else:
        args += ["--gpu-memory-utilization", str(e.gpu_memory_utilization)]
        args += ["--tensor-parallel-size", str(planned.tensor_parallel_size)]
        if planned.tensor_parallel_size > 1:
            # Inside a Serve replica the TP ranks must be Ray actors in the replica's placement group:
            # multiprocessing workers would only see the replica's own (GPU-less) bundle.
            args += ["--distributed-executor-backend", "ray"]
            if not e.allreduce_rms_fusion:
                args += ["--compilation-config", json.dumps({"pass_config": {"fuse_allreduce_rms": False}})]
    spec = speculative_config(cfg, models.draft_path)
    if spec is not None:
        args += ["--speculative-config", json.dumps(spec, sort_keys=True)]
    return args
