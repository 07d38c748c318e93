"""The TTFT-headroom autoscaling decision: a pure function from metrics, state and config to a decision.

``decide(snapshot, state, config) -> (Decision, PolicyState)`` is the whole policy. It reads no clock (time
is ``snapshot.now_s``), holds no globals and does no I/O, so the same code runs inside Ray Serve (through a
thin adapter that maps Ray's ``AutoscalingContext`` into a :class:`MetricsSnapshot` and keeps
:meth:`PolicyState.to_dict` in ``ctx.policy_state``) and in trace replay (:mod:`autoscale.sim`).

The shape follows Ray Serve's ``ray/serve/autoscaling_policy.py`` (a core sizing rule wrapped in small
guards applied once, in order: bounds, missing/stale metrics, scale from zero, scale-up in progress, then the
core with hysteresis and cooldowns) and NVIDIA Dynamo's planner (time is an input, every decision carries a
reason, no new decision while a scale-up is still in progress). Decisions are plain data that a controller
executes (SkyPilot serve).

Signals, all in one place:

* headroom = 1 - observed TTFT p95 / ``ttft_target_ms``. Scale up when headroom < ``scale_up_headroom``;
  consider scaling down only when headroom > ``scale_down_headroom``.
* demand: the arrival rate projected ``replica_startup_s`` ahead along its recent trend (a replica asked
  for now serves only after its start-up), divided by the planning capacity of one replica
  (``per_replica_capacity_rps * target_utilization``), plus ``spare_replicas`` while requests arrive.
* queueing: requests in flight (running + waiting + queued at the router) over
  ``per_replica_max_concurrency``.
* TTFT overshoot: serving replicas scaled by observed p95 / up threshold (capped at 2x), the fallback when
  the capacity figures are wrong.
* KV cache: one more replica when the fullest cache passes ``kv_cache_high_usage``.

A scale-up is sized to the largest of these needs (not +1), capped by ``max_step_up`` and the bounds. A
scale-down removes one replica, only after the low-load condition (headroom above
``scale_down_headroom``, projected demand, in-flight requests and KV cache all fitting on one replica fewer)
has held for ``downscale_sustain_s`` and the peak arrival rate of that whole period fits on one replica
fewer with ``downscale_margin`` to spare. While replicas are still starting, the policy only goes further
up, and only when projected demand outgrew the target it already asked for.

Tuned in the simulator (``python -m autoscale.bench``); the defaults here are those tuned values.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = [
    "Action",
    "Decision",
    "MetricsSnapshot",
    "PolicyConfig",
    "PolicyState",
    "ReplicaMetrics",
    "ScaleUpInProgress",
    "decide",
]

Action = Literal["up", "down", "hold"]

_TTFT_MAX_FACTOR = 2.0
"""A TTFT-driven scale-up at most doubles the serving replicas in one decision (then ``max_step_up``)."""


# --------------------------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------------------------


class PolicyConfig(BaseModel):
    """Knobs of the TTFT-headroom policy. Frozen; unknown keys are errors."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    ttft_target_ms: float = Field(
        500.0,
        gt=0,
        le=600_000,
        description="The SLO the policy defends: time to first token at p95, in milliseconds.",
    )
    scale_up_headroom: float = Field(
        0.2,
        ge=0,
        lt=1,
        description=(
            "Scale up when headroom (1 - TTFT p95 / target) falls below this, i.e. when p95 exceeds "
            "(1 - scale_up_headroom) * ttft_target_ms. 0.2 with a 500 ms target acts above 400 ms."
        ),
    )
    scale_down_headroom: float = Field(
        0.3,
        gt=0,
        lt=1,
        description=(
            "Consider removing a replica only while headroom exceeds this, i.e. while TTFT p95 is below "
            "(1 - scale_down_headroom) * ttft_target_ms. Must be > scale_up_headroom (the hold band). "
            "A batching engine's TTFT rises slowly until near saturation, so 0.5 would pin the fleet near "
            "30% utilization; the load check on one replica fewer does the real sizing."
        ),
    )
    target_utilization: float = Field(
        0.85,
        gt=0,
        le=1,
        description=(
            "Fraction of per_replica_capacity_rps (and of per_replica_max_concurrency) each replica is "
            "planned for; the rest absorbs noise and the first seconds of a surge."
        ),
    )
    downscale_margin: float = Field(
        0.1,
        ge=0,
        lt=1,
        description=(
            "A replica is removed only if the peak load of the last downscale_sustain_s fits on one "
            "replica fewer at (1 - downscale_margin) of the planning capacity; the gap to the scale-up "
            "point is the hysteresis that keeps a steady load from flapping."
        ),
    )
    downscale_sustain_s: float = Field(
        180.0,
        ge=0,
        le=86_400,
        description="Seconds the low-load condition must hold without a break before a replica is removed.",
    )
    upscale_cooldown_s: float = Field(
        60.0,
        ge=0,
        le=86_400,
        description=(
            "Seconds after a scale-up completes (all replicas ready) during which the lagging signals "
            "(TTFT, and queueing when a rate capacity is set) cannot trigger another one: their window "
            "still holds the backlog from before. Demand-driven scale-ups are not delayed by it."
        ),
    )
    downscale_cooldown_s: float = Field(
        30.0,
        ge=0,
        le=86_400,
        description=(
            "Seconds between two scale-downs, so metrics reflect the smaller fleet before the next step. "
            "Keep it at least as long as the TTFT window."
        ),
    )
    stale_after_s: float = Field(
        30.0,
        gt=0,
        le=3600,
        description="Metrics older than this (now_s - taken_at_s) are stale: the policy holds.",
    )
    replica_startup_s: float = Field(
        90.0,
        ge=0,
        le=3600,
        description=(
            "Measured seconds from asking for a replica to it serving: the lead time demand is projected "
            "over. Lab, Qwen3-8B shape on one H200: 255 s cold, 64-92 s with warm compile caches."
        ),
    )
    trend_window_s: float = Field(
        60.0,
        gt=0,
        le=3600,
        description="Seconds of arrival-rate history the trend (rps per second) is fitted over.",
    )
    trend_min_t_stat: float = Field(
        3.0,
        ge=0,
        le=100,
        description=(
            "A rising trend is projected only if its slope is at least this many standard errors above "
            "zero, so Poisson noise on a steady load is not extrapolated."
        ),
    )
    spare_replicas: int = Field(
        1,
        ge=0,
        le=64,
        description=(
            "Replicas kept above the demand-based need while requests arrive: they absorb the first "
            "minutes of a surge, which no scale-up can serve (a new replica needs replica_startup_s)."
        ),
    )
    min_replicas: int = Field(1, ge=0, le=1024, description="Fewest replicas; 0 allows scale to zero.")
    max_replicas: int = Field(16, ge=1, le=1024, description="Most replicas; must be >= min_replicas.")
    per_replica_capacity_rps: float | None = Field(
        None,
        gt=0,
        le=1_000_000,
        description=(
            "Requests per second one replica serves with TTFT p95 at ttft_target_ms (from the planner or "
            "the tuning ladder). Needed for demand-based, ahead-of-time sizing."
        ),
    )
    per_replica_max_concurrency: int | None = Field(
        None,
        ge=1,
        le=1_000_000,
        description=(
            "Requests in flight one replica holds with TTFT p95 at ttft_target_ms (from the ladder). "
            "Sizes scale-ups from queueing. At least one of the two capacity fields is required."
        ),
    )
    max_step_up: int = Field(
        4,
        ge=1,
        le=1024,
        description="Most replicas added by one decision; bounds the damage of a wrong measurement.",
    )
    kv_cache_high_usage: float = Field(
        0.9,
        gt=0,
        le=1,
        description=(
            "KV cache usage (0-1) of the fullest replica above which the policy adds a replica (vLLM "
            "preempts requests when the cache fills) and never removes one."
        ),
    )
    min_replicas_reporting: float = Field(
        0.5,
        gt=0,
        le=1,
        description=(
            "Fraction of serving replicas that must report metrics; with fewer the metrics count as "
            "missing and the policy holds."
        ),
    )

    @model_validator(mode="after")
    def _check(self) -> PolicyConfig:
        problems: list[str] = []
        if self.max_replicas < self.min_replicas:
            problems.append(
                f"max_replicas ({self.max_replicas}) must be >= min_replicas ({self.min_replicas})"
            )
        if self.scale_down_headroom <= self.scale_up_headroom:
            problems.append(
                f"scale_down_headroom ({self.scale_down_headroom}) must be > scale_up_headroom "
                f"({self.scale_up_headroom}), or the hold band between them is empty and the fleet flaps"
            )
        if self.per_replica_capacity_rps is None and self.per_replica_max_concurrency is None:
            problems.append(
                "per_replica_capacity_rps and per_replica_max_concurrency are both unset: give at least one "
                "(from `headroom plan` or the tuning ladder) so the policy can size a change"
            )
        if problems:
            raise ValueError("; ".join(problems))
        return self

    @property
    def up_threshold_ms(self) -> float:
        """TTFT p95 above which the policy scales up."""
        return (1.0 - self.scale_up_headroom) * self.ttft_target_ms

    @property
    def down_threshold_ms(self) -> float:
        """TTFT p95 below which the policy may scale down."""
        return (1.0 - self.scale_down_headroom) * self.ttft_target_ms

    @property
    def planning_capacity_rps(self) -> float | None:
        """Requests per second one replica is planned for: capacity * target_utilization."""
        if self.per_replica_capacity_rps is None:
            return None
        return self.per_replica_capacity_rps * self.target_utilization

    @property
    def history_s(self) -> float:
        """How much arrival-rate history the state keeps."""
        return max(self.trend_window_s, self.downscale_sustain_s)


