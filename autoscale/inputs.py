"""The policy's inputs: its configuration and the fleet snapshot each decision reads.

:class:`PolicyConfig` is the user's :class:`~autoscale.settings.AutoscalingSettings` (every knob, declared
once there) plus the numbers the deployment supplies; :class:`MetricsSnapshot` is what the controller
knows at one moment, built from the replicas' reports (:meth:`ReplicaMetrics.from_report`). Pure.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from autoscale import replica_stats as keys
from autoscale.capacity import FleetEngineRates, ServiceEstimate, replica_seconds_per_request
from autoscale.settings import AutoscalingSettings

__all__ = ["MetricsSnapshot", "PolicyConfig", "ReplicaMetrics"]


# --------------------------------------------------------------------------------------------------------
# Config: the user's settings plus what the deployment supplies
# --------------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PolicyConfig:
    """The policy's inputs that do not change between decisions: the user's :class:`AutoscalingSettings`
    (every knob, once), the TTFT target (``slo.ttft_p95_ms``), the engine's sequence slots (the plan's
    ``max_num_seqs``) and an optional capacity seed (from ``settings.capacity_seed_file``)."""

    settings: AutoscalingSettings
    ttft_target_ms: float
    max_num_seqs: int
    capacity_seed: ServiceEstimate | None = None

    def __post_init__(self) -> None:
        if not 0 < self.ttft_target_ms <= 600_000:
            raise ValueError(f"ttft_target_ms ({self.ttft_target_ms}) must be in (0, 600000]")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs ({self.max_num_seqs}) must be >= 1")

    def with_bounds(self, min_replicas: int, max_replicas: int) -> PolicyConfig:
        """The same config with other replica bounds (Ray adjusts them to the cluster's capacity)."""
        bounds = {"min_replicas": min_replicas, "max_replicas": max(max_replicas, min_replicas)}
        return replace(self, settings=self.settings.model_copy(update=bounds))

    @property
    def up_threshold_ms(self) -> float:
        """TTFT p95 above which the policy scales up."""
        return (1.0 - self.settings.scale_up_headroom) * self.ttft_target_ms

    @property
    def down_threshold_ms(self) -> float:
        """TTFT p95 below which the policy may scale down."""
        return (1.0 - self.settings.scale_down_headroom) * self.ttft_target_ms

    @property
    def planned_sequences_per_replica(self) -> float:
        """Requests in flight one replica is planned to hold."""
        return self.max_num_seqs * self.settings.target_slot_utilization

    @property
    def history_s(self) -> float:
        """How much arrival-rate history the state keeps."""
        s = self.settings
        surge_s = s.surge_lookback_s + 2 * s.replica_startup_s if s.surge_lookback_s > 0 else 0.0
        return max(s.trend_window_s, s.downscale_sustain_s, surge_s)

    def replica_seconds_per_request(self, est: ServiceEstimate) -> float:
        s = self.settings
        return replica_seconds_per_request(
            est, self.max_num_seqs, s.target_engine_utilization, s.target_slot_utilization
        )


# --------------------------------------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------------------------------------


def _known(value: float) -> float | None:
    """Reports encode 'unknown' as a negative number."""
    return value if value >= 0 else None


@dataclass(frozen=True, slots=True)
class ReplicaMetrics:
    """What one serving replica reports (autoscale/replica_stats.py), ``None`` where it does not know."""

    replica_id: str
    ttft_p50_ms: float | None
    ttft_p95_ms: float | None
    ttft_samples: int = 0
    num_requests_running: int = 0
    num_requests_waiting: int = 0
    kv_cache_usage: float = 0.0
    finished_rps: float | None = None
    engine_steps_per_s: float | None = None
    engine_busy_fraction: float | None = None
    generation_tokens_per_s: float | None = None
    decode_step_floor_ms: float | None = None

    @classmethod
    def from_report(cls, replica_id: str, report: Mapping[str, float]) -> ReplicaMetrics:
        """A replica's ``ReplicaStatsWindow.report`` (missing keys read as unknown)."""

        def get(key: str) -> float | None:
            return _known(report.get(key, -1.0))

        return cls(
            replica_id=replica_id,
            ttft_p50_ms=get(keys.TTFT_P50_MS),
            ttft_p95_ms=get(keys.TTFT_P95_MS),
            ttft_samples=int(report.get(keys.TTFT_SAMPLES, 0.0)),
            num_requests_running=int(report.get(keys.NUM_REQUESTS_RUNNING, 0.0)),
            num_requests_waiting=int(report.get(keys.NUM_REQUESTS_WAITING, 0.0)),
            kv_cache_usage=report.get(keys.KV_CACHE_USAGE, 0.0),
            finished_rps=get(keys.FINISHED_RPS),
            engine_steps_per_s=get(keys.ENGINE_STEPS_PER_S),
            engine_busy_fraction=get(keys.ENGINE_BUSY_FRACTION),
            generation_tokens_per_s=get(keys.GENERATION_TOKENS_PER_S),
            decode_step_floor_ms=get(keys.DECODE_STEP_FLOOR_MS),
        )


@dataclass(frozen=True, slots=True)
class MetricsSnapshot:
    """The fleet as the controller saw it at ``taken_at_s``, handed to :func:`decide` at ``now_s``.

    Ray's ``AutoscalingContext`` maps onto it as: ``current_time`` -> now_s, ``current_num_replicas`` ->
    current_replicas, ``target_num_replicas`` -> target_replicas, ``total_queued_requests`` ->
    queued_at_router, the replicas' ``record_autoscaling_stats`` reports -> replicas.
    """

    now_s: float
    taken_at_s: float
    replicas: tuple[ReplicaMetrics, ...]
    """One entry per serving replica that reported."""
    arrival_rate_rps: float | None
    """Requests arriving per second over the window, refused attempts included; None when unknown."""
    current_replicas: int
    """Replicas serving now (ready, not stopping)."""
    target_replicas: int
    """Replicas the controller is already moving to (>= current while a scale-up runs)."""
    replicas_starting: int = 0
    queued_at_router: int = 0
    """Requests waiting for any replica (router/handle queue); the signal to scale from zero."""
    refused_rate_rps: float = 0.0
    """Of the arrivals, attempts the replicas refused at their queue bound (503/429 + Retry-After) per
    second: their clients may send them again."""
    window_s: float = 30.0
    """Length of the window the replicas' percentiles and rates cover; also the arrival-rate window,
    whose overlap between successive rates the trend test discounts."""

    def offered_rate_rps(self, client_retries: int) -> float | None:
        """Requests per second, each counted once however often it was refused and sent again. With a
        share ``p`` of attempts refused and clients that retry ``R`` times, every request makes
        ``1 + p + ... + p**R`` attempts, so requests = arrivals x (1 - p) / (1 - p**(R + 1))."""
        arrivals = self.arrival_rate_rps
        if arrivals is None or arrivals <= 0 or self.refused_rate_rps <= 0:
            return arrivals
        p = min(self.refused_rate_rps / arrivals, 1.0)
        attempts = sum(p**k for k in range(client_retries + 1))
        return arrivals / attempts

    def engine_rates(self) -> FleetEngineRates | None:
        """The replicas' engine rates summed; None unless every reporting replica knows them."""
        reps = self.replicas
        if not reps or any(r.finished_rps is None or r.engine_busy_fraction is None for r in reps):
            return None
        floors = [r.decode_step_floor_ms for r in reps if r.decode_step_floor_ms is not None]
        return FleetEngineRates(
            finished_rps=sum(r.finished_rps or 0.0 for r in reps),
            arrival_rps=self.arrival_rate_rps,
            steps_per_s=sum(r.engine_steps_per_s or 0.0 for r in reps),
            busy_replicas=sum(r.engine_busy_fraction or 0.0 for r in reps),
            generation_tokens_per_s=sum(r.generation_tokens_per_s or 0.0 for r in reps),
            decode_step_floor_ms=min(floors) if floors else None,
        )
