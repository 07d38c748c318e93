"""vLLM glue: an AsyncLLM engine and vLLM's own OpenAI server app, built from `vllm serve` flags.

We build the FastAPI app with vLLM's `build_app` + `init_app_state`, the functions `vllm serve` itself
uses, so request validation, error JSON, streaming and every OpenAI route behave exactly as in vLLM. Only
three things differ from `vllm serve`: engine metrics go through Ray's metrics pipeline, vLLM's one
per-token histogram is left out unless the config asks for it (RayStatLoggerWithoutPerToken), and a request's
arrival is when the replica's HTTP server got it (vLLM's TTFT and latency histograms, and headroom's, which
a stat logger fills from the same per-step stats). The import paths below exist in vLLM 0.26
through 0.33 (0.32 moved the server into `vllm.entrypoints.launchers` and kept the old names).
"""

from __future__ import annotations

import argparse
import logging
import logging.handlers
import types
from collections.abc import AsyncGenerator, Iterator
from contextlib import contextmanager
from multiprocessing.connection import wait as wait_for_sentinels

from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.exceptions import VLLMValidationError
from vllm.usage.usage_lib import UsageContext
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm.v1.engine import FinishReason
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.metrics.loggers import StatLoggerBase
from vllm.v1.metrics.ray_wrappers import RayHistogramWrapper, RayPrometheusStatLogger

from serve_app.config.security import RequestLimits, SecuritySection
from serve_app.serving.asgi import ReplicaASGI, request_path
from serve_app.serving.metrics import EngineStep, ServingMetrics, request_started_at
from serve_app.serving.request_guard import Route, open_routes

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
    """AsyncLLM that applies the config's token limits, counts a request from its arrival at the replica's
    HTTP server, and can tell when its engine core process has died.

    It hands back vLLM's own output generator: a wrapper around it would resume once per generated token on
    the event loop that also streams every response (about 1 us a token, 2.6% of that loop's samples on an
    H200 at c=256, results/gpu/2026-12-04e/diag). TTFT and TPOT come from vLLM's per-step stats instead
    (engine_stats_logger).
    """

    request_limits: RequestLimits | None = None

    def generate(self, prompt, sampling_params, *args, **kwargs) -> AsyncGenerator:  # type: ignore[override]
        # A plain method, so that a prompt over the limit raises while vLLM's handler is still choosing its
        # response: a 400, even for a stream (an error inside the stream would follow a 200).
        if self.request_limits is not None:
            self._apply_limits(self.request_limits, prompt, sampling_params)
        arrive_at_http_start(prompt)
        return super().generate(prompt, sampling_params, *args, **kwargs)

    @staticmethod
    def _apply_limits(limits: RequestLimits, prompt, sampling_params) -> None:
        """Refuses a prompt over max_prompt_tokens (tokens are known only after the chat template) and caps
        the output of requests that did not ask for a length (a request that did was checked on arrival)."""
        if limits.max_prompt_tokens is not None:
            token_ids = prompt.get("prompt_token_ids") if isinstance(prompt, dict) else None
            token_ids = getattr(prompt, "prompt_token_ids", token_ids)
            if token_ids is not None and len(token_ids) > limits.max_prompt_tokens:
                param = "messages" if request_path.get() == "/v1/chat/completions" else "prompt"
                raise VLLMValidationError(
                    f"the prompt is {len(token_ids)} tokens; this server accepts at most "
                    f"{limits.max_prompt_tokens} (security.limits.max_prompt_tokens)",
                    parameter=param,
                    value=len(token_ids),
                )
        max_tokens = getattr(sampling_params, "max_tokens", None)
        if limits.max_tokens is not None and max_tokens is not None and max_tokens > limits.max_tokens:
            sampling_params.max_tokens = limits.max_tokens

    def _engine_core_processes(self) -> list:
        manager = getattr(self.engine_core.resources, "engine_manager", None)
        return list(getattr(manager, "processes", ()))

    def ended_engine_cores(self) -> dict[str, int | None]:
        """This engine's engine-core processes that have ended, with their exit codes where known.

        Read from each process's sentinel (a pipe that closes when it exits), not its exit code: in a Ray
        worker that ignores SIGCHLD (Ray's raylet-subreaper switch, which headroom's clusters leave off)
        children are reaped automatically, so their exit codes are never collected (None).
        """
        processes = self._engine_core_processes()
        ended = set(wait_for_sentinels([p.sentinel for p in processes], timeout=0))
        return {p.name: p.exitcode for p in processes if p.sentinel in ended}

    def wait_for_engine_core_exit(self) -> None:
        """Blocks until an engine-core process ends (run it in a thread)."""
        processes = self._engine_core_processes()
        if processes:
            wait_for_sentinels([p.sentinel for p in processes])

    def stop_dead_engine(self) -> None:
        """Marks the engine dead and fails the requests in flight with EngineDeadError (vLLM answers them
        with a 500), as vLLM's own monitor thread would have."""
        if not self.engine_core.resources.engine_dead:
            logger.error(
                "engine core process ended unexpectedly %s; shutting the engine down",
                self.ended_engine_cores(),
            )
            self.engine_core.resources.engine_dead = True
            self.engine_core.shutdown()

    async def check_health(self) -> None:
        """vLLM's check, after making sure a dead engine core is noticed.

        vLLM learns of a dead engine core from a monitor thread that marks the engine dead and fails the
        requests in flight. That thread can itself die: its process-tree kill races the reaping of the
        dead process and raises psutil.NoSuchProcess (seen with vLLM 0.32), after which requests hang and
        the engine looks healthy forever. Here the health check looks at the processes itself and, when
        one has ended, does what the monitor would have done.
        """
        if self.ended_engine_cores():
            self.stop_dead_engine()
        await super().check_health()


