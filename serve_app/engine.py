"""vLLM glue: an AsyncLLM engine and vLLM's own OpenAI server app, built from `vllm serve` flags.

We build the FastAPI app with vLLM's `build_app` + `init_app_state`, the functions `vllm serve` itself
uses, so request validation, error JSON, streaming and every OpenAI route behave exactly as in vLLM. Only
two things differ from `vllm serve`: engine metrics go through Ray's metrics pipeline, and each finished
request's TTFT/TPOT are recorded for headroom's histograms. The import paths below exist in vLLM 0.26
through 0.33 (0.32 moved the server into `vllm.entrypoints.launchers` and kept the old names).
"""

from __future__ import annotations

import argparse
import types
from collections.abc import AsyncGenerator

from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.usage.usage_lib import UsageContext
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.metrics.ray_wrappers import RayPrometheusStatLogger

from serve_app.asgi import ReplicaASGI
from serve_app.metrics import ServingMetrics, request_started_at

try:  # vLLM >= 0.32
    from vllm.entrypoints.launchers.api_server.app_state import init_app_state
    from vllm.entrypoints.launchers.app import build_app
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
except ImportError:  # vLLM 0.26 - 0.31
    from vllm.entrypoints.openai.api_server import build_app, init_app_state  # type: ignore[no-redef]
    from vllm.entrypoints.openai.cli_args import (  # type: ignore[no-redef]
        make_arg_parser,
        validate_parsed_serve_args,
    )


def parse_serve_args(flags: list[str]) -> argparse.Namespace:
    """Parses `vllm serve` flags with vLLM's own parser (so defaults and validation are vLLM's)."""
    parser = make_arg_parser(FlexibleArgumentParser(prog="headroom-replica"))
    args = parser.parse_args(flags)
    validate_parsed_serve_args(args)
    return args


class InstrumentedAsyncLLM(AsyncLLM):
    """AsyncLLM that reports each finished request's TTFT, TPOT and token count to headroom's metrics.

    It reads the timestamps the engine already keeps on every output (RequestOutput.metrics), so there is
    no per-token work here, and it works alike for streaming and non-streaming requests.
    """

    serving_metrics: ServingMetrics | None = None

    async def generate(self, *args, **kwargs) -> AsyncGenerator:  # type: ignore[override]
        http_started = request_started_at.get()
        async for output in super().generate(*args, **kwargs):
            if output.finished and self.serving_metrics is not None:
                self._record(output, http_started)
            yield output

    def _record(self, output, http_started: float | None) -> None:
        stats = output.metrics
        if stats is None or not stats.num_generation_tokens:
            return
        # arrival_time is wall clock; the first/last token stamps are engine-core monotonic clock.
        start = http_started if http_started is not None else stats.arrival_time
        ttft = stats.arrival_time - start + stats.first_token_latency
        n = stats.num_generation_tokens
        tpot = (stats.last_token_ts - stats.first_token_ts) / (n - 1) if n > 1 else None
        self.serving_metrics.tokens_generated(ttft, tpot, n)


async def start_engine(args: argparse.Namespace, metrics: ServingMetrics | None) -> InstrumentedAsyncLLM:
    """Starts the engine as `vllm serve` would, with vLLM's metrics exported through Ray."""
    engine_args = AsyncEngineArgs.from_cli_args(args)
    vllm_config = engine_args.create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)
    engine = InstrumentedAsyncLLM.from_vllm_config(
        vllm_config=vllm_config,
        usage_context=UsageContext.OPENAI_API_SERVER,
        stat_loggers=[RayPrometheusStatLogger],
        enable_log_requests=engine_args.enable_log_requests,
        disable_log_stats=engine_args.disable_log_stats,
    )
    engine.serving_metrics = metrics
    return engine


async def build_openai_app(
    engine: AsyncLLM, args: argparse.Namespace, metrics: ServingMetrics
) -> ReplicaASGI:
    """vLLM's OpenAI-compatible app bound to `engine`, wrapped in headroom's ASGI layer.

    Wrapped rather than `add_middleware`d: vLLM's build_app has already built the middleware stack.
    """
    supported_tasks = await engine.get_supported_tasks()
    app = build_app(args, supported_tasks, engine.model_config)
    await init_app_state(engine, app.state, args, supported_tasks)
    # vLLM's engine-error handler asks the uvicorn server to exit once the engine is dead. A replica has
    # no server of its own: the flag is ignored, and Serve's health check (check_health) replaces the
    # replica instead.
    app.state.server = types.SimpleNamespace(should_exit=False)
    return ReplicaASGI(app, metrics)
