"""The Ray Serve deployment: replicas that each own a vLLM engine and serve its OpenAI API.

The HTTP proxy routes straight to an engine replica (one hop); the replica's ASGI app is vLLM's own
OpenAI server app. `serve_app.app:build_app` (the import path users and rendered Serve configs name) is
`build_app` here.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

import ray
from ray import serve
from ray.serve import Application

from autoscale.replica_stats import ReplicaStatsWindow
from serve_app.config import HeadroomConfig, load_config_files, load_env_config, parse_config
from serve_app.models.resolve import resolve_models
from serve_app.planning.from_config import planning_cluster, require_fit
from serve_app.planning.placement import ClusterSpec
from serve_app.serving.asgi import ReplicaASGI
from serve_app.serving.driver import init_ray_driver
from serve_app.serving.engine import build_openai_app, parse_serve_args, start_engine
from serve_app.serving.engine_args import PlannedEngine, plan_engine, vllm_cli_args
from serve_app.serving.metrics import ServingMetrics
from serve_app.serving.prefix_router import with_prefix_router
from serve_app.serving.request_guard import read_api_keys
from serve_app.serving.serve_options import deployment_options, restore_vllm_serve_env

logger = logging.getLogger(__name__)

# A replica whose engine died waits up to DEAD_ENGINE_GRACE_S for its requests in flight to get their
# error responses, answers what still arrives with 503 + Retry-After for DEAD_ENGINE_LINGER_S more (HAProxy
# routes to it until it is gone), then exits. The linger is well under Retry-After (>= 1 s), so that the
# retries of those requests find the replica gone, and HAProxy sends them elsewhere.
DEAD_ENGINE_GRACE_S = 2.0
DEAD_ENGINE_LINGER_S = 0.2


@serve.ingress()
class LLMServer:
    """A replica: one vLLM AsyncLLM engine and vLLM's OpenAI app bound to it."""

    async def __init__(self, config: dict[str, Any], planned: dict[str, Any]):
        cfg = parse_config(config, source="deployment")
        self._security = cfg.security
        # Read here, where the replica runs: the keys are in no config, Serve option or log.
        source = cfg.security.api_keys
        self._api_keys = read_api_keys(source, os.environ) if source is not None else None
        # Resolved here, not on the driver: the replica's node has its own model cache.
        models = resolve_models(cfg)
        engine = PlannedEngine(**planned)
        self._args = parse_serve_args(vllm_cli_args(cfg, models, engine))
        overload = cfg.security.overload
        self._admission_bound = overload.admission_bound(engine.max_num_seqs) if overload else None
        ctx = serve.get_replica_context()
        window_s = cfg.deployment.autoscaling.window_s if cfg.deployment.autoscaling else 30.0
        self._metrics = ServingMetrics(
            {
                "application": ctx.app_name,
                "deployment": ctx.deployment,
                "replica": ctx.replica_tag,
                "model": cfg.served_model_name,
            },
            ReplicaStatsWindow(window_s),
        )
        # The engine core starts from this process: with `vllm serve`'s environment, not Ray's defaults.
        restore_vllm_serve_env(os.environ, environ_at_start())
        self._engine = await start_engine(
            self._args, self._metrics, cfg.security.limits, cfg.deployment.inter_token_latency_histogram
        )
        self._asgi: ReplicaASGI | None = None
        self._stopping = False
        self._engine_watch = asyncio.get_running_loop().create_task(self._exit_when_engine_dies())

    async def __serve_build_asgi_app__(self):
        self._asgi = await build_openai_app(
            self._engine, self._args, self._metrics, self._security, self._api_keys, self._admission_bound
        )
        return self._asgi

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """What the autoscaling policy reads for this replica (autoscale/replica_stats.py)."""
        return self._metrics.window.report(time.time())

    async def engine_steps(self, since_s: float = 0.0) -> dict[str, Any]:
        """The engine's logged steps after `since_s` (wall clock), oldest first, and the KV cache's size in
        tokens and its block size (the steps give its usage as a fraction of blocks): what a calibration fits
        the simulator's step costs to (autoscale/step_log.py; loadtests/gpu/autoscale_replay.py saves them
        beside each closed loop)."""
        cache = self._engine.vllm_config.cache_config
        return {
            "kv_cache_tokens": (cache.num_gpu_blocks or 0) * cache.block_size,
            "block_size": cache.block_size,
            "steps": [step._asdict() for step in self._metrics.engine_steps if step.at_s > since_s],
        }

    async def check_health(self) -> None:
        # Raises once the engine core process is gone, so Serve replaces this replica.
        await self._engine.check_health()

    async def _exit_when_engine_dies(self) -> None:
        """A replica whose engine core died exits at once, rather than at Serve's next health check: its
        requests in flight get their errors, and then HAProxy, finding the port closed, sends every later
        request to another replica (retry-on conn-failure) while Serve starts a replacement."""
        await asyncio.to_thread(self._engine.wait_for_engine_core_exit)
        if self._stopping:
            return
        if self._asgi is not None:
            self._asgi.engine_dead = True  # requests arriving meanwhile get 503 + Retry-After
        self._engine.stop_dead_engine()
        deadline = time.monotonic() + DEAD_ENGINE_GRACE_S
        while self._asgi is not None and self._asgi.generating and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        await asyncio.sleep(DEAD_ENGINE_LINGER_S)
        logger.error("engine core died; replica exiting so that Serve replaces it")
        for handler in logging.getLogger().handlers:
            handler.flush()
        os._exit(1)

    def __del__(self):
        self._stopping = True
        engine = getattr(self, "_engine", None)
        if engine is not None:
            engine.shutdown()


