"""headroom's own serving metrics, defined once.

They go through Ray's metrics pipeline (ray.util.metrics), like vLLM's engine metrics in our replicas
(vLLM's RayPrometheusStatLogger) and Ray Serve's own: every node's metrics agent exports them for
Prometheus with the replica's tags, so a deployment's histograms aggregate across replicas and nodes.
Ray prefixes the exported names with `ray_`.

TTFT is measured from the moment the request reached the replica's HTTP app to the first generated token,
so it includes tokenization and chat templating; TPOT is (last token - first token) / (tokens - 1), the
same definition `vllm bench serve` uses for TPOT.
"""

from __future__ import annotations

import contextvars
import time
from collections import deque
from collections.abc import Iterable
from typing import NamedTuple

from autoscale.replica_stats import ReplicaStatsWindow

TTFT_SECONDS = "headroom_ttft_seconds"
TPOT_SECONDS = "headroom_tpot_seconds"
E2E_SECONDS = "headroom_e2e_latency_seconds"
OUTPUT_TOKENS = "headroom_output_tokens"
REQUESTS_IN_FLIGHT = "headroom_requests_in_flight"
REQUESTS_TOTAL = "headroom_requests_total"

# The generation endpoints whose requests are timed.
TIMED_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})

LATENCY_BUCKETS_S = [0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1, 1.5, 2, 3, 5, 7.5, 10, 20, 30, 60]
TPOT_BUCKETS_S = [0.001, 0.002, 0.005, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2]
TOKEN_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192]

ENGINE_STEP_LOG = 16_384
"""Engine steps a replica keeps (about 3.5 MB, 2 us an append here): a calibration loop (at most ~2,000 steps)
or 90 s of replay at an H100's lightest-load step rate (~150 steps/s) fits; older steps drop out."""


class EngineStep(NamedTuple):
    """One engine step as vLLM's stat logger saw it: when its outputs reached the replica (wall clock), its
    prompt tokens (vLLM counts a prompt whole, cached tokens included, in the step that completes its
    prefill) and generated tokens, and the scheduler's state it started from (the report after the step
    before). While the engine is busy, the gap to the previous step is its duration, give or take how late
    each report arrived (autoscale/step_log.py sums them over windows)."""

    at_s: float
    prompt_tokens: int
    generation_tokens: int
    num_running: int
    num_waiting: int
    kv_cache_usage: float


# Wall-clock time at which the current request entered the replica's HTTP app.
request_started_at: contextvars.ContextVar[float | None] = contextvars.ContextVar(
    "headroom_request_started_at", default=None
)


class ServingMetrics:
    """The replica's measurements: Prometheus metrics (tag values fixed at construction) and the sliding
    window the autoscaler reads through `record_autoscaling_stats`."""

    def __init__(self, tags: dict[str, str], window: ReplicaStatsWindow):
        from ray.util import metrics

        self.window = window
        keys = tuple(tags)

        def histogram(name: str, description: str, buckets: Iterable[float]):
            h = metrics.Histogram(name, description=description, boundaries=list(buckets), tag_keys=keys)
            h.set_default_tags(tags)
            return h

        self.ttft_s = histogram(
            TTFT_SECONDS, "Time to first token, from arrival at the replica.", LATENCY_BUCKETS_S
        )
        self.tpot_s = histogram(TPOT_SECONDS, "Time per output token after the first.", TPOT_BUCKETS_S)
        self.e2e_s = histogram(
            E2E_SECONDS, "Request latency at the replica, to the last byte.", LATENCY_BUCKETS_S
        )
        self.output_tokens = histogram(OUTPUT_TOKENS, "Generated tokens per request.", TOKEN_BUCKETS)
        self.in_flight = metrics.Gauge(
            REQUESTS_IN_FLIGHT, description="Generation requests being served by the replica.", tag_keys=keys
        )
        self.in_flight.set_default_tags(tags)
        self.requests = metrics.Counter(
            REQUESTS_TOTAL, description="Generation requests by HTTP status.", tag_keys=(*keys, "status")
        )
        self.requests.set_default_tags(tags)
        self._in_flight = 0
        self.engine_steps: deque[EngineStep] = deque(maxlen=ENGINE_STEP_LOG)

    def request_started(self) -> None:
        self._in_flight += 1
        self.in_flight.set(self._in_flight)
        self.window.request_arrived(time.time())

    def request_refused(self) -> None:
        """Refused at the queue bound (its client may send it again): the autoscaler counts it once."""
        self.window.request_refused(time.time())

    def request_finished(self, started_s: float, status: int) -> None:
        self._in_flight -= 1
        self.in_flight.set(self._in_flight)
        self.e2e_s.observe(time.time() - started_s)
        self.requests.inc(tags={"status": str(status)})

    def first_token(self, ttft_s: float) -> None:
        self.ttft_s.observe(ttft_s)
        self.window.first_token(time.time(), ttft_s * 1000)

    def request_generated(self, tpot_s: float | None, output_tokens: int) -> None:
        if tpot_s is not None:
            self.tpot_s.observe(tpot_s)
        self.output_tokens.observe(output_tokens)
