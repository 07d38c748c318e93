"""From a config (and a cluster) to the planner's request, and from the plan to what gets deployed.

Pure apart from reading model directories: imports neither Ray nor vLLM, so `headroom plan` answers in
well under a second on a machine without a GPU.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from serve_app import catalogue
from serve_app.catalogue import CatalogueKeyError
from serve_app.config import ConfigError, HeadroomConfig
from serve_app.model_shape import ModelShape
from serve_app.planner import ClusterSpec, Plan, PlanRequest, plan
from serve_app.tiny_model import is_embedded


def model_shape(source: str, local_dir: str | None, field: str) -> ModelShape:
    """A model's shape from its local config.json, else from the built-in catalogue."""
    if local_dir is not None:
        return ModelShape.from_dir(Path(local_dir))
    if is_embedded(source):
        from serve_app.tiny_model import ensure_embedded_model

        return ModelShape.from_dir(ensure_embedded_model(source))
    path = Path(source).expanduser()
    if (path / "config.json").is_file():
        return ModelShape.from_dir(path)
    try:
        return catalogue.shape(source)
    except CatalogueKeyError as err:
        raise ConfigError([(field, f"not a local model directory, and {err.args[0]}")]) from None


def cluster_spec(
    cfg: HeadroomConfig, nodes: int = 1, gpus_per_node: int | None = None, gpu_memory_gib: float | None = None
) -> ClusterSpec:
    """The cluster to plan for: flags (or the live cluster) for the counts, the config for the GPU type."""
    res = cfg.resources
    if res.accelerator == "cpu":
        return ClusterSpec(nodes=nodes, gpus_per_node=0)
    if res.gpu_type is None:
        raise ConfigError([("resources.gpu_type", "required to plan for GPUs; e.g. " + catalogue_gpus())])
    try:
        return ClusterSpec.of(
            res.gpu_type,
            nodes=nodes,
            gpus_per_node=gpus_per_node if gpus_per_node is not None else 1,
            gpu_memory_gib=gpu_memory_gib if gpu_memory_gib is not None else res.gpu_memory_gib,
        )
    except CatalogueKeyError as err:
        raise ConfigError([("resources.gpu_type", str(err.args[0]))]) from None


def catalogue_gpus() -> str:
    return ", ".join(catalogue.gpu_names())


def plan_request(
    cfg: HeadroomConfig, cluster: ClusterSpec, model_dir: str | None = None, draft_dir: str | None = None
) -> PlanRequest:
    m, e = cfg.model, cfg.engine
    spec = e.speculative
    draft = None
    if spec is not None and spec.draft_model:
        draft = model_shape(spec.draft_model, draft_dir, "engine.speculative.draft_model")
    return PlanRequest(
        model=model_shape(m.source, model_dir, "model.source"),
        draft_model=draft,
        speculative_method=spec.method if spec else None,
        num_speculative_tokens=spec.num_speculative_tokens if spec else 0,
        dtype=m.dtype,
        quantization=m.quantization,
        kv_cache_dtype=e.kv_cache_dtype,
        max_model_len=m.max_model_len,
        max_num_seqs=e.max_num_seqs,
        max_num_batched_tokens=e.max_num_batched_tokens,
        enable_chunked_prefill=e.enable_chunked_prefill,
        gpu_memory_utilization=e.gpu_memory_utilization,
        enforce_eager=e.enforce_eager,
        ttft_p95_ms=cfg.slo.ttft_p95_ms,
        tpot_p50_ms=cfg.slo.tpot_p50_ms,
        tensor_parallel_size=e.tensor_parallel_size,
        cluster=cluster,
        accelerator=cfg.resources.accelerator,
        cpu_kv_cache_space_gib=e.cpu_kv_cache_space_gib,
        num_cpus_per_replica=cfg.resources.num_cpus_per_replica,
    )


def plan_config(
    cfg: HeadroomConfig, cluster: ClusterSpec, model_dir: str | None = None, draft_dir: str | None = None
) -> Plan:
    """The plan for `cfg` on `cluster`, with the config's replica count checked against what fits."""
    result = plan(plan_request(cfg, cluster, model_dir, draft_dir))
    wanted = cfg.deployment.num_replicas
    if result.fits and cfg.resources.accelerator == "gpu" and wanted and wanted > result.replicas:
        result = replace(
            result,
            fits=False,
            reasons=(
                *result.reasons,
                f"deployment.num_replicas ({wanted}) needs {wanted * result.tensor_parallel_size} GPUs at "
                f"tensor_parallel_size {result.tensor_parallel_size}; the cluster has room for "
                f"{result.replicas} replica(s) ({cluster.total_gpus} GPUs). Lower num_replicas to "
                f"{result.replicas} or add GPUs.",
            ),
        )
    return result


def require_fit(result: Plan) -> None:
    """Refuses a plan that does not fit, with the planner's numbers."""
    if not result.fits:
        raise ConfigError([("plan", reason) for reason in result.reasons])