# vLLM's histograms observed once per generated token (the rest are per step or per request).
PER_TOKEN_HISTOGRAMS = frozenset({"vllm:inter_token_latency_seconds"})


class _Unexported:
    """Takes the place of a histogram that is not exported: accepts vLLM's calls and records nothing, and
    never registers a metric with Ray (so no empty series appears either)."""

    def labels(self, *args, **kwargs) -> _Unexported:
        return self

    def observe(self, value: float) -> None:
        pass


def _histogram_unless_per_token(name: str, *args, **kwargs):
    if name in PER_TOKEN_HISTOGRAMS:
        return _Unexported()
    return RayHistogramWrapper(name, *args, **kwargs)


class RayStatLoggerWithoutPerToken(RayPrometheusStatLogger):
    """vLLM's Ray stat logger without its per-token histograms. A Ray histogram observation costs several
    microseconds on the replica's event loop (results/stat_logger), and vLLM makes one per generated token
    for the inter-token latency: at GPU token rates that loop is what caps the replica's throughput."""

    _histogram_cls = staticmethod(_histogram_unless_per_token)  # type: ignore[assignment]


def arrive_at_http_start(prompt) -> None:
    """Dates a request's arrival (vLLM's renderer stamps it on the engine input, vLLM 0.26 - 0.33) to when the
    replica's HTTP server got it, so that vLLM's TTFT and e2e latency include what came before vLLM's
    handler: Ray Serve's path, headroom's checks and any wait for the event loop."""
    http_started = request_started_at.get()
    if http_started is not None and isinstance(prompt, dict):
        prompt["arrival_time"] = http_started


