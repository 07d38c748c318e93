"""The TTFT-headroom autoscaling decision: a pure function from metrics, state and config to a decision.

``decide(snapshot, state, config) -> (Decision, PolicyState)`` is the whole policy. It reads no clock (time
is ``snapshot.now_s``), holds no globals and does no I/O, so the same code runs inside Ray Serve (through
autoscale/ray_policy.py, which keeps :meth:`PolicyState.to_dict` in ``ctx.policy_state``) and in trace
replay (autoscale/sim.py).

Shape, after Ray Serve's ``ray/serve/autoscaling_policy.py``: small steps applied once, in order, each
returning a decision or passing on (:data:`_GUARDS`, then :data:`_SIZING`): bounds, stale or missing
metrics, scale from zero, a scale-up in progress, scale-up sizing, the max_replicas cap, scale-down with
hysteresis. After NVIDIA Dynamo's planner: time is an input, no new decision while a scale-up is still in
progress, and every decision carries a reason, here as a machine-readable :data:`ReasonCode` beside a
sentence with the numbers. Decisions are plain data a controller executes (SkyPilot serve).

Needs, each a replica count (the scale-up takes the largest, capped by ``max_step_up`` and the bounds):

* demand: the request rate (a refused request's retries counted once; less two Poisson standard errors,
  so counting noise adds no replica) projected ``replica_startup_s`` ahead along a rising trend that two
  reports in a row show, plus the surge headroom (the largest rise of the rate over one start-up seen in
  the last ``surge_lookback_s``, in requests/s: what a surge like it would bring before new replicas
  serve), times the replica-seconds one request needs (autoscale/capacity.py: learned from the replicas'
  engine counters, or a ladder seed until then), plus ``spare_replicas`` while that trend lasts.
* queueing: requests in flight (engine running + waiting, queued at the router) over the planned share of
  the engine's ``max_num_seqs`` slots.
* TTFT: serving replicas scaled by TTFT p95 over the scale-up threshold (at most 2x): the fallback when
  the capacity estimate is wrong or missing.
* KV cache: one more replica when the fullest cache passes ``kv_cache_high_usage``.

A scale-down happens when arrivals are not rising, TTFT headroom is above ``scale_down_headroom`` and
the peak request rate of the last ``downscale_sustain_s`` (all of it watched on the current fleet: no
scale-up in that time) with its surge headroom, the requests in flight and the KV cache all fit on one
replica fewer with ``downscale_margin`` to spare. It goes straight to the fleet that peak needs when
that is smaller (a fleet left far above its load after a surge), else one replica; then again no sooner
than ``downscale_cooldown_s`` later.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from autoscale.capacity import ServiceEstimate, estimate_service
from autoscale.inputs import MetricsSnapshot, PolicyConfig
from autoscale.signals import Signals, fleet_ttft_p95, measure, rate_history, surge_headroom, watched_s

__all__ = ["Action", "Decision", "Outcome", "PolicyState", "ReasonCode", "ScaleUpInProgress", "decide"]

Action = Literal["up", "down", "hold"]
ReasonCode = Literal[
    "below_min_replicas",
    "above_max_replicas",
    "metrics_stale",
    "metrics_missing",
    "scale_from_zero",
    "idle_at_zero",
    "scale_up_further",
    "scale_up_in_progress",
    "scale_up_demand",
    "scale_up_queueing",
    "scale_up_ttft",
    "scale_up_kv_cache",
    "at_max_replicas",
    "scale_down",
    "downscale_sustaining",
    "downscale_cooldown",
    "at_min_replicas",
    "upscale_cooldown",
    "load_in_band",
]


# --------------------------------------------------------------------------------------------------------
# State and output
# --------------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ScaleUpInProgress:
    """A scale-up the policy asked for that has not finished (replicas still starting)."""

    started_at_s: float
    from_replicas: int
    to_replicas: int


@dataclass(frozen=True, slots=True)
class PolicyState:
    """What the policy remembers between decisions. Start with ``PolicyState()``."""

    last_scale_down_s: float | None = None
    last_scale_up_ready_s: float | None = None
    """When the last scale-up finished (every replica it asked for was serving)."""
    in_progress: ScaleUpInProgress | None = None
    rate_history: tuple[tuple[float, float], ...] = ()
    """(now_s, arrival_rate_rps) pairs covering the last ``config.history_s`` seconds."""
    service: ServiceEstimate | None = None
    """The per-request engine cost measured from the replicas' counters (None until measured)."""
    surge_rps: float = 0.0
    """Arrival rate kept in hand for surges, updated with each new report."""

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict, e.g. for Ray's ``ctx.policy_state``."""
        ip = self.in_progress
        return {
            "last_scale_down_s": self.last_scale_down_s,
            "last_scale_up_ready_s": self.last_scale_up_ready_s,
            "in_progress": None if ip is None else [ip.started_at_s, ip.from_replicas, ip.to_replicas],
            "rate_history": [[t, r] for t, r in self.rate_history],
            "service": None if self.service is None else self.service.to_dict(),
            "surge_rps": self.surge_rps,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> PolicyState:
        """Inverse of :meth:`to_dict`; unknown keys (e.g. Ray's own) are ignored, missing ones default."""
        if not data:
            return cls()
        ip = data.get("in_progress")
        service = data.get("service")
        return cls(
            last_scale_down_s=data.get("last_scale_down_s"),
            last_scale_up_ready_s=data.get("last_scale_up_ready_s"),
            in_progress=None if not ip else ScaleUpInProgress(float(ip[0]), int(ip[1]), int(ip[2])),
            rate_history=tuple((float(t), float(r)) for t, r in data.get("rate_history", ())),
            service=None if not service else ServiceEstimate.from_dict(service),
            surge_rps=float(data.get("surge_rps", 0.0)),
        )


@dataclass(frozen=True, slots=True)
class Decision:
    """What to do: a replica count, its direction, a reason code and a sentence with the numbers."""

    desired_replicas: int
    action: Action
    code: ReasonCode
    reason: str
    details: Mapping[str, float | int | str | None] = field(default_factory=dict)
    """The signals behind the decision (headroom, needs per signal, projected rate, capacity, ...)."""

    def __post_init__(self) -> None:
        if not self.reason.strip():
            raise ValueError("Decision.reason must be a non-empty sentence")
        if self.desired_replicas < 0:
            raise ValueError(f"desired_replicas ({self.desired_replicas}) must be >= 0")


Outcome = tuple[Decision, PolicyState]


@dataclass(frozen=True, slots=True)
class _Context:
    snapshot: MetricsSnapshot
    state: PolicyState
    config: PolicyConfig
    sig: Signals | None = None

    @property
    def target(self) -> int:
        return self.snapshot.target_replicas

    def hold(self, code: ReasonCode, why: str) -> Outcome:
        decision = Decision(self.target, "hold", code, f"hold at {self.target}: {why}", self._details())
        return decision, self.state

    def up(self, desired: int, code: ReasonCode, why: str) -> Outcome:
        snap, ip = self.snapshot, self.state.in_progress
        base = ip.from_replicas if ip is not None else snap.target_replicas
        started = ip.started_at_s if ip is not None else snap.now_s
        reason = f"scale up {snap.target_replicas} -> {desired}: {why}"
        new_state = replace(self.state, in_progress=ScaleUpInProgress(started, base, desired))
        return Decision(desired, "up", code, reason, self._details()), new_state

    def down(self, desired: int, code: ReasonCode, why: str) -> Outcome:
        reason = f"scale down {self.target} -> {desired}: {why}"
        new_state = replace(self.state, last_scale_down_s=self.snapshot.now_s)
        return Decision(desired, "down", code, reason, self._details()), new_state

    def _details(self) -> dict[str, float | int | str | None]:
        return {} if self.sig is None else self.sig.details()


# --------------------------------------------------------------------------------------------------------
# Guards: need no signals
# --------------------------------------------------------------------------------------------------------


def _bounds(ctx: _Context) -> Outcome | None:
    """Bounds need no metrics, so they apply even when metrics are missing."""
    lo, hi, target = ctx.config.settings.min_replicas, ctx.config.settings.max_replicas, ctx.target
    if target < lo:
        return ctx.up(lo, "below_min_replicas", f"the target is below min_replicas ({lo})")
    if target > hi:
        return ctx.down(hi, "above_max_replicas", f"the target is above max_replicas ({hi})")
    return None


def _stale_metrics(ctx: _Context) -> Outcome | None:
    """Never act on data we cannot trust."""
    age_s = ctx.snapshot.now_s - ctx.snapshot.taken_at_s
    limit_s = ctx.config.settings.stale_after_s
    if age_s > limit_s:
        return ctx.hold("metrics_stale", f"metrics are stale ({age_s:.0f} s old, limit {limit_s:.0f} s)")
    return None


def _missing_metrics(ctx: _Context) -> Outcome | None:
    snap = ctx.snapshot
    serving, reporting = snap.current_replicas, len(snap.replicas)
    need = max(1, math.ceil(ctx.config.settings.min_replicas_reporting * serving))
    if serving > 0 and reporting < need:
        why = f"metrics missing ({reporting} of {serving} serving replicas reported)"
        return ctx.hold("metrics_missing", why)
    if serving > 0 and snap.arrival_rate_rps is None and fleet_ttft_p95(snap.replicas) is None:
        return ctx.hold("metrics_missing", "metrics missing (no TTFT percentiles and no arrival rate)")
    return None


_GUARDS: tuple[Callable[[_Context], Outcome | None], ...] = (_bounds, _stale_metrics, _missing_metrics)


# --------------------------------------------------------------------------------------------------------
# Sizing: read the signals
# --------------------------------------------------------------------------------------------------------


def _signals(ctx: _Context) -> Signals:
    assert ctx.sig is not None, "sizing steps run after the signals are measured"
    return ctx.sig


def _scale_from_zero(ctx: _Context) -> Outcome | None:
    """No replica serves and none is coming, but requests wait or arrive."""
    snap, s = ctx.snapshot, ctx.config.settings
    if snap.current_replicas > 0 or ctx.target > 0:
        return None
    waiting, rate = snap.queued_at_router, snap.arrival_rate_rps or 0.0
    if waiting == 0 and rate == 0:
        return ctx.hold("idle_at_zero", "no replica, no request waiting and none arriving")
    desired = min(s.max_replicas, max(1, s.min_replicas, min(_signals(ctx).need_demand, s.max_step_up)))
    why = (
        f"{waiting} requests waiting and {rate:.1f} rps arriving with no replica "
        f"(next first token in about {s.replica_startup_s:.0f} s)"
    )
    return ctx.up(desired, "scale_from_zero", why)


def _scale_up_in_progress(ctx: _Context) -> Outcome | None:
    """While replicas start, TTFT and queueing stay bad, which is not news: only demand (the projected
    arrival rate) looks past them, and queueing stands in for it when no capacity is known."""
    snap, sig, s = ctx.snapshot, _signals(ctx), ctx.config.settings
    if snap.replicas_starting == 0 and ctx.target <= snap.current_replicas:
        return None
    further = sig.need_demand if sig.replica_s_per_request is not None else sig.need_queue
    if further > ctx.target and ctx.target < s.max_replicas:
        desired = min(s.max_replicas, further, ctx.target + s.max_step_up)
        why = (
            f"{snap.replicas_starting} replica(s) still start but demand grew to {further}; {sig.describe()}"
        )
        return ctx.up(desired, "scale_up_further", why)
    why = f"scale-up in progress ({snap.current_replicas} serving, {snap.replicas_starting} starting)"
    return ctx.hold("scale_up_in_progress", f"{why}; {sig.describe()}")


def _cooling(ctx: _Context) -> bool:
    """Lagging signals (TTFT, queueing) still carry samples from before the last scale-up finished."""
    ready_s = ctx.state.last_scale_up_ready_s
    return ready_s is not None and ctx.snapshot.now_s - ready_s < ctx.config.settings.upscale_cooldown_s


_UP_CODES: dict[str, ReasonCode] = {
    "demand": "scale_up_demand",
    "queueing": "scale_up_queueing",
    "TTFT": "scale_up_ttft",
    "KV cache": "scale_up_kv_cache",
}


def _needs(ctx: _Context) -> dict[str, int]:
    sig = _signals(ctx)
    needs = {
        "demand": sig.need_demand,
        "queueing": sig.need_queue,
        "TTFT": sig.need_ttft,
        "KV cache": sig.need_kv,
    }
    if _cooling(ctx):
        needs["TTFT"] = needs["queueing"] = 0
    return needs


def _scale_up(ctx: _Context) -> Outcome | None:
    """Sized to the largest need, capped by max_step_up and max_replicas."""
    needs, s, target = _needs(ctx), ctx.config.settings, ctx.target
    driver = max(needs, key=lambda k: needs[k])
    need = needs[driver]
    if need <= target or target >= s.max_replicas:
        return None
    desired = min(s.max_replicas, need, target + s.max_step_up)
    drivers = ", ".join(f"{k} {v}" for k, v in needs.items() if v > target)
    return ctx.up(desired, _UP_CODES[driver], f"needs {drivers}; {_signals(ctx).describe()}")


def _at_max(ctx: _Context) -> Outcome | None:
    need = max(_needs(ctx).values())
    if need <= ctx.target:
        return None
    why = f"at max_replicas ({ctx.config.settings.max_replicas}) though {need} are needed"
    return ctx.hold("at_max_replicas", f"{why}; {_signals(ctx).describe()}")


def _fewer_fit(ctx: _Context, fewer: int) -> str | None:
    """None if ``fewer`` replicas would serve the load with margin; else why not (a clause)."""
    sig, cfg, s = _signals(ctx), ctx.config, ctx.config.settings
    if sig.ttft_p95_ms is None:
        return "no TTFT samples to judge headroom"
    if sig.ttft_p95_ms >= cfg.down_threshold_ms:
        return f"TTFT headroom {sig.headroom:.0%} is not above {s.scale_down_headroom:.0%}"
    if sig.rising:
        return f"arrivals are rising ({sig.slope_rps_per_s:+.2f} rps/s)"
    keep = 1.0 - s.downscale_margin
    arriving = sig.peak_rps > 0 or sig.in_flight > 0
    if sig.replica_s_per_request is not None:
        needed = sig.with_surge(sig.peak_rps) * sig.replica_s_per_request
        if needed > fewer * keep:
            return (
                f"the peak {sig.peak_rps:.1f} rps of the last {s.downscale_sustain_s:.0f} s needs "
                f"{needed:.2f} replicas, more than {fewer} with {s.downscale_margin:.0%} margin"
            )
    if sig.need_demand > fewer:
        return f"the projected {sig.projected_rps:.1f} rps needs {sig.need_demand} replica(s)"
    if sig.in_flight > cfg.planned_sequences_per_replica * fewer * keep:
        return f"{sig.in_flight} requests in flight would not fit on {fewer} replica(s)"
    if fewer > 0 and sig.kv_max * ctx.target / fewer > s.kv_cache_high_usage:
        return f"KV cache usage {sig.kv_max:.0%} would exceed {s.kv_cache_high_usage:.0%}"
    if fewer == 0 and arriving:
        return "requests still arrive, so the last replica stays"
    return None


def _scale_down(ctx: _Context) -> Outcome:
    """One replica fewer once the peak of the last downscale_sustain_s fits on one fewer (the policy must
    have watched that long) and the last scale-down is a cooldown ago; else hold, saying why."""
    snap, s, state = ctx.snapshot, ctx.config.settings, ctx.state
    if _cooling(ctx) and max(_signals(ctx).need_ttft, _signals(ctx).need_queue) > ctx.target:
        return ctx.hold("upscale_cooldown", "TTFT or queueing is high but a scale-up just finished")
    if ctx.target <= s.min_replicas:
        return ctx.hold("at_min_replicas", f"min_replicas is {s.min_replicas}; {_signals(ctx).describe()}")
    why_not = _fewer_fit(ctx, ctx.target - 1)
    if why_not is not None:
        return ctx.hold("load_in_band", f"{why_not}; {_signals(ctx).describe()}")
    seen_s = watched_s(state.rate_history, snap.now_s)
    if state.last_scale_up_ready_s is not None:
        seen_s = min(seen_s, snap.now_s - state.last_scale_up_ready_s)
    if seen_s + 1e-9 < s.downscale_sustain_s:
        why = (
            f"load fits on one fewer, but the fleet was watched for {seen_s:.0f} of the "
            f"{s.downscale_sustain_s:.0f} s it must hold (since the last scale-up or the start)"
        )
        return ctx.hold("downscale_sustaining", why)
    last = state.last_scale_down_s
    if last is not None and snap.now_s - last + 1e-9 < s.downscale_cooldown_s:
        why = f"last scale-down {snap.now_s - last:.0f} s ago, cooldown {s.downscale_cooldown_s:.0f} s"
        return ctx.hold("downscale_cooldown", why)
    desired = _fewest_that_fit(ctx)
    fits = "one fewer" if desired == ctx.target - 1 else f"{desired}"
    why = f"the peak of the last {s.downscale_sustain_s:.0f} s fits on {fits}; {_signals(ctx).describe()}"
    return ctx.down(desired, "scale_down", why)


def _fewest_that_fit(ctx: _Context) -> int:
    """One fewer, or straight down to the fleet the peak needs with margin when that is smaller: a fleet
    left far above its load (after a surge) gives back its surplus in one step, not a replica per cooldown."""
    sig, s = _signals(ctx), ctx.config.settings
    if sig.replica_s_per_request is None:
        return ctx.target - 1
    needed = sig.with_surge(sig.peak_rps) * sig.replica_s_per_request / (1.0 - s.downscale_margin)
    fit = max(s.min_replicas, 1, math.ceil(needed - 1e-9))
    if fit < ctx.target - 1 and _fewer_fit(ctx, fit) is None:
        return fit
    return ctx.target - 1


_SIZING: tuple[Callable[[_Context], Outcome | None], ...] = (
    _scale_from_zero,
    _scale_up_in_progress,
    _scale_up,
    _at_max,
)


# --------------------------------------------------------------------------------------------------------
# The decision
# --------------------------------------------------------------------------------------------------------


def _note_finished_scale_up(snapshot: MetricsSnapshot, state: PolicyState) -> PolicyState:
    """Bookkeeping that needs no metrics: has the scale-up we asked for finished?"""
    starting = snapshot.replicas_starting > 0 or snapshot.target_replicas > snapshot.current_replicas
    if state.in_progress is not None and not starting:
        return replace(state, in_progress=None, last_scale_up_ready_s=snapshot.now_s)
    return state


def _observe(snapshot: MetricsSnapshot, state: PolicyState, config: PolicyConfig) -> PolicyState:
    """Fold this snapshot's arrival rate and engine counters into the state."""
    history = rate_history(state.rate_history, snapshot, config.history_s, config.settings.client_retries)
    service = estimate_service(
        snapshot.engine_rates(), snapshot.window_s, state.service, config.capacity_seed
    )
    # The surge headroom changes only with a new report, so it is measured then and kept.
    surge_rps = (
        state.surge_rps if history is state.rate_history else surge_headroom(history, snapshot.now_s, config)
    )
    return replace(state, rate_history=history, service=service, surge_rps=surge_rps)


def decide(snapshot: MetricsSnapshot, state: PolicyState, config: PolicyConfig) -> Outcome:
    """Desired replica count for ``snapshot``; returns the decision and the state for the next call.

    Pure: the same inputs always give the same outputs. The guards run first (bounds, stale or missing
    metrics), then the sizing steps, in order; the first to decide wins, and scale-down is the last word.
    """
    state = _note_finished_scale_up(snapshot, state)
    ctx = _Context(snapshot, state, config)
    for guard in _GUARDS:
        if (outcome := guard(ctx)) is not None:
            return outcome
    state = _observe(snapshot, state, config)
    service = state.service if state.service is not None else config.capacity_seed
    sig = measure(snapshot, state.rate_history, service, state.surge_rps, config)
    ctx = _Context(snapshot, state, config, sig)
    for step in _SIZING:
        if (outcome := step(ctx)) is not None:
            return outcome
    return _scale_down(ctx)
