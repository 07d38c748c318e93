"""The Ray Serve deployment options for a config: replicas, autoscaling, resources, health checks.

Pure (no Ray import): the result is the keyword arguments of `Deployment.options(...)`, also what a
rendered Serve config file holds under `deployments:`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, MutableMapping
from pathlib import Path
from typing import Any

from autoscale.capacity import seed_from_ladder
from autoscale.ray_policy import POLICY_IMPORT_PATH
from serve_app.config import ConfigError, HeadroomConfig
from serve_app.planning.placement import Plan

# Ray Serve settings for the cluster (read by Serve's processes at start-up, so they must be in the
# environment of `ray start` / the driver that starts the cluster). HAProxy routes each request straight to
# a replica that serves HTTP itself (one hop; Serve's default sends it through a Python proxy actor first),
# and user code runs on the replica's own event loop (no hand-off to a second thread per message); what is
# left against bare `vllm serve` is measured in results/bench_overhead and results/gpu. Ray also starts
# workers at nice 15 so its own daemons stay responsive; here the worker (the replica and its engine) is
# the workload, and at nice 15 it lost the CPU to everything else on the node. Last, a replica that is
# killed hard (graceful shutdown timed out) would leave its vLLM engine-core process behind, holding the
# accelerator's memory so that the replacement replica cannot start: each worker leads its own process
# group, which the engine core joins, and the raylet kills that group when the worker dies (Ray 2.60 gave
# each worker its own group without this setting; set so the cleanup does not rest on a default). Not
# Ray's older raylet-subreaper switch: it makes every worker ignore SIGCHLD, the engine core inherits that,
# and vLLM's usage report (py-cpuinfo) then spins a CPU core forever waiting on a child it can no longer
# reap (results/gpu/README.md). The HTTP callback gives each replica's HTTP server headroom's one middleware,
# which turns off Serve's per-request disconnect watcher (vLLM's handlers watch for disconnects themselves;
# serving/ingress_middleware.py).
SERVE_CLUSTER_ENV = {
    "RAY_SERVE_ENABLE_HA_PROXY": "1",
    "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
    "RAY_worker_niceness": "0",
    "RAY_process_group_cleanup_enabled": "true",
    "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH": "serve_app.serving.ingress_middleware.middlewares",
}

# deployment.routing: prefix_affinity (serving/prefix_router.py): HAProxy hands the router the request body
# (its key is in there), buffered up to 256 KiB: a chat of tens of thousands of tokens, at a bounded cost
# (HAProxy's buffer size is global once a router exists, two per connection: at its 4096 connections, 2 GiB
# at most; Ray's default of 8 MiB, 64 GiB). A longer body reaches the router cut short, is not JSON and is
# routed by load alone; the replica still gets all of it. A POST whose router cannot be reached fails, so
# every HAProxy node runs two routers (HAProxy tries the other). All take effect only in an app with a router.
ROUTING_CLUSTER_ENV = {
    "RAY_SERVE_INGRESS_REQUEST_ROUTER_FORWARD_BODY": "1",
    "RAY_SERVE_HAPROXY_INGRESS_REQUEST_ROUTER_BUFSIZE": str(256 * 1024),
    "RAY_SERVE_INGRESS_ROUTER_REPLICAS_PER_NODE": "2",
}
SERVE_CLUSTER_ENV.update(ROUTING_CLUSTER_ENV)


def apply_cluster_env(environ: dict[str, str]) -> None:
    """Sets SERVE_CLUSTER_ENV in `environ` where the user has not chosen otherwise."""
    for key, value in SERVE_CLUSTER_ENV.items():
        environ.setdefault(key, value)


# What Ray sets in a worker process after it started, unless the worker's environment already had it:
# OMP_NUM_THREADS=<the actor's num_cpus> (ray/_private/utils.py, set_omp_num_threads_if_unset). vLLM's
# engine core, started from the replica, would inherit it; `vllm serve` starts without it, and vLLM then
# sizes the engine's thread pools itself (and warns that an inherited OMP_NUM_THREADS > 1 keeps Torch's
# CPU threads spinning while it serves).
RAY_WORKER_DEFAULTS = ("OMP_NUM_THREADS",)


def restore_vllm_serve_env(environ: MutableMapping[str, str], started_with: Mapping[str, str]) -> list[str]:
    """Removes from `environ` the RAY_WORKER_DEFAULTS that Ray set after this process started (they are
    absent from `started_with`, the environment it was started with), so the engine core started from
    here gets what it would under `vllm serve`. A value the user set (in the cluster's or the app's
    environment) was there at start and stays. Returns the names removed."""
    removed = [k for k in RAY_WORKER_DEFAULTS if k in environ and k not in started_with]
    for key in removed:
        del environ[key]
    return removed


def deployment_options(cfg: HeadroomConfig, plan: Plan) -> dict[str, Any]:
    """Serve options for the planned replicas: a TP group gets one placement group holding the replica's
    CPU bundle and a GPU bundle per rank, STRICT_PACK so all ranks share a node (vLLM's Ray executor
    places its workers in it); a single-GPU or CPU replica is a plain actor."""
    d = cfg.deployment
    opts: dict[str, Any] = {
        **admission_options(cfg, plan),
        "health_check_period_s": d.health_check_period_s,
        "health_check_timeout_s": d.health_check_timeout_s,
        "graceful_shutdown_timeout_s": d.graceful_shutdown_timeout_s,
    }
    if not d.access_log:
        opts["logging_config"] = {"enable_access_log": False}
    cpus = cfg.resources.num_cpus_per_replica
    if plan.tensor_parallel_size > 1:
        opts["ray_actor_options"] = {"num_cpus": cpus}
        opts["placement_group_bundles"] = [dict(b) for b in plan.bundles]
        opts["placement_group_strategy"] = plan.placement_strategy
    elif cfg.resources.accelerator == "gpu":
        opts["ray_actor_options"] = {"num_cpus": cpus, "num_gpus": 1}
    else:
        opts["ray_actor_options"] = {"num_cpus": cpus}
    if d.autoscaling is not None:
        opts["autoscaling_config"] = autoscaling_config(cfg, plan)
    else:
        opts["num_replicas"] = d.num_replicas or 1
    return opts


def admission_options(cfg: HeadroomConfig, plan: Plan) -> dict[str, Any]:
    """Serve's own admission per replica. With overload refusal on, headroom's ASGI layer holds the bound
    (it answers in OpenAI's error JSON; Serve's refusals are plain text), so Serve admits twice the bound
    (generation requests, plus health checks, model lists and refusals being answered) and keeps a queue
    as deep again behind it: a backstop refusing with the same status and Retry-After. Not shallower: in
    direct ingress Serve counts every arriving request as queued until it takes a slot, so refused
    clients coming back together (one Retry-After later) met a queue of one bound with plain-text 503s."""
    d = cfg.deployment
    overload = cfg.security.overload
    if overload is None:
        return {"max_ongoing_requests": d.max_ongoing_requests}
    bound = overload.admission_bound(plan.max_num_seqs)
    ongoing = max(d.max_ongoing_requests, 2 * bound)
    return {
        "max_ongoing_requests": ongoing,
        "max_queued_requests": ongoing,
        "backpressure_config": {"status_code": overload.status, "retry_after_s": overload.retry_after_s},
    }


def autoscaling_config(cfg: HeadroomConfig, plan: Plan) -> dict[str, Any]:
    """Ray Serve's autoscaling_config for the config's policy."""
    a = cfg.deployment.autoscaling
    assert a is not None
    bounds = {
        "min_replicas": a.min_replicas,
        "max_replicas": a.max_replicas,
        "initial_replicas": a.initial_replicas,
    }
    if a.policy == "ray_queue_length":
        target = a.target_ongoing_requests or max(1.0, 0.8 * plan.max_num_seqs)
        return {**bounds, "target_ongoing_requests": target}
    policy_kwargs = {
        "settings": a.model_dump(mode="json"),
        "ttft_target_ms": cfg.slo.ttft_p95_ms,
        "max_num_seqs": plan.max_num_seqs,
        "capacity_seed": capacity_seed(a.capacity_seed_file, cfg.slo.ttft_p95_ms),
    }
    return {
        **bounds,
        # The policy keeps its own hysteresis and cooldowns; Ray's delays would stack on top of them.
        "upscale_delay_s": 0,
        "downscale_delay_s": 0,
        # Ray requires the look-back to exceed its 10 s metrics interval; the policy reads each replica's
        # newest report (its own window_s), so this only paces Ray's bookkeeping.
        "look_back_period_s": max(a.window_s, 20.0),
        "policy": {"policy_function": POLICY_IMPORT_PATH, "policy_kwargs": policy_kwargs},
    }


def capacity_seed(path: str | None, ttft_target_ms: float) -> dict[str, Any] | None:
    """The capacity seed read from a `headroom ladder` results.json (here, where the app is built, so the
    controller needs no file); None without a file."""
    if path is None:
        return None
    field = "deployment.autoscaling.capacity_seed_file"
    try:
        data = json.loads(Path(path).read_text())
        return seed_from_ladder(data, ttft_target_ms, path).to_dict()
    except OSError as err:
        raise ConfigError([(field, f"cannot read {path}: {err.strerror}")]) from None
    except (ValueError, KeyError, TypeError) as err:
        raise ConfigError(
            [(field, f"{path} is not a usable `headroom ladder` results.json: {err}")]
        ) from None
