"""The Ray Serve application: one deployment whose replicas each own a vLLM engine and serve its OpenAI API.

The HTTP proxy routes straight to an engine replica (one hop); the replica's ASGI app is vLLM's own
OpenAI server app. Start it with

    serve run serve_app.app:build_app env=local            # configs/base.yaml + configs/local.yaml
    serve run serve_app.app:build_app config=my.yaml       # one file (or several, comma-separated)

on any Ray cluster (RAY_ADDRESS), or with `headroom serve`.
"""

from __future__ import annotations

from typing import Any

from ray import serve
from ray.serve import Application

from serve_app.config import HeadroomConfig, load_config, load_env_config, parse_config
from serve_app.engine import build_openai_app, parse_serve_args, start_engine
from serve_app.engine_args import vllm_cli_args
from serve_app.metrics import ServingMetrics
from serve_app.model_files import resolve_models
from serve_app.serve_options import deployment_options


@serve.ingress()
class LLMServer:
    """A replica: one vLLM AsyncLLM engine and vLLM's OpenAI app bound to it."""

    async def __init__(self, config: dict[str, Any]):
        cfg = parse_config(config, source="deployment")
        # Resolved here, not on the driver: the replica's node has its own model cache.
        models = resolve_models(cfg)
        self._args = parse_serve_args(vllm_cli_args(cfg, models, cfg.engine.tensor_parallel_size or 1))
        ctx = serve.get_replica_context()
        self._metrics = ServingMetrics(
            {
                "application": ctx.app_name,
                "deployment": ctx.deployment,
                "replica": ctx.replica_tag,
                "model": cfg.served_model_name,
            }
        )
        self._engine = await start_engine(self._args, self._metrics)

    async def __serve_build_asgi_app__(self):
        return await build_openai_app(self._engine, self._args, self._metrics)

    async def check_health(self) -> None:
        # Raises once the engine core process is gone, so Serve replaces this replica.
        await self._engine.check_health()

    def __del__(self):
        engine = getattr(self, "_engine", None)
        if engine is not None:
            engine.shutdown()


def build_from_config(cfg: HeadroomConfig) -> Application:
    """The Serve application for a validated config. Checks the model files before anything is deployed."""
    resolve_models(cfg)
    options = deployment_options(cfg, cfg.engine.tensor_parallel_size or 1)
    deployment = serve.deployment(LLMServer).options(name="LLMServer", **options)
    return deployment.bind(cfg.model_dump(mode="json"))


def build_app(args: dict[str, str]) -> Application:
    """Application builder for `serve run serve_app.app:build_app env=<env>` or `config=<a.yaml,b.yaml>`."""
    if "config" in args:
        cfg = load_config(*args["config"].split(","))
    else:
        cfg = load_env_config(args.get("env", "local"))
    return build_from_config(cfg)
