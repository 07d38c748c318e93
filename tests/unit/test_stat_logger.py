"""The replica's vLLM stat loggers: vLLM's without its per-token histogram, and headroom's, which feeds
TTFT, TPOT and the autoscaler's counters from vLLM's per-step stats."""

from __future__ import annotations

import types

from vllm.v1.engine import FinishReason
from vllm.v1.metrics.ray_wrappers import RayHistogramWrapper
from vllm.v1.metrics.stats import FinishedRequestStats, IterationStats, SchedulerStats

from autoscale.replica_stats import EngineStats
from serve_app.serving.engine import (
    PER_TOKEN_HISTOGRAMS,
    RayStatLoggerWithoutPerToken,
    arrive_at_http_start,
    engine_stats_logger,
)
from serve_app.serving.metrics import EngineStep, request_started_at


def make(name: str):
    return RayStatLoggerWithoutPerToken._histogram_cls(
        name=name, documentation="test", buckets=[0.01, 0.1], labelnames=["model_name", "engine"]
    )


def test_the_per_token_histogram_records_nothing_and_registers_nothing() -> None:
    assert {"vllm:inter_token_latency_seconds"} == PER_TOKEN_HISTOGRAMS
    itl = make("vllm:inter_token_latency_seconds")
    child = itl.labels("tiny", "0")  # vLLM makes one child per engine and observes through it
    assert not isinstance(child, RayHistogramWrapper)
    assert not hasattr(child, "metric")  # no Ray metric behind it
    assert child.observe(0.005) is None


def test_every_other_histogram_is_vllms_ray_histogram() -> None:
    for name in ("vllm:request_time_per_output_token_seconds", "vllm:time_to_first_token_seconds"):
        histogram = make(name)
        assert isinstance(histogram, RayHistogramWrapper)
        assert histogram.metric._name == name.replace(":", "_")


class RecordedMetrics:
    """What the stat logger hands headroom's metrics (ServingMetrics' two per-request methods)."""

    def __init__(self) -> None:
        self.window = types.SimpleNamespace(engine=EngineStats())
        self.engine_steps: list[EngineStep] = []
        self.ttfts: list[float] = []
        self.generated: list[tuple[float | None, int]] = []

    def first_token(self, ttft_s: float) -> None:
        self.ttfts.append(ttft_s)

    def request_generated(self, tpot_s: float | None, output_tokens: int) -> None:
        self.generated.append((tpot_s, output_tokens))


def finished(reason: FinishReason, tokens: int, tpot_s: float) -> FinishedRequestStats:
    return FinishedRequestStats(
        finish_reason=reason, num_generation_tokens=tokens, mean_time_per_output_token=tpot_s
    )


def test_headroom_histograms_come_from_vllms_step_stats() -> None:
    metrics = RecordedMetrics()
    logger = engine_stats_logger(metrics)(vllm_config=None)
    step = IterationStats()
    step.time_to_first_tokens_iter = [0.12, 0.34]
    step.finished_requests = [
        finished(FinishReason.LENGTH, 20, 0.01),
        finished(FinishReason.STOP, 1, 0.0),  # one token: no TPOT
        finished(FinishReason.ABORT, 7, 0.02),  # its client left: not a whole request
    ]
    logger.record(scheduler_stats=None, iteration_stats=step)
    assert metrics.ttfts == [0.12, 0.34]
    assert metrics.generated == [(0.01, 20), (None, 1)]
    assert metrics.window.engine.finished == 3  # the autoscaler's counters still see every step
    logger.record(scheduler_stats=None, iteration_stats=None)  # the scheduler's state alone: no request
    assert len(metrics.ttfts) == 2


def test_each_step_is_logged_with_the_scheduler_state_it_started_from() -> None:
    metrics = RecordedMetrics()
    logger = engine_stats_logger(metrics)(vllm_config=None)
    first, second = IterationStats(), IterationStats()
    first.iteration_timestamp, first.prompt_token_stats.total, first.num_generation_tokens = 100.0, 1024, 1
    second.iteration_timestamp, second.prompt_token_stats.total, second.num_generation_tokens = 100.03, 512, 7
    after_first = SchedulerStats(num_running_reqs=7, num_waiting_reqs=2, kv_cache_usage=0.25)
    logger.record(scheduler_stats=after_first, iteration_stats=first)
    logger.record(scheduler_stats=None, iteration_stats=None)  # a report without a step logs nothing
    logger.record(scheduler_stats=None, iteration_stats=second)
    assert metrics.engine_steps == [
        EngineStep(100.0, 1024, 1, 0, 0, 0.0),  # the engine was idle before its first step
        EngineStep(100.03, 512, 7, 7, 2, 0.25),
    ]


def test_a_request_arrives_when_the_replica_got_it() -> None:
    rendered = {"type": "token", "prompt_token_ids": [1, 2], "arrival_time": 200.0}
    arrive_at_http_start(rendered)  # outside a request (no HTTP start): vLLM's own stamp stays
    assert rendered["arrival_time"] == 200.0
    token = request_started_at.set(199.5)
    try:
        arrive_at_http_start(rendered)
    finally:
        request_started_at.reset(token)
    assert rendered["arrival_time"] == 199.5
