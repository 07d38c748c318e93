"""The one planning entry point: from a config and a cluster to the plan that `plan`, `serve`, `render` and
`rollout` all use.

`plan_config` plans the config's model on the cluster and checks the config's replica floors (a fixed
`num_replicas`, or the autoscaler's `min_replicas`/`initial_replicas`) against what fits; `require_fit`
refuses a plan that does not fit. `planning_cluster` turns flags or the live cluster's GPU counts per node
(however they were read: Ray's node table in a replica's driver, the dashboard's state API in rollout) into
the ClusterSpec.

Pure apart from reading model directories: imports neither Ray nor vLLM, so `headroom plan` answers in
well under a second on a machine without a GPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from serve_app.config import ConfigError, HeadroomConfig
from serve_app.config.vocabulary import GIB_BYTES, is_embedded
from serve_app.planning import catalogue
from serve_app.planning.catalogue import CatalogueKeyError
from serve_app.planning.placement import plan
from serve_app.planning.request import ClusterSpec, PlanRequest
from serve_app.planning.result import Plan
from serve_app.planning.shape import ModelShape


def model_shape(source: str, local_dir: str | None, field: str) -> ModelShape:
    """A model's shape from its local config.json, else from the built-in catalogue."""
    if local_dir is not None:
        return ModelShape.from_dir(Path(local_dir))
    if is_embedded(source):
        try:
            return catalogue.embedded_shape(source)
        except ValueError as err:
            raise ConfigError([(field, str(err))]) from None
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
        parallel_drafting=spec.parallel_drafting if spec else False,
        dtype=m.dtype,
        quantization=m.quantization,
        kv_cache_dtype=e.kv_cache_dtype,
        max_model_len=m.max_model_len,
        max_num_seqs=e.max_num_seqs,
        max_num_batched_tokens=e.max_num_batched_tokens,
        enable_chunked_prefill=e.enable_chunked_prefill,
        enable_prefix_caching=e.enable_prefix_caching,
        gpu_memory_utilization=e.gpu_memory_utilization,
        enforce_eager=e.enforce_eager,
        workload=cfg.workload,
        ttft_p95_ms=cfg.slo.ttft_p95_ms,
        tpot_p50_ms=cfg.slo.tpot_p50_ms,
        tensor_parallel_size=e.tensor_parallel_size,
        cluster=cluster,
        accelerator=cfg.resources.accelerator,
        cpu_kv_cache_space_gib=e.cpu_kv_cache_space_gib,
        num_cpus_per_replica=cfg.resources.num_cpus_per_replica,
    )


def planning_cluster(
    cfg: HeadroomConfig,
    gpus: int | None = None,
    nodes: int = 1,
    gpu_memory_gib: float | None = None,
    live_gpus_per_node: Sequence[int] | None = None,
) -> ClusterSpec:
    """The cluster to plan on: the live cluster's GPU nodes when known, else the flags (1 node of 1 GPU
    unless told), with the GPU model from the config. CPU configs need no cluster."""
    if cfg.resources.accelerator == "cpu":
        return cluster_spec(cfg)
    if live_gpus_per_node is not None:
        gpu_nodes = [g for g in live_gpus_per_node if g > 0]
        if not gpu_nodes:
            msg = "is 'gpu' but the Ray cluster has no GPU nodes; start GPU nodes or use a CPU config"
            raise ConfigError([("resources.accelerator", msg)])
        return cluster_spec(cfg, len(gpu_nodes), min(gpu_nodes), gpu_memory_gib)
    return cluster_spec(cfg, nodes, gpus, gpu_memory_gib)


def describe_cluster(cfg: HeadroomConfig, cluster: ClusterSpec) -> str:
    if cfg.resources.accelerator == "cpu":
        return "CPU (vLLM's CPU backend)"
    gpu = cluster.gpu
    memory = f", {gpu.memory_bytes / GIB_BYTES:.1f} GiB" if gpu is not None else ""
    name = gpu.name if gpu is not None else "GPU"
    return f"{cluster.nodes} node(s) x {cluster.gpus_per_node} {name}{memory}"


def plan_config(
    cfg: HeadroomConfig, cluster: ClusterSpec, model_dir: str | None = None, draft_dir: str | None = None
) -> Plan:
    """The plan for `cfg` on `cluster`, refused (fits=False, with the reason) when the config's replica
    floor needs more GPUs than the cluster has room for."""
    result = plan(plan_request(cfg, cluster, model_dir, draft_dir))
    floor = _replica_floor(cfg)
    if (
        result.fits
        and cfg.resources.accelerator == "gpu"
        and floor is not None
        and floor[1] > result.replicas
    ):
        field, wanted = floor
        tp = result.tensor_parallel_size
        reason = (
            f"{field} ({wanted}) needs {wanted * tp} GPUs at tensor_parallel_size {tp}; the cluster has room "
            f"for {result.replicas} replica(s) ({cluster.total_gpus} GPUs). Lower {field.rsplit('.', 1)[-1]} "
            f"to {result.replicas} or add GPUs."
        )
        result = replace(result, fits=False, reasons=(*result.reasons, reason))
    return result


def _replica_floor(cfg: HeadroomConfig) -> tuple[str, int] | None:
    """The field that sets the fewest replicas the deployment must place, and its value."""
    auto = cfg.deployment.autoscaling
    if auto is None:
        wanted = cfg.deployment.num_replicas
        return ("deployment.num_replicas", wanted) if wanted else None
    if (auto.initial_replicas or 0) > auto.min_replicas:
        return "deployment.autoscaling.initial_replicas", auto.initial_replicas or 0
    return "deployment.autoscaling.min_replicas", auto.min_replicas


def require_fit(result: Plan) -> None:
    """Refuses a plan that does not fit, with the planner's numbers."""
    if not result.fits:
        raise ConfigError([("plan", reason) for reason in result.reasons])
