"""vLLM glue: an AsyncLLM engine and vLLM's own OpenAI server app, built from `vllm serve` flags.

We build the FastAPI app with vLLM's `build_app` + `init_app_state`, the functions `vllm serve` itself
uses, so request validation, error JSON, streaming and every OpenAI route behave exactly as in vLLM. Only
two things differ from `vllm serve`: engine metrics go through Ray's metrics pipeline, and each finished
request's TTFT/TPOT are recorded for headroom's histograms. The import paths below exist in vLLM 0.26
through 0.33 (0.32 moved the server into `vllm.entrypoints.launchers` and kept the old names).
"""

from __future__ import annotations

import argparse
import logging
import types
from collections.abc import AsyncGenerator
from multiprocessing.connection import wait as wait_for_sentinels

from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.usage.usage_lib import UsageContext
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.metrics.loggers import StatLoggerBase
from vllm.v1.metrics.ray_wrappers import RayPrometheusStatLogger

from autoscale.replica_stats import EngineStats
from serve_app.serving.asgi import ReplicaASGI
from serve_app.serving.metrics import ServingMetrics, request_started_at

logger = logging.getLogger(__name__)

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
    no per-token work here, and it works alike for streaming and non-streaming requests (where the first
    output is the last, so TTFT is recorded when the request finishes).
    """

    serving_metrics: ServingMetrics | None = None

    async def generate(self, *args, **kwargs) -> AsyncGenerator:  # type: ignore[override]
        http_started = request_started_at.get()
        first_token_seen = False
        async for output in super().generate(*args, **kwargs):
            stats = output.metrics
            if self.serving_metrics is not None and stats is not None and stats.num_generation_tokens:
                # arrival_time is wall clock, first/last token stamps are the engine core's monotonic clock.
                if not first_token_seen:
                    first_token_seen = True
                    start = http_started if http_started is not None else stats.arrival_time
                    self.serving_metrics.first_token(stats.arrival_time - start + stats.first_token_latency)
                if output.finished:
                    n = stats.num_generation_tokens
                    tpot = (stats.last_token_ts - stats.first_token_ts) / (n - 1) if n > 1 else None
                    self.serving_metrics.request_generated(tpot, n)
            yield output

    def ended_engine_cores(self) -> dict[str, int | None]:
        """This engine's engine-core processes that have ended, with their exit codes where known.

        Read from each process's sentinel (a pipe that closes when it exits), not its exit code: in a Ray
        worker children are reaped automatically, so their exit codes are never collected (None).
        """
        manager = getattr(self.engine_core.resources, "engine_manager", None)
        processes = list(getattr(manager, "processes", ()))
        ended = set(wait_for_sentinels([p.sentinel for p in processes], timeout=0))
        return {p.name: p.exitcode for p in processes if p.sentinel in ended}

    async def check_health(self) -> None:
        """vLLM's check, after making sure a dead engine core is noticed.

        vLLM learns of a dead engine core from a monitor thread that marks the engine dead and fails the
        requests in flight. That thread can itself die: its process-tree kill races the reaping of the
        dead process and raises psutil.NoSuchProcess (seen with vLLM 0.32), after which requests hang and
        the engine looks healthy forever. Here the health check looks at the processes itself and, when
        one has ended, does what the monitor would have done.
        """
        ended = self.ended_engine_cores()
        if ended and not self.engine_core.resources.engine_dead:
            logger.error("engine core process ended unexpectedly %s; shutting the engine down", ended)
            self.engine_core.resources.engine_dead = True
            self.engine_core.shutdown()  # fails the requests in flight with EngineDeadError
        await super().check_health()


def engine_stats_logger(stats: EngineStats) -> type[StatLoggerBase]:
    """A vLLM stat logger that feeds every engine step into `stats` (autoscale/replica_stats.py): the
    scheduler's running/waiting/KV numbers and the step's prompt, generated and finished counts."""

    class EngineStatsLogger(StatLoggerBase):
        def __init__(self, vllm_config, engine_index: int = 0):
            pass

        def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0):
            # vLLM sends the scheduler's state also without a step (iteration_stats None), e.g. the
            # zero running requests once the engine is idle.
            if iteration_stats is not None:
                stats.record_step(
                    iteration_stats.iteration_timestamp,
                    prompt_tokens=iteration_stats.num_prompt_tokens,
                    generation_tokens=iteration_stats.num_generation_tokens,
                    finished=len(iteration_stats.finished_requests),
                )
            if scheduler_stats is not None:
                stats.record_scheduler(
                    num_running=scheduler_stats.num_running_reqs,
                    num_waiting=scheduler_stats.num_waiting_reqs,
                    kv_cache_usage=scheduler_stats.kv_cache_usage,
                )

        def log_engine_initialized(self):
            pass

    return EngineStatsLogger


async def start_engine(args: argparse.Namespace, metrics: ServingMetrics) -> InstrumentedAsyncLLM:
    """Starts the engine as `vllm serve` would, with vLLM's metrics exported through Ray."""
    engine_args = AsyncEngineArgs.from_cli_args(args)
    vllm_config = engine_args.create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)
    engine = InstrumentedAsyncLLM.from_vllm_config(
        vllm_config=vllm_config,
        usage_context=UsageContext.OPENAI_API_SERVER,
        stat_loggers=[RayPrometheusStatLogger, engine_stats_logger(metrics.window.engine)],
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