def engine_stats_logger(metrics: ServingMetrics) -> type[StatLoggerBase]:
    """A vLLM stat logger that feeds every engine step into headroom's metrics: each first token's TTFT and
    each finished request's TPOT and length (the histograms), and, for the autoscaler
    (autoscale/replica_stats.py), the scheduler's running/waiting/KV numbers and the step's prompt,
    generated and finished counts; each step also goes into the replica's step log (`engine_steps`)."""
    stats = metrics.window.engine

    class EngineStatsLogger(StatLoggerBase):
        def __init__(self, vllm_config, engine_index: int = 0):
            pass

        def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0):
            # vLLM sends the scheduler's state also without a step (iteration_stats None), e.g. the
            # zero running requests once the engine is idle.
            if iteration_stats is not None:
                for ttft_s in iteration_stats.time_to_first_tokens_iter:
                    metrics.first_token(ttft_s)
                for finished in iteration_stats.finished_requests:
                    if finished.finish_reason != FinishReason.ABORT:  # a client that left: no full TPOT
                        n = finished.num_generation_tokens
                        metrics.request_generated(finished.mean_time_per_output_token if n > 1 else None, n)
                at_s, prompt, generated = (
                    iteration_stats.iteration_timestamp,
                    iteration_stats.num_prompt_tokens,
                    iteration_stats.num_generation_tokens,
                )
                state = (stats.num_running, stats.num_waiting, stats.kv_cache_usage)  # before this step
                metrics.engine_steps.append(EngineStep(at_s, prompt, generated, *state))
                stats.record_step(
                    at_s,
                    prompt_tokens=prompt,
                    generation_tokens=generated,
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


@contextmanager
def serve_log_file_kept() -> Iterator[None]:
    """Keeps Ray Serve's replica log file (logs/serve/replica_*.log) written across vLLM's logging set-up.

    vLLM >= 0.32 configures logging when an engine is created (vLLM 0.26 at import, before Serve sets up the
    replica's logger) with a dictConfig, which first closes every handler in the process
    (logging.config._clearExistingHandlers). Serve writes the replica's file through a MemoryHandler on the
    `ray.serve` logger; closed, that handler drops its file handler, so the file got nothing more (not the
    access log, not "Finished initializing replica") and the handler's buffer kept every record it was given
    for the replica's life. Given its file handler back (which reopens the file), it writes what it buffered
    and all that follows."""
    handlers = logging.getLogger("ray.serve").handlers
    targets = [(h, h.target) for h in handlers if isinstance(h, logging.handlers.MemoryHandler)]
    try:
        yield
    finally:
        for handler, target in targets:
            if handler.target is None and target is not None:
                handler.setTarget(target)
                handler.flush()


async def start_engine(
    args: argparse.Namespace,
    metrics: ServingMetrics,
    limits: RequestLimits | None = None,
    inter_token_latency_histogram: bool = False,
) -> InstrumentedAsyncLLM:
    """Starts the engine as `vllm serve` would, with vLLM's metrics exported through Ray (its per-token
    histogram only when asked for: deployment.inter_token_latency_histogram)."""
    ray_logger = RayPrometheusStatLogger if inter_token_latency_histogram else RayStatLoggerWithoutPerToken
    with serve_log_file_kept():  # both calls configure vLLM's logging
        engine_args = AsyncEngineArgs.from_cli_args(args)
        vllm_config = engine_args.create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)
        engine = InstrumentedAsyncLLM.from_vllm_config(
            vllm_config=vllm_config,
            usage_context=UsageContext.OPENAI_API_SERVER,
            stat_loggers=[ray_logger, engine_stats_logger(metrics)],
            enable_log_requests=engine_args.enable_log_requests,
            disable_log_stats=engine_args.disable_log_stats,
        )
    engine.request_limits = limits
    return engine


def restrict_routes(app, routes: dict[str, Route], docs_open: bool) -> None:
    """Checks that every route headroom opens exists in vLLM's app (a vLLM upgrade may move one), and makes
    the OpenAPI document (/openapi.json, /docs) list only the routes that answer, so that what it
    advertises, and what a fuzzer generates from it, is what the replica serves."""
    missing = set(routes) - {getattr(route, "path", None) for route in app.routes}
    if missing:
        logger.warning("routes headroom opens that vLLM's app does not have: %s", sorted(missing))
    if not docs_open:
        return
    schema = app.openapi()
    schema["paths"] = {
        path: {m: op for m, op in ops.items() if m.upper() in routes[path].methods}
        for path, ops in schema.get("paths", {}).items()
        if path in routes
    }
    app.openapi_schema = schema


async def build_openai_app(
    engine: AsyncLLM,
    args: argparse.Namespace,
    metrics: ServingMetrics,
    security: SecuritySection,
    api_keys: list[str] | None = None,
    admission_bound: int | None = None,
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
    restrict_routes(app, open_routes(security), "docs" in security.optional_routes)
    return ReplicaASGI(app, metrics, security, api_keys, admission_bound)