def environ_at_start() -> dict[str, str]:
    """The environment this process was started with (Linux's /proc/self/environ). Where that cannot be
    read (another system, or a process title written over it) the current one, so that nothing is taken
    for a value Ray set later."""
    try:
        raw = Path("/proc/self/environ").read_bytes()
    except OSError:
        raw = b""
    started = dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)
    return started or dict(os.environ)


def live_cluster(cfg: HeadroomConfig) -> ClusterSpec:
    """The connected Ray cluster as the planner sees it: GPU nodes and GPUs per node."""
    if cfg.resources.accelerator == "cpu":
        return planning_cluster(cfg)
    if not ray.is_initialized():
        init_ray_driver(address=os.environ.get("RAY_ADDRESS"))
    gpus = [int(n["Resources"].get("GPU", 0)) for n in ray.nodes() if n["Alive"]]
    return planning_cluster(cfg, live_gpus_per_node=gpus)


def build_from_config(cfg: HeadroomConfig, cluster: ClusterSpec | None = None) -> Application:
    """The Serve application for a validated config, as the plan places it.

    Model files, draft compatibility and the plan are all checked here, so a config that cannot run is
    refused before anything is deployed.
    """
    models = resolve_models(cfg)
    result, planned = plan_engine(cfg, models, cluster or live_cluster(cfg))
    require_fit(result)
    deployment = serve.deployment(LLMServer).options(name="LLMServer", **deployment_options(cfg, result))
    args = (cfg.model_dump(mode="json"), asdict(planned))
    if cfg.deployment.routing == "prefix_affinity":
        return with_prefix_router(deployment, *args)
    return deployment.bind(*args)


def build_app(args: dict[str, Any]) -> Application:
    """Application builder for `serve run serve_app.app:build_app env=<env>` or `config=<a.yaml,b.yaml>`,
    and for a Serve config rendered by `headroom render`/`rollout`, whose args.config is the merged config
    itself (a mapping; args.headroom, its env and hash, is metadata for `headroom status`)."""
    if isinstance(args.get("config"), Mapping):
        cfg = parse_config(args["config"], source="args.config of the rendered Serve config")
    elif "config" in args:
        cfg = load_config_files(*args["config"].split(","))
    else:
        cfg = load_env_config(args.get("env", "local"))
    return build_from_config(cfg)
