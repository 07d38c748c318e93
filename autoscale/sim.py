"""Replays a request trace against a fleet of simulated vLLM replicas under an autoscaling policy.

Request-level and discrete-event: every request of a :class:`~autoscale.workload.RequestTrace` arrives
at its time with its prompt and output length; Serve's router sends it to the less loaded of two random
serving replicas (power of two choices on requests in flight) unless both hold ``max_ongoing_requests``,
then to the least loaded. When every replica is full, the deployment's
:class:`~autoscale.calibration.Admission` decides: the request waits at the router, or (headroom's
overload refusal) the replica refuses it with 503 + Retry-After and the client sends it again later,
a few times at most; a request refused every time fails. Each replica is a
:class:`~autoscale.replica_engine.ReplicaEngine` (continuous batching, chunked prefill, sequence slots,
KV cache; step costs from a calibration file). A replica asked for serves ``startup_s`` later and costs
GPU time from the moment it is asked for; a removed one stops taking requests, finishes what it holds
within ``graceful_shutdown_s`` (requests still running then fail), then goes.

Time advances in ticks of one second (Ray's controller decides more often, but its replica metrics arrive
every ``report_interval_s``, 10 s in Ray 2.60): between ticks the requests arrive in order; at each tick
the engines are brought up to date, every ``report_interval_s`` each serving replica's report
(:class:`~autoscale.replica_stats.ReplicaStatsWindow`, the live replicas' code) is taken, and every
``control_interval_s`` the policy sees the latest reports and sets the replica target. After the trace
ends the replicas finish what they hold (cost is counted to the end of the trace only).

Pure: no Ray, no serve_app; matplotlib only inside autoscale/report.py.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from heapq import heappop, heappush
from typing import Any, Protocol

import numpy as np

from autoscale.calibration import Admission, EngineCost, EngineLimits
from autoscale.inputs import MetricsSnapshot, PolicyConfig, ReplicaMetrics
from autoscale.policy import PolicyState, decide
from autoscale.ray_default import RayKnobs, RayState, ray_default_decide
from autoscale.replica_engine import ReplicaEngine, Requests
from autoscale.replica_stats import ReplicaStatsWindow
from autoscale.workload import RequestTrace

__all__ = [
    "Fleet",
    "HeadroomPolicy",
    "StepOracle",
    "RayDefaultPolicy",
    "ScaleEvent",
    "SimPolicy",
    "SimResult",
    "SimSetup",
    "StaticPolicy",
    "simulate",
    "ttft_bins",
]

DRAIN_TAIL_S = 300.0
"""After the trace ends, the replicas get this long to give every admitted request its first token."""


@dataclass(frozen=True, slots=True)
class SimSetup:
    """Everything about a run except the trace and the policy."""

    cost: EngineCost
    limits: EngineLimits
    ttft_target_ms: float
    startup_s: float
    initial_replicas: int
    window_s: float = 30.0
    report_interval_s: float = 10.0
    graceful_shutdown_s: float = 20.0
    seed: int = 0
    admission: Admission = Admission()


class _Phase(Enum):
    STARTING = 0
    READY = 1
    DRAINING = 2
    GONE = 3


@dataclass(eq=False)
class _Replica:
    engine: ReplicaEngine
    asked_s: float
    ready_s: float
    phase: _Phase
    stopped_s: float = math.inf
    gone_s: float = math.inf
    report: dict[str, float] | None = None


@dataclass(frozen=True, slots=True)
class ScaleEvent:
    t_s: float
    from_replicas: int
    to_replicas: int
    code: str
    reason: str


class SimPolicy(Protocol):
    name: str

    def reset(self) -> None: ...

    def __call__(self, fleet: Fleet) -> tuple[int, str, str]:
        """The replica target, a reason code and a sentence."""
        ...


class Fleet:
    """The replicas, the router and what the policy may look at (the controller's view)."""

    def __init__(self, setup: SimSetup, requests: Requests, rng: np.random.Generator) -> None:
        self.setup, self.requests = setup, requests
        self._picks: list[float] = rng.random(2 * len(requests.arrival_s)).tolist()
        self.replicas: list[_Replica] = []
        self.router_queue: deque[int] = deque()
        self.retries: list[tuple[float, int]] = []
        """Refused requests' next attempts, a heap of (time, request id)."""
        self.refused = 0
        self.now_s = 0.0
        self.target_replicas = 0
        self.reported_at_s = -math.inf
        self._ready: list[_Replica] = []
        self._next_ready_s = math.inf
        self._ongoing_samples: deque[tuple[float, float]] = deque()
        for _ in range(setup.initial_replicas):
            self._add(0.0, ready_s=0.0)
        self.target_replicas = setup.initial_replicas

    # -- the controller's view -------------------------------------------------------------------------

    @property
    def current_replicas(self) -> int:
        return len(self._ready)

    @property
    def replicas_starting(self) -> int:
        return sum(1 for r in self.replicas if r.phase is _Phase.STARTING)

    def snapshot(self) -> MetricsSnapshot:
        """The latest reports of the serving replicas, as Ray's controller holds them."""
        reports = [(i, r.report) for i, r in enumerate(self.replicas) if r.phase is _Phase.READY and r.report]
        metrics = tuple(ReplicaMetrics.from_report(f"r{i}", rep) for i, rep in reports)
        rates = [rep["arrival_rate_rps"] for _, rep in reports]
        refused = [rep.get("refused_rate_rps", 0.0) for _, rep in reports]
        return MetricsSnapshot(
            now_s=self.now_s,
            taken_at_s=self.reported_at_s,
            replicas=metrics,
            arrival_rate_rps=sum(rates) if rates else None,
            refused_rate_rps=sum(refused),
            current_replicas=self.current_replicas,
            target_replicas=self.target_replicas,
            replicas_starting=self.replicas_starting,
            queued_at_router=len(self.router_queue),
            window_s=self.setup.window_s,
        )

    def mean_ongoing_requests(self, look_back_s: float) -> float:
        """Ray's total_num_requests: requests at replicas plus queued, averaged over the look-back window
        ending at the latest report."""
        end = self.reported_at_s
        vals = [v for t, v in self._ongoing_samples if end - look_back_s < t <= end]
        return float(np.mean(vals)) if vals else 0.0

    # -- fleet changes ---------------------------------------------------------------------------------

    def _add(self, now_s: float, ready_s: float) -> None:
        window = ReplicaStatsWindow(self.setup.window_s)
        engine = ReplicaEngine(self.setup.cost, self.setup.limits, self.requests, window, ready_s)
        phase = _Phase.READY if ready_s <= now_s else _Phase.STARTING
        rep = _Replica(engine, now_s, ready_s, phase)
        self.replicas.append(rep)
        if phase is _Phase.READY:
            self._ready.append(rep)
        else:
            self._next_ready_s = min(self._next_ready_s, ready_s)

    def apply_target(self, desired: int) -> None:
        """Adds replicas (they serve after start-up) or stops the newest starting ones, then the least
        loaded serving ones."""
        desired, now = max(0, desired), self.now_s
        active = [r for r in self.replicas if r.phase in (_Phase.STARTING, _Phase.READY)]
        for _ in range(desired - len(active)):
            self._add(now, now + self.setup.startup_s)
        drop = len(active) - desired
        starting = sorted((r for r in active if r.phase is _Phase.STARTING), key=lambda r: -r.ready_s)
        for r in starting[: max(0, drop)]:
            r.phase, r.stopped_s, r.gone_s = _Phase.GONE, now, now
        ready = sorted(self._ready, key=lambda r: r.engine.ongoing)
        for r in ready[: max(0, drop - len(starting))]:
            r.phase, r.stopped_s = _Phase.DRAINING, now
            self._ready.remove(r)
        self.target_replicas = desired

    def _promote(self, now_s: float) -> None:
        if now_s < self._next_ready_s:
            return
        self._next_ready_s = math.inf
        for r in self.replicas:
            if r.phase is _Phase.STARTING:
                if r.ready_s <= now_s:
                    r.phase = _Phase.READY
                    self._ready.append(r)
                else:
                    self._next_ready_s = min(self._next_ready_s, r.ready_s)

    # -- requests --------------------------------------------------------------------------------------

    def arrive(self, rid: int, t: float) -> None:
        """A request (or a refused request's next attempt) arrives at ``t``."""
        self._promote(t)
        if self.router_queue:
            self._dispatch_queue(t)
        if self.router_queue:
            self.router_queue.append(rid)
            return
        sent, full = self._send(rid, t)
        if sent:
            return
        if full is not None and self.setup.admission.refuses:
            self._refuse(rid, t, full)
        else:
            self.router_queue.append(rid)

    def _refuse(self, rid: int, t: float, replica: ReplicaEngine) -> None:
        """The replica answers 503 + Retry-After (it counted the attempt); the client tries again later."""
        admission, req = self.setup.admission, self.requests
        replica.window.request_arrived(t)
        replica.window.request_refused(t)
        self.refused += 1
        if req.attempts[rid] >= admission.client_retries:
            req.failed[rid] = True
            return
        req.attempts[rid] += 1
        assert admission.retry_after_s is not None
        heappush(self.retries, (t + admission.retry_after_s, rid))

    def _send(self, rid: int, t: float) -> tuple[bool, ReplicaEngine | None]:
        """Power of two choices on the replicas' request counts as last seen (Serve's router caches
        them too); the chosen engine is brought up to ``t`` before the request joins it. Returns whether
        it was sent and, if not, the full replica that would refuse it (None: no replica serves)."""
        ready = self._ready
        if not ready:
            return False, None
        n = len(ready)
        a = ready[int(self._picks[2 * rid] * n)].engine
        b = ready[int(self._picks[2 * rid + 1] * n)].engine
        pick = a if a.ongoing <= b.ongoing else b
        pick.advance(t)
        limit = self.setup.limits.max_ongoing_requests
        if pick.ongoing >= limit:
            for r in ready:
                r.engine.advance(t)
            pick = min((r.engine for r in ready), key=lambda e: e.ongoing)
            if pick.ongoing >= limit:
                return False, pick
        self.requests.sent_s[rid] = t
        pick.submit(rid, t)
        return True, None

    def _dispatch_queue(self, t: float) -> None:
        limit = self.setup.limits.max_ongoing_requests
        for r in self._ready:
            r.engine.advance(t)
        while self.router_queue and self._ready:
            pick = min(self._ready, key=lambda r: r.engine.ongoing)
            if pick.engine.ongoing >= limit:
                return
            rid = self.router_queue.popleft()
            self.requests.sent_s[rid] = t
            pick.engine.submit(rid, t)

    # -- ticks -----------------------------------------------------------------------------------------

    def tick(self, now_s: float) -> None:
        """Brings every engine up to ``now_s``, retires drained replicas, samples the ongoing requests."""
        self.now_s = now_s
        self._promote(now_s)
        ongoing = len(self.router_queue)
        for r in self.replicas:
            if r.phase is _Phase.READY:
                r.engine.advance(now_s)
                ongoing += r.engine.ongoing
            elif r.phase is _Phase.DRAINING:
                r.engine.advance(now_s)
                if r.engine.ongoing == 0 or now_s - r.stopped_s >= self.setup.graceful_shutdown_s:
                    for rid in r.engine.in_flight():
                        self.requests.failed[rid] = True
                    r.phase, r.gone_s = _Phase.GONE, now_s
        if self.router_queue:
            self._dispatch_queue(now_s)
        self._ongoing_samples.append((now_s, float(ongoing)))
        while self._ongoing_samples and self._ongoing_samples[0][0] < now_s - 900.0:
            self._ongoing_samples.popleft()

    def take_reports(self) -> None:
        for r in self._ready:
            r.engine.publish_scheduler_state()
            r.report = r.engine.window.report(self.now_s)
        self.reported_at_s = self.now_s

    def provisioned(self) -> int:
        return sum(1 for r in self.replicas if r.phase is not _Phase.GONE)

    def replica_seconds(self, end_s: float) -> float:
        return sum(max(0.0, min(r.gone_s, end_s) - r.asked_s) for r in self.replicas)


# --------------------------------------------------------------------------------------------------------
# Policies
# --------------------------------------------------------------------------------------------------------


@dataclass
class StaticPolicy:
    """A fixed fleet."""

    replicas: int
    name: str = "static"

    def reset(self) -> None:
        pass

    def __call__(self, fleet: Fleet) -> tuple[int, str, str]:
        return self.replicas, "static", f"static fleet of {self.replicas}"


@dataclass
class StepOracle:
    """A reference for the step trace, not a policy a deployment can run: it keeps ``before`` replicas
    and asks for ``during`` at the very second the load steps up (no detection delay), and goes back at
    the second it steps down. Its replicas take the same start-up as anyone's, so what it misses with
    ``before`` replicas serving when the step comes, any policy that has only that many then misses too."""

    up_at_s: float
    down_at_s: float
    before: int
    during: int
    name: str = "step-oracle"

    def reset(self) -> None:
        pass

    def __call__(self, fleet: Fleet) -> tuple[int, str, str]:
        on = self.up_at_s <= fleet.now_s < self.down_at_s
        return (self.during if on else self.before), "oracle", "knows when the step comes"


@dataclass
class HeadroomPolicy:
    """headroom's policy (:func:`autoscale.policy.decide`) on the fleet's reports."""

    config: PolicyConfig
    name: str = "headroom"
    state: PolicyState = field(default_factory=PolicyState)
    codes: Counter[str] = field(default_factory=Counter)

    def reset(self) -> None:
        self.state = PolicyState()
        self.codes = Counter()

    def __call__(self, fleet: Fleet) -> tuple[int, str, str]:
        decision, self.state = decide(fleet.snapshot(), self.state, self.config)
        self.codes[decision.code] += 1
        return decision.desired_replicas, decision.code, decision.reason


@dataclass
class RayDefaultPolicy:
    """Ray Serve's default policy (:mod:`autoscale.ray_default`) on the fleet's ongoing requests."""

    knobs: RayKnobs
    name: str = "ray-default"
    state: RayState = field(default_factory=RayState)

    def reset(self) -> None:
        self.state = RayState()

    def __call__(self, fleet: Fleet) -> tuple[int, str, str]:
        total = fleet.mean_ongoing_requests(self.knobs.look_back_period_s)
        desired, self.state = ray_default_decide(
            fleet.current_replicas, fleet.target_replicas, total, fleet.now_s, self.state, self.knobs
        )
        why = f"{total:.1f} ongoing requests / target {self.knobs.target_ongoing_requests:g} per replica"
        return desired, "ray_default", why


# --------------------------------------------------------------------------------------------------------
# Results
# --------------------------------------------------------------------------------------------------------


@dataclass(eq=False)
class SimResult:
    """Outcome of one trace under one policy."""

    trace: str
    policy: str
    seed: int
    ttft_target_ms: float
    duration_s: float
    requests: int
    failed: int
    refused: int
    """Attempts the replicas refused (503 + Retry-After); a request refused every time also failed."""
    attainment: float
    """Fraction of all requests whose TTFT was <= the target (never served or failed counts as missed)."""
    ttft_p50_ms: float
    ttft_p95_ms: float
    ttft_p99_ms: float
    replica_hours: float
    peak_replicas: int
    scale_events: int
    direction_changes: int
    max_direction_changes_per_10min: int
    events: list[ScaleEvent] = field(default_factory=list)
    timeline: dict[str, Any] | None = None
    codes: dict[str, int] = field(default_factory=dict)

    SUMMARY_FIELDS = (
        "trace",
        "policy",
        "seed",
        "ttft_target_ms",
        "requests",
        "failed",
        "refused",
        "attainment",
        "ttft_p50_ms",
        "ttft_p95_ms",
        "ttft_p99_ms",
        "replica_hours",
        "peak_replicas",
        "scale_events",
        "direction_changes",
        "max_direction_changes_per_10min",
    )

    def summary(self) -> dict[str, Any]:
        return {
            k: round(v, 6) if isinstance(v, float) else v
            for k in self.SUMMARY_FIELDS
            for v in [getattr(self, k)]
        }


def direction_stats(events: list[ScaleEvent], window_s: float = 600.0) -> tuple[int, int]:
    """(direction changes, most changes within any ``window_s``)."""
    times: list[float] = []
    prev = 0
    for e in events:
        sign = 1 if e.to_replicas > e.from_replicas else -1
        if prev and sign != prev:
            times.append(e.t_s)
        prev = sign
    worst = j = 0
    for i, t in enumerate(times):
        while times[j] <= t - window_s:
            j += 1
        worst = max(worst, i - j + 1)
    return len(times), worst


def _timeline(
    trace: RequestTrace,
    ttft: np.ndarray,
    ok: np.ndarray,
    provisioned: list[int],
    ready: list[int],
    bin_s: float,
) -> dict[str, Any]:
    return {
        "bin_s": bin_s,
        "rate_rps": trace.rate_per_bin(bin_s).tolist(),
        **ttft_bins(trace.arrival_s, ttft, ok, trace.duration_s, bin_s),
        "provisioned": provisioned,
        "ready": ready,
    }


def ttft_bins(
    arrival_s: np.ndarray, ttft_ms: np.ndarray, ok: np.ndarray, duration_s: float, bin_s: float
) -> dict[str, list[Any]]:
    """Per ``bin_s`` of arrival: TTFT p95 (nan where nothing arrived) and the arrivals that missed the target
    (``~ok``: late, failed, unserved). The simulator's timelines and the GPU replay's measured ones."""
    nb = max(1, math.ceil(duration_s / bin_s))
    bins = np.minimum((np.asarray(arrival_s) // bin_s).astype(np.int64), nb - 1)
    in_bin = [ttft_ms[bins == b] for b in range(nb)]
    p95 = [float(np.percentile(v, 95.0)) if len(v) else math.nan for v in in_bin]
    return {"ttft_p95_ms": p95, "missed": np.bincount(bins[~ok], minlength=nb).tolist()}


# --------------------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------------------


def simulate(
    trace: RequestTrace,
    policy: SimPolicy,
    setup: SimSetup,
    *,
    control_interval_s: float = 1.0,
    keep_timeline: bool = False,
    timeline_bin_s: float = 30.0,
    on_event: Callable[[ScaleEvent], None] | None = None,
) -> SimResult:
    """Replays ``trace`` under ``policy``; deterministic given ``setup.seed``. With ``keep_timeline``, the
    result's timeline bins arrivals by ``timeline_bin_s``."""
    policy.reset()
    requests = Requests.create(
        trace.arrival_s.tolist(), trace.prompt_tokens.tolist(), trace.output_tokens.tolist()
    )
    fleet = Fleet(setup, requests, np.random.default_rng([setup.seed, 3]))
    events: list[ScaleEvent] = []
    provisioned: list[int] = []
    ready: list[int] = []
    arrivals, n, i = requests.arrival_s, len(requests.arrival_s), 0
    every_report = max(1, round(setup.report_interval_s))
    every_control = max(1, round(control_interval_s))
    retries = fleet.retries
    for k in range(1, math.ceil(trace.duration_s) + 1):
        while True:  # first attempts and refused requests' next ones, in time order
            if retries and retries[0][0] < k and (i >= n or retries[0][0] < arrivals[i]):
                t, rid = heappop(retries)
                fleet.arrive(rid, t)
            elif i < n and arrivals[i] < k:
                fleet.arrive(i, arrivals[i])
                i += 1
            else:
                break
        fleet.tick(float(k))
        if k % every_report == 0:
            fleet.take_reports()
        if k % every_control == 0:
            before = fleet.target_replicas
            desired, code, reason = policy(fleet)
            if desired != before:
                events.append(ScaleEvent(float(k), before, desired, code, reason))
                if on_event is not None:
                    on_event(events[-1])
                fleet.apply_target(desired)
        provisioned.append(fleet.provisioned())
        ready.append(fleet.current_replicas)
    end_s = float(math.ceil(trace.duration_s))
    for extra in range(1, int(DRAIN_TAIL_S) + 1):
        while retries and retries[0][0] < end_s + extra:
            t, rid = heappop(retries)
            fleet.arrive(rid, t)
        fleet.tick(end_s + extra)
    timeline_bin = timeline_bin_s if keep_timeline else None
    return _result(trace, policy, setup, fleet, events, provisioned, ready, timeline_bin)


def _result(
    trace: RequestTrace,
    policy: SimPolicy,
    setup: SimSetup,
    fleet: Fleet,
    events: list[ScaleEvent],
    provisioned: list[int],
    ready: list[int],
    timeline_bin_s: float | None,
) -> SimResult:
    req = fleet.requests
    ttft = np.asarray(req.ttft_ms, dtype=float)
    failed = np.asarray(req.failed, dtype=bool)
    missed = np.isnan(ttft) | failed
    ok = ~missed & (ttft <= setup.ttft_target_ms)
    # A request with no first token (refused every time, or never served) waited at least until the run
    # ended: that finite lower bound keeps the percentiles defined.
    end_ms = (math.ceil(trace.duration_s) + DRAIN_TAIL_S) * 1000.0
    shown = np.where(np.isnan(ttft), end_ms, ttft)
    pcts = np.percentile(shown, [50.0, 95.0, 99.0]).tolist() if len(shown) else [0.0, 0.0, 0.0]
    changes, worst = direction_stats(events)
    end_s = float(math.ceil(trace.duration_s))
    return SimResult(
        trace=trace.name,
        policy=policy.name,
        seed=setup.seed,
        ttft_target_ms=setup.ttft_target_ms,
        duration_s=end_s,
        requests=len(ttft),
        failed=int(failed.sum()),
        refused=fleet.refused,
        attainment=float(ok.mean()) if len(ok) else 1.0,
        ttft_p50_ms=pcts[0],
        ttft_p95_ms=pcts[1],
        ttft_p99_ms=pcts[2],
        replica_hours=fleet.replica_seconds(end_s) / 3600.0,
        peak_replicas=max(provisioned, default=0),
        scale_events=len(events),
        direction_changes=changes,
        max_direction_changes_per_10min=worst,
        events=events,
        timeline=None
        if timeline_bin_s is None
        else _timeline(trace, shown, ok, provisioned, ready, timeline_bin_s),
        codes=dict(getattr(policy, "codes", {})),
    )