# --------------------------------------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ReplicaMetrics:
    """What one serving replica reports (Ray: ``record_autoscaling_stats``; vLLM: its Prometheus gauges)."""

    replica_id: str
    ttft_p50_ms: float | None
    """TTFT p50 over the snapshot's window; None when no request got its first token in the window."""
    ttft_p95_ms: float | None
    """TTFT p95 over the snapshot's window; None when no request got its first token in the window."""
    ttft_samples: int = 0
    """Requests behind the two percentiles; weights this replica in the fleet p95."""
    num_requests_running: int = 0
    """Requests in the engine's running batch (vllm:num_requests_running)."""
    num_requests_waiting: int = 0
    """Requests waiting inside the engine (vllm:num_requests_waiting)."""
    kv_cache_usage: float = 0.0
    """Fraction of the KV cache in use, 0 to 1 (vllm:kv_cache_usage_perc)."""


@dataclass(frozen=True, slots=True)
class MetricsSnapshot:
    """The fleet as the controller saw it at ``taken_at_s``, handed to :func:`decide` at ``now_s``.

    Ray's ``AutoscalingContext`` maps onto it as: ``current_time`` -> now_s, ``current_num_replicas`` ->
    current_replicas, ``target_num_replicas`` -> target_replicas, ``total_queued_requests`` ->
    queued_at_router, per-replica ``aggregated_metrics`` -> replicas.
    """

    now_s: float
    taken_at_s: float
    replicas: tuple[ReplicaMetrics, ...]
    """One entry per serving replica that reported."""
    arrival_rate_rps: float | None
    """Requests arriving per second over a short recent window; None when unknown."""
    current_replicas: int
    """Replicas serving now (ready, not stopping)."""
    target_replicas: int
    """Replicas the controller is already moving to (>= current while a scale-up runs)."""
    replicas_starting: int = 0
    """Replicas asked for that do not serve yet."""
    queued_at_router: int = 0
    """Requests waiting for any replica (router/handle queue); the signal to scale from zero."""
    window_s: float = 30.0
    """Length of the window the TTFT percentiles cover."""
    rate_window_s: float = 0.0
    """Length of the window arrival_rate_rps is counted over (0: unknown or instantaneous). Rates of
    overlapping windows are correlated; the trend test discounts its sample count accordingly."""


