"""The Ray Serve deployment options for a config: replicas, autoscaling, resources, health checks.

Pure (no Ray import): the result is the keyword arguments of `Deployment.options(...)`, also what a
rendered Serve config file holds under `deployments:`.
"""

from __future__ import annotations

from typing import Any

from serve_app.config import HeadroomConfig

# Ray Serve settings for the cluster (read by Serve's processes at start-up, so they must be in the
# environment of `ray start` / the driver that starts the cluster). Measured on the tiny CPU model
# (loadtests/bench_overhead.py): with Serve's default Python proxy, streaming added 9-11 ms TTFT p50 at
# concurrency 1 and cost 30% throughput at 32; with HAProxy in front of replicas that serve HTTP
# themselves (one hop) and user code on the replica's main event loop, +2 ms and -8%.
SERVE_CLUSTER_ENV = {
    "RAY_SERVE_ENABLE_HA_PROXY": "1",
    "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
}


def apply_cluster_env(environ: dict[str, str]) -> None:
    """Sets SERVE_CLUSTER_ENV in `environ` where the user has not chosen otherwise."""
    for key, value in SERVE_CLUSTER_ENV.items():
        environ.setdefault(key, value)


def replica_resources(cfg: HeadroomConfig, tensor_parallel_size: int = 1) -> dict[str, Any]:
    """Where a replica runs. A TP group gets one placement group: the replica's CPU bundle plus one GPU
    bundle per rank, STRICT_PACK so all ranks share a node (vLLM's Ray executor uses that group)."""
    cpus = cfg.resources.num_cpus_per_replica
    if cfg.resources.accelerator == "cpu":
        return {"ray_actor_options": {"num_cpus": cpus}}
    if tensor_parallel_size == 1:
        return {"ray_actor_options": {"num_cpus": cpus, "num_gpus": 1}}
    return {
        "ray_actor_options": {"num_cpus": cpus},
        "placement_group_bundles": [{"CPU": cpus}] + [{"GPU": 1} for _ in range(tensor_parallel_size)],
        "placement_group_strategy": "STRICT_PACK",
    }


def deployment_options(cfg: HeadroomConfig, tensor_parallel_size: int = 1) -> dict[str, Any]:
    d = cfg.deployment
    opts: dict[str, Any] = {
        "max_ongoing_requests": d.max_ongoing_requests,
        "health_check_period_s": d.health_check_period_s,
        "health_check_timeout_s": d.health_check_timeout_s,
        "graceful_shutdown_timeout_s": d.graceful_shutdown_timeout_s,
        **replica_resources(cfg, tensor_parallel_size),
    }
    if d.autoscaling is not None:
        a = d.autoscaling
        opts["autoscaling_config"] = {
            "min_replicas": a.min_replicas,
            "max_replicas": a.max_replicas,
            "initial_replicas": a.initial_replicas,
            "upscale_delay_s": a.upscale_delay_s,
            "downscale_delay_s": a.downscale_delay_s,
        }
    else:
        opts["num_replicas"] = d.num_replicas or 1
    return opts
