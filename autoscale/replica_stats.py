"""What each replica reports to the autoscaler (Ray Serve's `record_autoscaling_stats`), computed here.

Pure: a sliding window of first-token latencies and arrivals, the engine's latest scheduler numbers, and
cumulative engine-step counters (steps, busy seconds, tokens, finished requests) that the report turns
into rates over the window. Time is passed in, so the window is tested without a clock. The key names are
the contract with the policy (autoscale/policy.py reads a report with ``ReplicaMetrics.from_report``); the
simulator's replicas fill the same window, so the policy sees the same numbers in replay as live.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

TTFT_P50_MS = "ttft_p50_ms"
TTFT_P95_MS = "ttft_p95_ms"
TTFT_SAMPLES = "ttft_samples"
ARRIVAL_RATE_RPS = "arrival_rate_rps"
REFUSED_RATE_RPS = "refused_rate_rps"
NUM_REQUESTS_RUNNING = "num_requests_running"
NUM_REQUESTS_WAITING = "num_requests_waiting"
KV_CACHE_USAGE = "kv_cache_usage"
FINISHED_RPS = "finished_rps"
ENGINE_STEPS_PER_S = "engine_steps_per_s"
ENGINE_BUSY_FRACTION = "engine_busy_fraction"
PROMPT_TOKENS_PER_S = "prompt_tokens_per_s"
GENERATION_TOKENS_PER_S = "generation_tokens_per_s"
DECODE_STEP_FLOOR_MS = "decode_step_floor_ms"
TAKEN_AT_S = "taken_at_s"

LIGHT_DECODE_BATCH = 4
"""Decode-only steps of at most this many sequences time the engine's fixed per-step cost."""
_FLOOR_EWMA = 0.1


@dataclass
class EngineStats:
    """The engine's latest scheduler state plus counters since the replica started, updated every step.

    Live, the engine's stat logger calls :meth:`record_step` for every engine step (vLLM's IterationStats)
    and :meth:`record_scheduler` whenever the scheduler reports (SchedulerStats); the simulator keeps the
    same counters itself.
    """

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    steps: int = 0
    busy_s: float = 0.0
    """Seconds the engine spent in steps: gaps between steps with requests running."""
    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished: int = 0
    decode_step_floor_ms: float = -1.0
    """Mean duration of light decode-only steps (<= LIGHT_DECODE_BATCH sequences), an EWMA; -1 unknown."""
    last_step_s: float | None = None

    def record_step(self, now_s: float, *, prompt_tokens: int, generation_tokens: int, finished: int) -> None:
        """One engine step whose outputs arrived at ``now_s``. The gap since the previous step counts as
        busy time only if requests were running then (an idle engine takes no steps)."""
        if self.last_step_s is not None and self.num_running > 0:
            gap_s = max(0.0, now_s - self.last_step_s)
            self.busy_s += gap_s
            if prompt_tokens == 0 and 0 < generation_tokens <= LIGHT_DECODE_BATCH:
                self.observe_decode_floor(gap_s * 1000.0)
        self.last_step_s = now_s
        self.steps += 1
        self.prompt_tokens += prompt_tokens
        self.generation_tokens += generation_tokens
        self.finished += finished

    def record_scheduler(self, *, num_running: int, num_waiting: int, kv_cache_usage: float) -> None:
        """The scheduler's state after a step (vLLM also sends it without a step, e.g. once idle)."""
        self.num_running, self.num_waiting, self.kv_cache_usage = num_running, num_waiting, kv_cache_usage

    def observe_decode_floor(self, step_ms: float) -> None:
        old = self.decode_step_floor_ms
        self.decode_step_floor_ms = step_ms if old < 0 else old + _FLOOR_EWMA * (step_ms - old)


@dataclass(frozen=True, slots=True)
class _Counters:
    at_s: float
    steps: int
    busy_s: float
    prompt_tokens: int
    generation_tokens: int
    finished: int