# --------------------------------------------------------------------------------------------------------
# State and output
# --------------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ScaleUpInProgress:
    """A scale-up the policy asked for that has not finished (replicas still starting)."""

    started_at_s: float
    from_replicas: int
    to_replicas: int
    ttft_p95_ms: float | None


@dataclass(frozen=True, slots=True)
class PolicyState:
    """What the policy remembers between decisions. Start with ``PolicyState()``."""

    last_scale_up_s: float | None = None
    last_scale_down_s: float | None = None
    last_scale_up_ready_s: float | None = None
    """When the last scale-up finished (every replica it asked for was serving)."""
    low_load_since_s: float | None = None
    """Start of the current unbroken run of low-load observations; None when load is not low."""
    in_progress: ScaleUpInProgress | None = None
    rate_history: tuple[tuple[float, float], ...] = ()
    """(now_s, arrival_rate_rps) pairs covering the last ``config.history_s`` seconds."""
    last_action: Action = "hold"

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict, e.g. for Ray's ``ctx.policy_state``."""
        ip = self.in_progress
        return {
            "last_scale_up_s": self.last_scale_up_s,
            "last_scale_down_s": self.last_scale_down_s,
            "last_scale_up_ready_s": self.last_scale_up_ready_s,
            "low_load_since_s": self.low_load_since_s,
            "in_progress": None
            if ip is None
            else {
                "started_at_s": ip.started_at_s,
                "from_replicas": ip.from_replicas,
                "to_replicas": ip.to_replicas,
                "ttft_p95_ms": ip.ttft_p95_ms,
            },
            "rate_history": [[t, r] for t, r in self.rate_history],
            "last_action": self.last_action,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> PolicyState:
        """Inverse of :meth:`to_dict`; unknown keys (e.g. Ray's own) are ignored, missing ones default."""
        if not data:
            return cls()
        ip = data.get("in_progress")
        action = data.get("last_action", "hold")
        return cls(
            last_scale_up_s=data.get("last_scale_up_s"),
            last_scale_down_s=data.get("last_scale_down_s"),
            last_scale_up_ready_s=data.get("last_scale_up_ready_s"),
            low_load_since_s=data.get("low_load_since_s"),
            in_progress=None
            if not ip
            else ScaleUpInProgress(
                started_at_s=float(ip["started_at_s"]),
                from_replicas=int(ip["from_replicas"]),
                to_replicas=int(ip["to_replicas"]),
                ttft_p95_ms=ip.get("ttft_p95_ms"),
            ),
            rate_history=tuple((float(t), float(r)) for t, r in data.get("rate_history", ())),
            last_action=action if action in ("up", "down", "hold") else "hold",
        )


@dataclass(frozen=True, slots=True)
class Decision:
    """What to do: a replica count, its direction and why, in a sentence with the numbers."""

    desired_replicas: int
    action: Action
    reason: str
    details: Mapping[str, float | int | str | None] = field(default_factory=dict)
    """The signals behind the decision (headroom, needs per signal, projected rate, ...)."""

    def __post_init__(self) -> None:
        if not self.reason.strip():
            raise ValueError("Decision.reason must be a non-empty sentence")
        if self.desired_replicas < 0:
            raise ValueError(f"desired_replicas ({self.desired_replicas}) must be >= 0")


# --------------------------------------------------------------------------------------------------------
# Signals
# --------------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Signals:
    ttft_p95_ms: float | None
    headroom: float | None
    in_flight: int
    kv_max: float
    rate_rps: float | None
    slope_rps_per_s: float
    projected_rps: float | None
    peak_rps: float | None
    need_demand: int
    need_queue: int
    need_ttft: int
    need_kv: int

    def details(self) -> dict[str, float | int | str | None]:
        return {
            "ttft_p95_ms": _round(self.ttft_p95_ms),
            "headroom": _round(self.headroom, 3),
            "in_flight": self.in_flight,
            "kv_cache_usage_max": _round(self.kv_max, 3),
            "arrival_rate_rps": _round(self.rate_rps, 2),
            "trend_rps_per_s": _round(self.slope_rps_per_s, 4),
            "projected_rate_rps": _round(self.projected_rps, 2),
            "peak_rate_rps": _round(self.peak_rps, 2),
            "need_demand": self.need_demand,
            "need_queue": self.need_queue,
            "need_ttft": self.need_ttft,
            "need_kv": self.need_kv,
        }


def _round(value: float | None, digits: int = 1) -> float | None:
    return None if value is None else round(value, digits)


def _fleet_ttft_p95(replicas: Sequence[ReplicaMetrics]) -> float | None:
    """Sample-weighted mean of per-replica p95s (each replica weighs at least 1)."""
    total_w = 0.0
    acc = 0.0
    for r in replicas:
        if r.ttft_p95_ms is None:
            continue
        w = float(max(1, r.ttft_samples))
        acc += w * r.ttft_p95_ms
        total_w += w
    return acc / total_w if total_w else None


def _trend(
    history: Sequence[tuple[float, float]], now_s: float, rate_window_s: float, config: PolicyConfig
) -> float:
    """Least-squares slope (rps per second) over the trend window; 0 unless significantly positive.

    Rates counted over windows longer than the spacing of the samples overlap, so neighbouring samples
    share arrivals; the standard error is inflated by sqrt(overlap) to keep the test honest.
    """
    pts = [(t, r) for t, r in history if t >= now_s - config.trend_window_s]
    n = len(pts)
    if n < 4:
        return 0.0
    span = pts[-1][0] - pts[0][0]
    if span < 0.5 * config.trend_window_s:
        return 0.0
    mt = sum(t for t, _ in pts) / n
    mr = sum(r for _, r in pts) / n
    sxx = sum((t - mt) ** 2 for t, _ in pts)
    if sxx <= 0:
        return 0.0
    slope = sum((t - mt) * (r - mr) for t, r in pts) / sxx
    resid = sum((r - (mr + slope * (t - mt))) ** 2 for t, r in pts)
    var = resid / (n - 2) if n > 2 else math.inf
    if rate_window_s > 0:
        # Arrivals are Poisson: a rate counted over rate_window_s has variance rate / rate_window_s. Use it
        # when it is larger than what a handful of residuals suggest.
        var = max(var, max(mr, 0.0) / rate_window_s)
    se = math.sqrt(var / sxx)
    spacing = span / (n - 1)
    if rate_window_s > spacing > 0:
        se *= math.sqrt(rate_window_s / spacing)
    if slope <= 0:
        return 0.0
    if se > 0 and slope / se < config.trend_min_t_stat:
        return 0.0
    return slope


def _smoothed_peak(history: Sequence[tuple[float, float]], now_s: float, config: PolicyConfig) -> float:
    """Highest trend-window mean of the arrival rate over the last ``downscale_sustain_s``.

    Averaging over ``trend_window_s`` first keeps Poisson noise from posing as a peak; taking the highest
    of those means keeps a real surge inside the sustain period from being forgotten.
    """
    if not history:
        return 0.0
    start = now_s - config.downscale_sustain_s - 1e-9
    times = [t for t, _ in history]
    rates = [r for _, r in history]
    best = 0.0
    lo = 0
    acc = 0.0
    for hi, (t, r) in enumerate(zip(times, rates, strict=True)):
        acc += r
        while times[lo] < t - config.trend_window_s + 1e-9:
            acc -= rates[lo]
            lo += 1
        if t >= start:
            best = max(best, acc / (hi - lo + 1))
    return best


def _ceil(x: float) -> int:
    # Tolerate float noise: 3.0000000001 replicas is 3.
    return max(0, math.ceil(x - 1e-9))


def _signals(
    snapshot: MetricsSnapshot, history: Sequence[tuple[float, float]], config: PolicyConfig
) -> _Signals:
    reps = snapshot.replicas
    in_flight = snapshot.queued_at_router + sum(r.num_requests_running + r.num_requests_waiting for r in reps)
    kv_max = max((r.kv_cache_usage for r in reps), default=0.0)
    p95 = _fleet_ttft_p95(reps)
    if p95 is None and in_flight == 0 and (snapshot.arrival_rate_rps or 0.0) == 0.0 and reps:
        p95 = 0.0  # idle: no request had a first token in the window because none came; full headroom
    headroom = None if p95 is None else 1.0 - p95 / config.ttft_target_ms
    rate = snapshot.arrival_rate_rps
    slope = _trend(history, snapshot.now_s, snapshot.rate_window_s, config) if rate is not None else 0.0
    projected = None if rate is None else rate + slope * config.replica_startup_s
    peak = None if rate is None else _smoothed_peak(history, snapshot.now_s, config)

    serving = snapshot.current_replicas
    cap = config.planning_capacity_rps
    need_demand = 0
    if cap is not None and projected is not None:
        need_demand = _ceil(projected / cap)
        if projected > 0:
            need_demand += config.spare_replicas
    conc = config.per_replica_max_concurrency
    need_queue = _ceil(in_flight / conc) if conc is not None else 0
    need_ttft = 0
    if p95 is not None and p95 > config.up_threshold_ms and serving > 0:
        factor = min(p95 / config.up_threshold_ms, _TTFT_MAX_FACTOR)
        need_ttft = max(serving + 1, _ceil(serving * factor))
    need_kv = serving + 1 if (serving > 0 and kv_max > config.kv_cache_high_usage) else 0
    return _Signals(
        ttft_p95_ms=p95,
        headroom=headroom,
        in_flight=in_flight,
        kv_max=kv_max,
        rate_rps=rate,
        slope_rps_per_s=slope,
        projected_rps=projected,
        peak_rps=peak,
        need_demand=need_demand,
        need_queue=need_queue,
        need_ttft=need_ttft,
        need_kv=need_kv,
    )


def _append_history(state: PolicyState, snapshot: MetricsSnapshot, config: PolicyConfig) -> PolicyState:
    if snapshot.arrival_rate_rps is None:
        return state
    keep_from = snapshot.now_s - config.history_s - 1e-9
    hist = tuple(p for p in state.rate_history if p[0] >= keep_from and p[0] < snapshot.now_s)
    return replace(state, rate_history=(*hist, (snapshot.now_s, float(snapshot.arrival_rate_rps))))


def _describe(sig: _Signals, config: PolicyConfig) -> str:
    parts = []
    if sig.ttft_p95_ms is not None and sig.headroom is not None:
        parts.append(
            f"TTFT p95 {sig.ttft_p95_ms:.0f} ms vs target {config.ttft_target_ms:.0f} ms "
            f"(headroom {sig.headroom:.0%})"
        )
    else:
        parts.append("no TTFT samples in the window")
    if sig.rate_rps is not None:
        cap = config.planning_capacity_rps
        s = f"arrivals {sig.rate_rps:.1f} rps"
        if sig.projected_rps is not None and sig.projected_rps > sig.rate_rps + 1e-9:
            s += f", {sig.projected_rps:.1f} rps projected {config.replica_startup_s:.0f} s ahead"
        if cap is not None:
            s += f" (needs {sig.need_demand} at {cap:.1f} rps each)"
        parts.append(s)
    if config.per_replica_max_concurrency is not None:
        parts.append(
            f"{sig.in_flight} in flight (needs {sig.need_queue} at {config.per_replica_max_concurrency} each)"
        )
    return "; ".join(parts)


# --------------------------------------------------------------------------------------------------------
# The decision
# --------------------------------------------------------------------------------------------------------


def _hold(
    target: int, reason: str, state: PolicyState, details: Mapping[str, Any] | None = None
) -> tuple[Decision, PolicyState]:
    return Decision(target, "hold", reason, dict(details or {})), replace(state, last_action="hold")


def _up(
    snapshot: MetricsSnapshot,
    state: PolicyState,
    desired: int,
    reason: str,
    ttft_p95_ms: float | None,
    details: Mapping[str, Any],
) -> tuple[Decision, PolicyState]:
    now = snapshot.now_s
    base = state.in_progress.from_replicas if state.in_progress is not None else snapshot.target_replicas
    started = state.in_progress.started_at_s if state.in_progress is not None else now
    new_state = replace(
        state,
        last_scale_up_s=now,
        low_load_since_s=None,
        in_progress=ScaleUpInProgress(started, base, desired, ttft_p95_ms),
        last_action="up",
    )
    return Decision(desired, "up", reason, dict(details)), new_state


def decide(
    snapshot: MetricsSnapshot, state: PolicyState, config: PolicyConfig
) -> tuple[Decision, PolicyState]:
    """Desired replica count for ``snapshot``; returns the decision and the state for the next call.

    Pure: the same inputs always give the same outputs. Guards run in order: bounds, missing or stale
    metrics, scale from zero, scale-up in progress, then sizing with hysteresis and cooldowns.
    """
    now = snapshot.now_s
    target = snapshot.target_replicas
    lo, hi = config.min_replicas, config.max_replicas

    # Bookkeeping that needs no metrics: has the scale-up we asked for finished?
    ip = state.in_progress
    scaling_up = snapshot.replicas_starting > 0 or target > snapshot.current_replicas
    if ip is not None and not scaling_up:
        state = replace(state, in_progress=None, last_scale_up_ready_s=now)
        ip = None

    # 1. Bounds: they need no metrics, so they apply even when metrics are missing.
    if target < lo:
        return _up(
            snapshot,
            state,
            lo,
            f"scale up {target} -> {lo}: target is below min_replicas ({lo})",
            None,
            {"min_replicas": lo},
        )
    if target > hi:
        new_state = replace(state, last_scale_down_s=now, last_action="down")
        return (
            Decision(hi, "down", f"scale down {target} -> {hi}: target is above max_replicas ({hi})", {}),
            new_state,
        )

    # 2. Missing or stale metrics: hold (never act on data we cannot trust).
    age = now - snapshot.taken_at_s
    if age > config.stale_after_s:
        return _hold(
            target,
            f"hold at {target}: metrics are stale ({age:.0f} s old, limit {config.stale_after_s:.0f} s)",
            replace(state, low_load_since_s=None),
            {"metrics_age_s": round(age, 1)},
        )
    serving = snapshot.current_replicas
    reporting = len(snapshot.replicas)
    if serving > 0 and reporting < max(1, math.ceil(config.min_replicas_reporting * serving)):
        return _hold(
            target,
            f"hold at {target}: metrics missing ({reporting} of {serving} serving replicas reported)",
            replace(state, low_load_since_s=None),
            {"replicas_reporting": reporting},
        )
    if serving > 0 and snapshot.arrival_rate_rps is None and _fleet_ttft_p95(snapshot.replicas) is None:
        return _hold(
            target,
            f"hold at {target}: metrics missing (no TTFT percentiles and no arrival rate)",
            replace(state, low_load_since_s=None),
        )

    state = _append_history(state, snapshot, config)
    sig = _signals(snapshot, state.rate_history, config)
    details = sig.details()

    # 3. Scale from zero: no replica serves and none is coming, but requests wait or arrive.
    if serving == 0 and target == 0:
        waiting = snapshot.queued_at_router
        rate = snapshot.arrival_rate_rps or 0.0
        if waiting > 0 or rate > 0:
            desired = min(hi, max(1, lo, min(sig.need_demand, config.max_step_up)))
            return _up(
                snapshot,
                state,
                desired,
                f"scale from zero 0 -> {desired}: {waiting} requests waiting and {rate:.1f} rps arriving "
                f"with no replica (next first token in about {config.replica_startup_s:.0f} s)",
                None,
                details,
            )
        return _hold(0, "hold at 0: no replica, no request waiting and none arriving", state, details)

    needs = {
        "demand": sig.need_demand,
        "queueing": sig.need_queue,
        "TTFT": sig.need_ttft,
        "KV cache": sig.need_kv,
    }

    # 4. A scale-up is in progress: only go further up, and only if demand outgrew it. TTFT and queueing
    #    stay bad until the coming replicas serve, which is not news; only demand (the projected arrival
    #    rate) looks past them. Queueing stands in for it when no rate capacity is configured.
    if scaling_up:
        further = sig.need_demand if config.planning_capacity_rps is not None else sig.need_queue
        if further > target and target < hi:
            desired = min(hi, further, target + config.max_step_up)
            by = "demand" if config.planning_capacity_rps is not None else "queueing"
            return _up(
                snapshot,
                state,
                desired,
                f"scale up further {target} -> {desired} while {snapshot.replicas_starting} replica(s) still "
                f"start: it got worse, {by} now needs {further}; {_describe(sig, config)}",
                sig.ttft_p95_ms,
                details,
            )
        return _hold(
            target,
            f"hold at {target}: scale-up in progress ({serving} serving, {snapshot.replicas_starting} "
            f"starting); {_describe(sig, config)}",
            replace(state, low_load_since_s=None),
            details,
        )

    # 5. Scale up, sized to the largest need.
    ready_s = state.last_scale_up_ready_s
    ttft_cooling = ready_s is not None and now - ready_s < config.upscale_cooldown_s
    if ttft_cooling:
        # Lagging signals still carry samples from before the last scale-up finished.
        needs["TTFT"] = 0
        if config.planning_capacity_rps is not None:
            needs["queueing"] = 0
    need = max(needs.values())
    if need > target and target < hi:
        desired = min(hi, need, target + config.max_step_up)
        drivers = ", ".join(f"{k} {v}" for k, v in needs.items() if v > target)
        return _up(
            snapshot,
            state,
            desired,
            f"scale up {target} -> {desired} (needs: {drivers}); {_describe(sig, config)}",
            sig.ttft_p95_ms,
            details,
        )
    if need > target:
        return _hold(
            target,
            f"hold at {target}: at max_replicas ({hi}) though {need} are needed; {_describe(sig, config)}",
            replace(state, low_load_since_s=None),
            details,
        )

    # 6. Scale down one replica after sustained low load.
    low, why_not = _low_load(snapshot, sig, config)
    low_since = state.low_load_since_s if low else None
    if low and low_since is None:
        low_since = now
    state = replace(state, low_load_since_s=low_since)
    if low and target > lo:
        assert low_since is not None
        held = now - low_since
        since_down = None if state.last_scale_down_s is None else now - state.last_scale_down_s
        if held + 1e-9 < config.downscale_sustain_s:
            return _hold(
                target,
                f"hold at {target}: load is low for {held:.0f} s of the {config.downscale_sustain_s:.0f} s "
                f"needed before removing a replica; {_describe(sig, config)}",
                state,
                details,
            )
        if since_down is not None and since_down + 1e-9 < config.downscale_cooldown_s:
            return _hold(
                target,
                f"hold at {target}: last scale-down {since_down:.0f} s ago, cooldown "
                f"{config.downscale_cooldown_s:.0f} s; {_describe(sig, config)}",
                state,
                details,
            )
        desired = target - 1
        new_state = replace(state, last_scale_down_s=now, last_action="down")
        return (
            Decision(
                desired,
                "down",
                f"scale down {target} -> {desired}: load low for {held:.0f} s and the peak of "
                f"{(sig.peak_rps or 0.0):.1f} rps fits on {desired}; {_describe(sig, config)}",
                details,
            ),
            new_state,
        )
    if low:
        why = f"load is low but the fleet is at min_replicas ({lo})"
    elif ttft_cooling and max(sig.need_ttft, sig.need_queue) > target:
        why = (
            f"TTFT or queueing is high but a scale-up finished {now - (ready_s or now):.0f} s ago (cooldown)"
        )
    else:
        why = why_not
    return _hold(target, f"hold at {target}: {why}; {_describe(sig, config)}", state, details)


def _low_load(snapshot: MetricsSnapshot, sig: _Signals, config: PolicyConfig) -> tuple[bool, str]:
    """Whether one replica fewer would serve the load with margin; if not, why (a clause)."""
    target = snapshot.target_replicas
    fewer = target - 1
    if fewer < 0:
        return False, "no replica to remove"
    if sig.ttft_p95_ms is None:
        return False, "no TTFT samples to judge headroom"
    if sig.ttft_p95_ms >= config.down_threshold_ms:
        band = f"[{config.scale_up_headroom:.0%}, {config.scale_down_headroom:.0%}]"
        return False, f"headroom {sig.headroom:.0%} is inside the band {band}"
    keep = 1.0 - config.downscale_margin
    cap = config.planning_capacity_rps
    peak = sig.peak_rps
    if cap is not None and peak is not None:
        spare = config.spare_replicas if peak > 0 else 0
        if peak > cap * max(0, fewer - spare) * keep:
            spare_note = f" (+{spare} spare)" if spare else ""
            return False, (
                f"peak {peak:.1f} rps of the last {config.downscale_sustain_s:.0f} s would not fit on "
                f"{max(0, fewer - spare)} replica(s){spare_note} with {config.downscale_margin:.0%} margin"
            )
    if sig.need_demand > fewer:
        return False, (
            f"the projected {(sig.projected_rps or 0.0):.1f} rps needs {sig.need_demand} replica(s), "
            f"more than {fewer}"
        )
    conc = config.per_replica_max_concurrency
    if conc is not None and sig.in_flight > conc * config.target_utilization * fewer * keep:
        return False, f"{sig.in_flight} requests in flight would not fit on {fewer} replica(s)"
    if fewer > 0 and sig.kv_max * target / fewer > config.kv_cache_high_usage:
        return False, f"KV cache usage {sig.kv_max:.0%} would exceed {config.kv_cache_high_usage:.0%}"
    if fewer == 0 and (sig.in_flight > 0 or (sig.peak_rps or 0.0) > 0):
        return False, "requests still arrive, so the last replica stays"
    return True, "load is low"
