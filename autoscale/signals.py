"""The signals one decision reads, measured once from a snapshot, the rate history and the capacity.

Pure: arithmetic on the snapshot; autoscale/policy.py decides from the result.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass

from autoscale.capacity import ServiceEstimate
from autoscale.inputs import MetricsSnapshot, PolicyConfig, ReplicaMetrics

__all__ = ["Signals", "fleet_ttft_p95", "measure", "rate_history", "surge_headroom", "watched_s"]

_TTFT_MAX_FACTOR = 2.0
"""A TTFT-driven scale-up at most doubles the serving replicas in one decision (then ``max_step_up``)."""
_NOISE_Z = 2.0
"""Demand is sized from the arrival rate less this many Poisson standard errors of its window: a steady
load's counting noise (2% at 200 requests/s over 10 s) must not add a replica that the scale-down then
takes away again (the flapping seen on constant load in the simulator)."""


@dataclass(frozen=True, slots=True)
class Signals:
    ttft_target_ms: float
    ttft_p95_ms: float | None
    in_flight: int
    kv_max: float
    rate_rps: float | None
    slope_rps_per_s: float
    projected_rps: float
    peak_rps: float
    """Highest trend-window mean arrival rate over the last downscale_sustain_s."""
    startup_s: float
    service: ServiceEstimate | None
    replica_s_per_request: float | None
    """Replica-seconds one request needs at the target utilizations; None when no capacity is known."""
    surge_rps: float
    """Arrival rate kept in hand above the demand for a surge (:func:`surge_headroom`)."""
    max_surge_share: float
    """At most this share of the demand is kept for surges (``max_surge_headroom``)."""
    planned_sequences: float
    rising: bool
    """Arrivals grow along a significant trend (the spare replicas apply only then)."""
    need_demand: int
    need_queue: int
    need_ttft: int
    need_kv: int

    @property
    def headroom(self) -> float | None:
        return None if self.ttft_p95_ms is None else 1.0 - self.ttft_p95_ms / self.ttft_target_ms

    def with_surge(self, rate_rps: float) -> float:
        """``rate_rps`` plus what is kept in hand for a surge (at most ``max_surge_share`` of it)."""
        return _with_surge(rate_rps, self.surge_rps, self.max_surge_share)

    def details(self) -> dict[str, float | int | str | None]:
        svc = self.service
        return {
            "ttft_p95_ms": _round(self.ttft_p95_ms),
            "headroom": _round(self.headroom, 3),
            "in_flight": self.in_flight,
            "kv_cache_usage_max": _round(self.kv_max, 3),
            "arrival_rate_rps": _round(self.rate_rps, 2),
            "trend_rps_per_s": _round(self.slope_rps_per_s, 4),
            "projected_rate_rps": _round(self.projected_rps, 2),
            "peak_rate_rps": _round(self.peak_rps, 2),
            "capacity_rps": None
            if self.replica_s_per_request is None
            else round(1 / self.replica_s_per_request, 2),
            "capacity_source": None if svc is None else svc.source,
            "step_ms": None if svc is None else round(svc.step_ms, 3),
            "work_ms_per_request": None if svc is None else round(svc.work_ms_per_request, 3),
            "surge_rps": round(self.surge_rps, 2),
            "need_demand": self.need_demand,
            "need_queue": self.need_queue,
            "need_ttft": self.need_ttft,
            "need_kv": self.need_kv,
        }

    def describe(self) -> str:
        parts = []
        if self.ttft_p95_ms is not None and self.headroom is not None:
            parts.append(
                f"TTFT p95 {self.ttft_p95_ms:.0f} ms vs target {self.ttft_target_ms:.0f} ms "
                f"(headroom {self.headroom:.0%})"
            )
        else:
            parts.append("no TTFT samples in the window")
        if self.rate_rps is not None:
            text = f"arrivals {self.rate_rps:.1f} rps"
            if self.projected_rps > self.rate_rps + 1e-9:
                text += f", {self.projected_rps:.1f} rps projected {self.startup_s:.0f} s ahead"
            if self.replica_s_per_request is not None and self.service is not None:
                text += (
                    f" (needs {self.need_demand} at {1 / self.replica_s_per_request:.1f} rps each, "
                    f"{self.surge_rps:.1f} rps kept for surges, capacity {self.service.source})"
                )
            parts.append(text)
        parts.append(
            f"{self.in_flight} in flight (needs {self.need_queue} at {self.planned_sequences:.0f} each)"
        )
        return "; ".join(parts)


def _round(value: float | None, digits: int = 1) -> float | None:
    return None if value is None else round(value, digits)


def _ceil(x: float) -> int:
    # Tolerate float noise: 3.0000000001 replicas is 3.
    return max(0, math.ceil(x - 1e-9))


def fleet_ttft_p95(replicas: Sequence[ReplicaMetrics]) -> float | None:
    """Sample-weighted mean of per-replica p95s (each replica weighs at least 1)."""
    total_w = acc = 0.0
    for r in replicas:
        if r.ttft_p95_ms is None:
            continue
        w = float(max(1, r.ttft_samples))
        acc += w * r.ttft_p95_ms
        total_w += w
    return acc / total_w if total_w else None


def rate_history(
    history: tuple[tuple[float, float], ...], snapshot: MetricsSnapshot, keep_s: float, retries: int
) -> tuple[tuple[float, float], ...]:
    """``history`` with this snapshot's request rate (refused attempts counted once: ``retries``)
    appended, once per report (a point is the time the reports were taken), and points older than
    ``keep_s`` dropped."""
    rate = snapshot.offered_rate_rps(retries)
    if rate is None or (history and history[-1][0] >= snapshot.taken_at_s):
        return history
    keep_from = snapshot.taken_at_s - keep_s - 1e-9
    kept = tuple(p for p in history if p[0] >= keep_from)
    return (*kept, (snapshot.taken_at_s, float(rate)))


def surge_headroom(history: Sequence[tuple[float, float]], now_s: float, cfg: PolicyConfig) -> float:
    """The largest rise of the arrival rate (requests/s) from one replica_startup_s to the next over the
    last surge_lookback_s, less three Poisson standard errors of that difference: the rate kept in hand
    for a surge like it, which would arrive before new replicas serve. Absolute, not a share: a rise from
    a trough is a large share of a small rate. Means over whole start-up lengths keep noise small."""
    s = cfg.settings
    span_s = s.replica_startup_s
    if s.surge_lookback_s <= 0 or len(history) < 3:
        return 0.0
    times = [t for t, _ in history]
    sums = [0.0]
    for _, r in history:
        sums.append(sums[-1] + r)

    def mean(lo_s: float, hi_s: float) -> float | None:
        i, j = bisect.bisect_right(times, lo_s), bisect.bisect_right(times, hi_s)
        return (sums[j] - sums[i]) / (j - i) if j > i else None

    best = 0.0
    for t in times:
        if t < now_s - s.surge_lookback_s or t - 2 * span_s < times[0]:
            continue
        after, before = mean(t - span_s, t), mean(t - 2 * span_s, t - span_s)
        if after is not None and before is not None:
            noise = 3.0 * math.sqrt(max(after + before, 0.0) / span_s)
            best = max(best, after - before - noise)
    return best


def watched_s(history: Sequence[tuple[float, float]], now_s: float) -> float:
    """How long the rate history reaches back."""
    return now_s - history[0][0] if history else 0.0


def _trend(
    history: Sequence[tuple[float, float]], now_s: float, rate_window_s: float, cfg: PolicyConfig
) -> float:
    """Least-squares slope (rps per second) over the trend window; 0 unless significantly positive.

    Rates counted over windows longer than the spacing of the samples overlap, so neighbouring samples
    share arrivals; the standard error is inflated by sqrt(overlap) to keep the test honest.
    """
    window_s = cfg.settings.trend_window_s
    pts = [(t, r) for t, r in history if t >= now_s - window_s]
    n = len(pts)
    span = pts[-1][0] - pts[0][0] if pts else 0.0
    if n < 4 or span < 0.5 * window_s:
        return 0.0
    mt = sum(t for t, _ in pts) / n
    mr = sum(r for _, r in pts) / n
    sxx = sum((t - mt) ** 2 for t, _ in pts)
    if sxx <= 0:
        return 0.0
    slope = sum((t - mt) * (r - mr) for t, r in pts) / sxx
    resid = sum((r - (mr + slope * (t - mt))) ** 2 for t, r in pts)
    # Arrivals are Poisson: a rate counted over rate_window_s has variance rate / rate_window_s. Use it
    # when it is larger than what a handful of residuals suggest.
    var = max(resid / (n - 2), max(mr, 0.0) / max(rate_window_s, 1e-9))
    se = math.sqrt(var / sxx)
    spacing = span / (n - 1)
    if rate_window_s > spacing > 0:
        se *= math.sqrt(rate_window_s / spacing)
    if slope <= 0 or (se > 0 and slope / se < cfg.settings.trend_min_t_stat):
        return 0.0
    return slope


def _persistent_trend(
    history: Sequence[tuple[float, float]], snapshot: MetricsSnapshot, cfg: PolicyConfig
) -> float:
    """The trend, counted only when the previous report's history also showed one: decisions come every
    second on overlapping windows, so a single significant fit is a false alarm far more often than its
    t-statistic alone says."""
    slope = _trend(history, snapshot.now_s, snapshot.window_s, cfg)
    if slope <= 0 or len(history) < 2:
        return 0.0
    before = _trend(history[:-1], history[-2][0], snapshot.window_s, cfg)
    return min(slope, before) if before > 0 else 0.0


def _smoothed_peak(history: Sequence[tuple[float, float]], now_s: float, cfg: PolicyConfig) -> float:
    """Highest trend-window mean of the arrival rate over the last ``downscale_sustain_s``: averaging
    keeps Poisson noise from posing as a peak; the max keeps a real surge from being forgotten."""
    start = now_s - cfg.settings.downscale_sustain_s - 1e-9
    window_s = cfg.settings.trend_window_s
    best = acc = 0.0
    lo = 0
    for hi, (t, r) in enumerate(history):
        acc += r
        while history[lo][0] < t - window_s + 1e-9:
            acc -= history[lo][1]
            lo += 1
        if t >= start:
            best = max(best, acc / (hi - lo + 1))
    return best


def _with_surge(rate_rps: float, surge_rps: float, max_share: float) -> float:
    return rate_rps + min(surge_rps, max_share * rate_rps)


def _above_noise(rate_rps: float, window_s: float) -> float:
    """The rate less ``_NOISE_Z`` Poisson standard errors of a count over ``window_s``."""
    return max(0.0, rate_rps - _NOISE_Z * math.sqrt(max(rate_rps, 0.0) / max(window_s, 1e-9)))


def _in_flight(snapshot: MetricsSnapshot) -> int:
    reps = snapshot.replicas
    return snapshot.queued_at_router + sum(r.num_requests_running + r.num_requests_waiting for r in reps)


def measure(
    snapshot: MetricsSnapshot,
    history: Sequence[tuple[float, float]],
    service: ServiceEstimate | None,
    surge_rps: float,
    cfg: PolicyConfig,
) -> Signals:
    """Every signal of one decision, and the replica count each one asks for; ``surge_rps`` is the
    arrival rate kept in hand for a surge (:func:`surge_headroom`)."""
    s, reps = cfg.settings, snapshot.replicas
    in_flight = _in_flight(snapshot)
    p95 = fleet_ttft_p95(reps)
    rate = snapshot.offered_rate_rps(s.client_retries)
    if p95 is None and in_flight == 0 and (rate or 0.0) == 0.0 and reps:
        p95 = 0.0  # idle: no request had a first token in the window because none came; full headroom
    slope = _persistent_trend(history, snapshot, cfg) if rate is not None else 0.0
    projected = 0.0 if rate is None else _above_noise(rate, snapshot.window_s) + slope * s.replica_startup_s
    per_request_s = None if service is None else cfg.replica_seconds_per_request(service)
    rising = rate is not None and slope > 0
    kept = _with_surge(projected, surge_rps, s.max_surge_headroom)
    need_demand = 0
    if per_request_s is not None and projected > 0:
        need_demand = _ceil(kept * per_request_s) + (s.spare_replicas if rising else 0)
    serving = snapshot.current_replicas
    need_ttft = 0
    if p95 is not None and p95 > cfg.up_threshold_ms and serving > 0:
        factor = min(p95 / cfg.up_threshold_ms, _TTFT_MAX_FACTOR)
        need_ttft = max(serving + 1, _ceil(serving * factor))
    kv_max = max((r.kv_cache_usage for r in reps), default=0.0)
    return Signals(
        ttft_target_ms=cfg.ttft_target_ms,
        ttft_p95_ms=p95,
        in_flight=in_flight,
        kv_max=kv_max,
        rate_rps=rate,
        slope_rps_per_s=slope,
        projected_rps=projected,
        peak_rps=_smoothed_peak(history, snapshot.now_s, cfg) if rate is not None else 0.0,
        startup_s=s.replica_startup_s,
        service=service,
        replica_s_per_request=per_request_s,
        surge_rps=surge_rps,
        max_surge_share=s.max_surge_headroom,
        planned_sequences=cfg.planned_sequences_per_replica,
        rising=rising,
        need_demand=need_demand,
        need_queue=_ceil(in_flight / cfg.planned_sequences_per_replica),
        need_ttft=need_ttft,
        need_kv=serving + 1 if serving > 0 and kv_max > s.kv_cache_high_usage else 0,
    )
