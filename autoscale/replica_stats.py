"""What each replica reports to the autoscaler (Ray Serve's `record_autoscaling_stats`), computed here.

Pure: a sliding window of first-token latencies and arrivals, plus the engine's latest scheduler numbers.
Time is passed in, so the window is tested without a clock. The key names are the contract with the
policy adapter (autoscale/ray_policy.py).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

TTFT_P50_MS = "ttft_p50_ms"
TTFT_P95_MS = "ttft_p95_ms"
TTFT_SAMPLES = "ttft_samples"
ARRIVAL_RATE_RPS = "arrival_rate_rps"
NUM_REQUESTS_RUNNING = "num_requests_running"
NUM_REQUESTS_WAITING = "num_requests_waiting"
KV_CACHE_USAGE = "kv_cache_usage"
TAKEN_AT_S = "taken_at_s"


def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile of already sorted values, q in (0, 100]."""
    rank = max(1, math.ceil(q / 100 * len(sorted_values)))
    return sorted_values[rank - 1]


@dataclass
class SchedulerSnapshot:
    """The engine scheduler's latest state (vLLM's SchedulerStats), updated every engine step."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0


class ReplicaStatsWindow:
    """First-token latencies and request arrivals over the last `window_s` seconds."""

    def __init__(self, window_s: float):
        self.window_s = window_s
        self._ttfts: deque[tuple[float, float]] = deque()  # (time_s, ttft_ms)
        self._arrivals: deque[float] = deque()
        self._started_s: float | None = None
        self.scheduler = SchedulerSnapshot()

    def _prune(self, now_s: float) -> None:
        horizon = now_s - self.window_s
        while self._ttfts and self._ttfts[0][0] < horizon:
            self._ttfts.popleft()
        while self._arrivals and self._arrivals[0] < horizon:
            self._arrivals.popleft()

    def request_arrived(self, now_s: float) -> None:
        if self._started_s is None:
            self._started_s = now_s
        self._arrivals.append(now_s)

    def first_token(self, now_s: float, ttft_ms: float) -> None:
        self._ttfts.append((now_s, ttft_ms))

    def report(self, now_s: float) -> dict[str, float]:
        """The numbers for `record_autoscaling_stats`. Percentiles are -1 when no request got its first
        token in the window (Serve's stats are plain numbers, so 'none' is encoded)."""
        self._prune(now_s)
        ttfts = sorted(t for _, t in self._ttfts)
        # A replica younger than the window has seen arrivals for less than window_s.
        observed_s = self.window_s if self._started_s is None else min(self.window_s, now_s - self._started_s)
        return {
            TTFT_P50_MS: percentile(ttfts, 50) if ttfts else -1.0,
            TTFT_P95_MS: percentile(ttfts, 95) if ttfts else -1.0,
            TTFT_SAMPLES: float(len(ttfts)),
            ARRIVAL_RATE_RPS: len(self._arrivals) / max(observed_s, 1.0),
            NUM_REQUESTS_RUNNING: float(self.scheduler.num_running),
            NUM_REQUESTS_WAITING: float(self.scheduler.num_waiting),
            KV_CACHE_USAGE: float(self.scheduler.kv_cache_usage),
            TAKEN_AT_S: now_s,
        }