class ReplicaStatsWindow:
    """First-token latencies and request arrivals over the last `window_s` seconds, plus engine rates."""

    def __init__(self, window_s: float):
        self.window_s = window_s
        self._ttfts: deque[tuple[float, float]] = deque()  # (time_s, ttft_ms)
        self._arrivals: deque[float] = deque()
        self._refusals: deque[float] = deque()
        self._counters: deque[_Counters] = deque()
        self.engine = EngineStats()

    def _prune(self, now_s: float) -> None:
        horizon = now_s - self.window_s
        while self._ttfts and self._ttfts[0][0] < horizon:
            self._ttfts.popleft()
        while self._arrivals and self._arrivals[0] < horizon:
            self._arrivals.popleft()
        while self._refusals and self._refusals[0] < horizon:
            self._refusals.popleft()
        # Keep the newest counter snapshot at or before the horizon: rates span the whole window.
        while len(self._counters) > 1 and self._counters[1].at_s <= horizon:
            self._counters.popleft()

    def request_arrived(self, now_s: float) -> None:
        self._arrivals.append(now_s)

    def request_refused(self, now_s: float) -> None:
        """An arrival refused at the replica's queue bound (503/429 + Retry-After): its client may send
        it again, so the policy does not count each attempt as a new request."""
        self._refusals.append(now_s)

    def first_token(self, now_s: float, ttft_ms: float) -> None:
        self._ttfts.append((now_s, ttft_ms))

    def _engine_rates(self, now_s: float) -> dict[str, float]:
        e = self.engine
        now = _Counters(now_s, e.steps, e.busy_s, e.prompt_tokens, e.generation_tokens, e.finished)
        old = self._counters[0] if self._counters else now
        self._counters.append(now)
        span_s = now_s - old.at_s
        if span_s <= 0:
            return dict.fromkeys(
                (
                    FINISHED_RPS,
                    ENGINE_STEPS_PER_S,
                    ENGINE_BUSY_FRACTION,
                    PROMPT_TOKENS_PER_S,
                    GENERATION_TOKENS_PER_S,
                ),
                -1.0,
            )
        return {
            FINISHED_RPS: (now.finished - old.finished) / span_s,
            ENGINE_STEPS_PER_S: (now.steps - old.steps) / span_s,
            ENGINE_BUSY_FRACTION: min(1.0, (now.busy_s - old.busy_s) / span_s),
            PROMPT_TOKENS_PER_S: (now.prompt_tokens - old.prompt_tokens) / span_s,
            GENERATION_TOKENS_PER_S: (now.generation_tokens - old.generation_tokens) / span_s,
        }

    def report(self, now_s: float) -> dict[str, float]:
        """The numbers for `record_autoscaling_stats`. Percentiles are -1 when no request got its first
        token in the window, engine rates -1 on the first report (Serve's stats are plain numbers, so
        'none' is encoded)."""
        self._prune(now_s)
        ttfts = [t for _, t in self._ttfts]
        # numpy's percentile (linear interpolation): the one definition the simulator and loadtests use.
        p50, p95 = np.percentile(ttfts, [50.0, 95.0]).tolist() if ttfts else (-1.0, -1.0)
        return {
            TTFT_P50_MS: p50,
            TTFT_P95_MS: p95,
            TTFT_SAMPLES: float(len(ttfts)),
            # Over the whole window even for a younger replica: the fleet's rate is the sum of these.
            ARRIVAL_RATE_RPS: len(self._arrivals) / self.window_s,
            REFUSED_RATE_RPS: len(self._refusals) / self.window_s,
            NUM_REQUESTS_RUNNING: float(self.engine.num_running),
            NUM_REQUESTS_WAITING: float(self.engine.num_waiting),
            KV_CACHE_USAGE: float(self.engine.kv_cache_usage),
            **self._engine_rates(now_s),
            DECODE_STEP_FLOOR_MS: self.engine.decode_step_floor_ms,
            TAKEN_AT_S: now_s,
        }
