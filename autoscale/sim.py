"""Discrete-time replay of an arrival trace against a fleet of vLLM replicas, for comparing autoscalers.

Model, one step (``dt_s``, default 1 s) at a time:

* Requests arrive as a Poisson process whose rate follows a :class:`Trace`. Every request has an output
  length (lognormal) and a TTFT noise draw, generated up front from the seed, so every policy replays the
  very same requests.
* The router (Ray Serve's handle) sends a request to the less loaded of two random ready replicas (power
  of two choices) if it has a free slot; a replica holds at most ``LatencyModel.max_num_seqs`` requests
  (continuous batching; Serve's ``max_ongoing_requests`` set to the same value). Requests that find every
  replica full, or no replica at all, wait in one FIFO queue at the router.
* TTFT = router queue wait + prefill time, the prefill time drawn from a lognormal whose p50 and p95 are the
  ladder's TTFT at the replica's batch size (interpolated) scaled by prompt length. Decode advances every
  running request by ``dt / TPOT(batch size)`` tokens per step; a request leaves when its output is done.
* A replica asked for serves only ``replica_startup_s`` later (and costs GPU time from the moment it is
  asked for). A replica removed stops taking requests, finishes the ones it holds, then goes.
* A policy is called every ``control_interval_s`` with a view of the fleet and returns the replica target.

Calibration (:class:`LatencyModel`) is explicit and overridable: the default ladder is the Qwen3-8B shape on
one H200 from the lab (see the ``measured`` flags), and :meth:`LatencyModel.from_json` loads the ladder
files (concurrency -> ttft_p50_ms, ttft_p95_ms, tpot_p50_ms) that GPU/CPU ladder runs write.

Pure: imports neither ray nor vllm; matplotlib is imported inside :func:`plot` only.
"""

from __future__ import annotations

import csv
import json
import math
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from autoscale.policy import (
    Decision,
    MetricsSnapshot,
    PolicyConfig,
    PolicyState,
    ReplicaMetrics,
    decide,
)

__all__ = [
    "QWEN3_8B_H200_LADDER",
    "FleetView",
    "HeadroomPolicy",
    "LadderPoint",
    "LatencyModel",
    "RayDefaultPolicy",
    "ScaleEvent",
    "SimPolicy",
    "SimResult",
    "StaticPolicy",
    "Timeline",
    "Trace",
    "bursty_trace",
    "constant_trace",
    "diurnal_trace",
    "plot",
    "simulate",
    "step_trace",
    "to_table",
    "trace_from_csv",
]

_Z95 = 1.6448536269514722


# --------------------------------------------------------------------------------------------------------
# Latency model
# --------------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LadderPoint:
    """One step of a tuning ladder: closed-loop load at ``concurrency`` requests in flight per replica."""

    concurrency: int
    ttft_p50_ms: float
    ttft_p95_ms: float
    tpot_p50_ms: float
    measured: bool = False
    """True where the numbers come from a measurement, False where they are interpolated or assumed."""


QWEN3_8B_H200_LADDER: tuple[LadderPoint, ...] = (
    # Qwen3-8B shape, bf16, one H200, 2048-token prompts without a shared prefix, max_num_seqs=256,
    # chunked prefill. Measured in the lab (2026-11-29, design.md): TTFT p50 193 ms at moderate
    # concurrency (placed at 32) and 209 ms at concurrency 64. Everything else is an assumption to be
    # replaced by a ladder run (LatencyModel.from_json): p95/p50 of 1.4-2 from prefills queueing behind
    # each other, TTFT growing steeply past 64 as the prefill share of each step saturates, and TPOT
    # growing with the batch because a 2048-token prefill is chunked into every few decode steps
    # (prefix caching raised output throughput 2.5x in the lab, so prefill dominates the step).
    LadderPoint(1, 55.0, 70.0, 7.5),
    LadderPoint(4, 90.0, 130.0, 8.5),
    LadderPoint(8, 120.0, 175.0, 9.5),
    LadderPoint(16, 160.0, 240.0, 11.5),
    LadderPoint(32, 193.0, 300.0, 15.0, measured=True),
    LadderPoint(64, 209.0, 360.0, 22.0, measured=True),
    LadderPoint(96, 300.0, 560.0, 29.0),
    LadderPoint(128, 420.0, 820.0, 36.0),
    LadderPoint(192, 700.0, 1400.0, 50.0),
    LadderPoint(256, 1000.0, 2100.0, 64.0),
)

_PREFIX_CACHED_TTFT_SCALE = 84.0 / 193.0
"""Lab: a 2048-token shared prefix cut TTFT p50 from 193 to 84 ms ..."""
_PREFIX_CACHED_TPOT_SCALE = 1.0 / 2.5
"""... and raised output throughput 2.5x (taken here as TPOT / 2.5 at the same concurrency)."""


@dataclass(frozen=True, slots=True)
class LatencyModel:
    """Per-replica latency as a function of batch size, from ladder points (linear interpolation)."""

    ladder: tuple[LadderPoint, ...] = QWEN3_8B_H200_LADDER
    ladder_prompt_tokens: int = 2048
    """Prompt length the ladder was measured with."""
    prompt_tokens: int = 2048
    """Prompt length of the simulated requests; prefill time scales linearly from the ladder's."""
    output_tokens_mean: float = 256.0
    output_tokens_sigma: float = 0.6
    """Sigma of the lognormal output-length distribution."""
    output_tokens_min: int = 16
    output_tokens_max: int = 2048
    max_num_seqs: int = 256
    """Requests one replica runs at once (vLLM max_num_seqs = Serve max_ongoing_requests)."""
    kv_cache_tokens: int = 794_704
    """KV cache of one replica in tokens (lab: Qwen3-8B shape, H200, gpu_memory_utilization 0.9)."""
    source: str = (
        "Qwen3-8B shape on one H200 (lab 2026-11-29 anchors + assumptions, see QWEN3_8B_H200_LADDER)"
    )

    def __post_init__(self) -> None:
        if len(self.ladder) < 1:
            raise ValueError("LatencyModel.ladder needs at least one point")
        cs = [p.concurrency for p in self.ladder]
        if any(b <= a for a, b in zip(cs, cs[1:], strict=False)):
            raise ValueError(f"ladder concurrencies must be strictly increasing, got {cs}")
        for p in self.ladder:
            if p.concurrency < 1 or p.ttft_p50_ms <= 0 or p.tpot_p50_ms <= 0:
                raise ValueError(f"ladder point {p} must have concurrency >= 1 and positive latencies")
            if p.ttft_p95_ms < p.ttft_p50_ms:
                raise ValueError(
                    f"ladder point at concurrency {p.concurrency}: ttft_p95_ms ({p.ttft_p95_ms}) must be >= "
                    f"ttft_p50_ms ({p.ttft_p50_ms})"
                )

    # -- curves (vectorised over concurrency) ------------------------------------------------------------

    def _x(self) -> np.ndarray:
        return np.array([p.concurrency for p in self.ladder], dtype=float)

    @property
    def _prompt_scale(self) -> float:
        return self.prompt_tokens / self.ladder_prompt_tokens

    def ttft_p50_ms(self, concurrency: Any) -> Any:
        ys = np.array([p.ttft_p50_ms for p in self.ladder])
        return np.interp(concurrency, self._x(), ys) * self._prompt_scale

    def ttft_p95_ms(self, concurrency: Any) -> Any:
        ys = np.array([p.ttft_p95_ms for p in self.ladder])
        return np.interp(concurrency, self._x(), ys) * self._prompt_scale

    def tpot_ms(self, concurrency: Any) -> Any:
        ys = np.array([p.tpot_p50_ms for p in self.ladder])
        return np.interp(concurrency, self._x(), ys)

    def ttft_sigma(self, concurrency: Any) -> Any:
        """Lognormal sigma that puts the p95 at the ladder's p95 for the ladder's p50."""
        return np.log(self.ttft_p95_ms(concurrency) / self.ttft_p50_ms(concurrency)) / _Z95

    def mean_service_s(self, concurrency: float) -> float:
        """Seconds one request occupies a slot: TTFT p50 + mean output * TPOT."""
        c = float(concurrency)
        return float(self.ttft_p50_ms(c) + self.output_tokens_mean * self.tpot_ms(c)) / 1000.0

    def throughput_rps(self, concurrency: float) -> float:
        """Requests per second one replica completes at ``concurrency`` in flight (Little's law)."""
        return float(concurrency) / self.mean_service_s(concurrency)

    def slo_concurrency(self, ttft_p95_target_ms: float) -> float:
        """Largest concurrency (interpolated) whose TTFT p95 stays within ``ttft_p95_target_ms``."""
        grid = np.linspace(1.0, float(self.max_num_seqs), 4 * self.max_num_seqs)
        ok = grid[self.ttft_p95_ms(grid) <= ttft_p95_target_ms]
        return float(ok[-1]) if ok.size else 1.0

    def capacity_rps(self, ttft_p95_target_ms: float) -> float:
        """Requests per second one replica serves with TTFT p95 at the target (the policy's capacity)."""
        return self.throughput_rps(self.slo_concurrency(ttft_p95_target_ms))

    # -- constructors ------------------------------------------------------------------------------------

    @classmethod
    def qwen3_8b_h200(cls, prefix_cached: bool = False, **overrides: Any) -> LatencyModel:
        """The lab's reference shape; ``prefix_cached`` applies the measured prefix-caching gains."""
        if not prefix_cached:
            return cls(**overrides)
        ladder = tuple(
            LadderPoint(
                p.concurrency,
                p.ttft_p50_ms * _PREFIX_CACHED_TTFT_SCALE,
                p.ttft_p95_ms * _PREFIX_CACHED_TTFT_SCALE,
                p.tpot_p50_ms * _PREFIX_CACHED_TPOT_SCALE,
                p.measured,
            )
            for p in QWEN3_8B_H200_LADDER
        )
        src = (
            "Qwen3-8B shape on one H200 with a shared 2048-token prefix (lab ratios 84/193 TTFT, 2.5x output)"
        )
        return cls(ladder=ladder, source=src, **overrides)

    @classmethod
    def from_json(
        cls, path_or_data: str | Path | Mapping[str, Any] | Sequence[Any], **overrides: Any
    ) -> LatencyModel:
        """Load a ladder: a list of points, or ``{"points" | "ladder" | "steps": [...], <field>: ...}``.

        Each point needs ``concurrency``, ``ttft_p50_ms``, ``ttft_p95_ms`` and ``tpot_p50_ms``; other keys
        are ignored. Top-level keys that are LatencyModel fields (``prompt_tokens``,
        ``output_tokens_mean``, ...) are used too; ``overrides`` win over both.
        """
        if isinstance(path_or_data, (str, Path)):
            data: Any = json.loads(Path(path_or_data).read_text())
            source = str(path_or_data)
        else:
            data = path_or_data
            source = "ladder data"
        fields: dict[str, Any] = {}
        if isinstance(data, Mapping):
            points = next((data[k] for k in ("points", "ladder", "steps") if k in data), None)
            if points is None:
                raise ValueError("ladder JSON object needs a 'points' (or 'ladder'/'steps') list")
            known = set(cls.__dataclass_fields__) - {"ladder"}
            fields = {k: v for k, v in data.items() if k in known}
        else:
            points = data
        ladder = []
        for i, p in enumerate(points):
            missing = [k for k in ("concurrency", "ttft_p50_ms", "ttft_p95_ms", "tpot_p50_ms") if k not in p]
            if missing:
                raise ValueError(f"ladder point {i} lacks {', '.join(missing)}: {p}")
            ladder.append(
                LadderPoint(
                    int(p["concurrency"]),
                    float(p["ttft_p50_ms"]),
                    float(p["ttft_p95_ms"]),
                    float(p["tpot_p50_ms"]),
                    True,
                )
            )
        ladder.sort(key=lambda p: p.concurrency)
        fields.setdefault("source", source)
        fields.update(overrides)
        return cls(ladder=tuple(ladder), **fields)


# --------------------------------------------------------------------------------------------------------
# Traces
# --------------------------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class Trace:
    """Arrival rate (requests per second) for each step of ``dt_s`` seconds."""

    name: str
    rate_rps: np.ndarray
    dt_s: float = 1.0

    @property
    def duration_s(self) -> float:
        return len(self.rate_rps) * self.dt_s

    @property
    def peak_rps(self) -> float:
        return float(np.max(self.rate_rps)) if len(self.rate_rps) else 0.0

    @property
    def mean_rps(self) -> float:
        return float(np.mean(self.rate_rps)) if len(self.rate_rps) else 0.0


def _steps(duration_s: float, dt_s: float) -> np.ndarray:
    return np.arange(int(round(duration_s / dt_s))) * dt_s


def constant_trace(rps: float = 40.0, duration_s: float = 3600.0, dt_s: float = 1.0) -> Trace:
    return Trace("constant", np.full(len(_steps(duration_s, dt_s)), float(rps)), dt_s)


def step_trace(
    low_rps: float = 20.0,
    high_rps: float = 60.0,
    up_at_s: float = 900.0,
    down_at_s: float = 2700.0,
    duration_s: float = 4500.0,
    dt_s: float = 1.0,
) -> Trace:
    t = _steps(duration_s, dt_s)
    rate = np.where((t >= up_at_s) & (t < down_at_s), high_rps, low_rps).astype(float)
    return Trace("step", rate, dt_s)


def diurnal_trace(
    mean_rps: float = 40.0,
    amplitude_rps: float = 25.0,
    period_s: float = 7200.0,
    duration_s: float = 7200.0,
    dt_s: float = 1.0,
) -> Trace:
    """A compressed day: a sinusoid starting at its trough."""
    t = _steps(duration_s, dt_s)
    rate = mean_rps - amplitude_rps * np.cos(2.0 * math.pi * t / period_s)
    return Trace("diurnal", np.maximum(rate, 0.0), dt_s)


def bursty_trace(
    base_rps: float = 25.0,
    duration_s: float = 7200.0,
    seed: int = 7,
    mean_gap_s: float = 900.0,
    amplitude: tuple[float, float] = (0.6, 1.6),
    ramp_s: float = 120.0,
    hold_s: tuple[float, float] = (240.0, 720.0),
    dt_s: float = 1.0,
) -> Trace:
    """A base load with seeded random bursts: Poisson burst starts (mean gap ``mean_gap_s``), each adding
    ``uniform(*amplitude) * base_rps`` that ramps up over ``ramp_s``, holds ``uniform(*hold_s)`` and ramps
    down over ``ramp_s``. Bursts may overlap (they add)."""
    rng = np.random.default_rng(seed)
    t = _steps(duration_s, dt_s)
    rate = np.full(len(t), float(base_rps))
    start = float(rng.exponential(mean_gap_s))
    while start < duration_s:
        amp = float(rng.uniform(*amplitude)) * base_rps
        hold = float(rng.uniform(*hold_s))
        up_end, down_start = start + ramp_s, start + ramp_s + hold
        shape = np.clip((t - start) / ramp_s, 0.0, 1.0) * np.clip(
            (down_start + ramp_s - t) / ramp_s, 0.0, 1.0
        )
        rate += amp * shape
        del up_end
        start += float(rng.exponential(mean_gap_s))
    return Trace("bursty", rate, dt_s)


def trace_from_csv(path: str | Path, dt_s: float = 1.0, name: str | None = None) -> Trace:
    """A trace from a CSV with columns ``time_s,rps`` (header required), linearly interpolated."""
    times: list[float] = []
    rates: list[float] = []
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        if reader.fieldnames is None or not {"time_s", "rps"} <= set(reader.fieldnames):
            raise ValueError(f"{path}: needs a header with columns time_s,rps, got {reader.fieldnames}")
        for row in reader:
            times.append(float(row["time_s"]))
            rates.append(float(row["rps"]))
    if not times:
        raise ValueError(f"{path}: no rows")
    order = np.argsort(times)
    ts, rs = np.asarray(times)[order], np.asarray(rates)[order]
    if np.any(rs < 0):
        raise ValueError(f"{path}: rps must be >= 0")
    t = _steps(float(ts[-1]) + dt_s, dt_s)
    return Trace(name or Path(path).stem, np.interp(t, ts, rs), dt_s)


# --------------------------------------------------------------------------------------------------------
# Policies
# --------------------------------------------------------------------------------------------------------


class FleetView(Protocol):
    """What a policy may look at; implemented by the simulator."""

    @property
    def now_s(self) -> float: ...

    @property
    def current_replicas(self) -> int:
        """Replicas serving (ready, not draining)."""
        ...

    @property
    def target_replicas(self) -> int: ...

    @property
    def replicas_starting(self) -> int: ...

    def snapshot(self, window_s: float, rate_window_s: float) -> MetricsSnapshot: ...

    def mean_ongoing_requests(self, look_back_s: float) -> float: ...


class SimPolicy(Protocol):
    name: str
    control_interval_s: float

    def reset(self) -> None: ...

    def __call__(self, view: FleetView) -> tuple[int, str]:
        """The replica target and why."""
        ...


@dataclass
class StaticPolicy:
    """A fixed fleet (e.g. sized for the peak)."""

    replicas: int
    name: str = "static"
    control_interval_s: float = 60.0

    def reset(self) -> None:
        pass

    def __call__(self, view: FleetView) -> tuple[int, str]:
        return self.replicas, f"static fleet of {self.replicas}"


@dataclass
class HeadroomPolicy:
    """Our policy (:func:`autoscale.policy.decide`) driven from the simulator's observed window."""

    config: PolicyConfig
    window_s: float = 30.0
    """TTFT percentiles cover requests whose first token came in the last window_s."""
    rate_window_s: float = 15.0
    """Arrival rate is counted over the last rate_window_s."""
    control_interval_s: float = 5.0
    name: str = "headroom"
    state: PolicyState = field(default_factory=PolicyState)
    decisions: list[Decision] = field(default_factory=list)
    keep_decisions: bool = False

    def reset(self) -> None:
        self.state = PolicyState()
        self.decisions = []

    def __call__(self, view: FleetView) -> tuple[int, str]:
        snap = view.snapshot(self.window_s, self.rate_window_s)
        decision, self.state = decide(snap, self.state, self.config)
        if self.keep_decisions:
            self.decisions.append(decision)
        return decision.desired_replicas, decision.reason


@dataclass
class RayDefaultPolicy:
    """Ray Serve's default policy, modelled as Ray 2.60 implements it (no Ray import).

    Source: ``ray/serve/autoscaling_policy.py`` -- ``replica_queue_length_autoscaling_policy`` /
    ``_core_replica_queue_length_policy`` (desired = total ongoing requests / target_ongoing_requests, the
    total averaged over ``look_back_period_s``), ``_apply_scaling_factors`` (upscaling/downscaling factor on
    the delta, with the decrement-by-one rule), ``_apply_delay_logic`` (a direction must persist
    ``upscale_delay_s`` / ``downscale_delay_s`` before it is applied), ``_get_cold_start_scale_up_replicas``
    (0 replicas and requests waiting: scale up at once); bounds from
    ``ray/serve/_private/autoscaling_state.py`` (``apply_bounds``). Defaults are those of
    ``ray/serve/config.py`` ``AutoscalingConfig`` (target_ongoing_requests 2, upscale_delay_s 30,
    downscale_delay_s 600, look_back_period_s 30, smoothing/scaling factors 1.0).
    """

    target_ongoing_requests: float = 2.0
    min_replicas: int = 1
    max_replicas: int = 100
    upscale_delay_s: float = 30.0
    downscale_delay_s: float = 600.0
    downscale_to_zero_delay_s: float | None = None
    look_back_period_s: float = 30.0
    upscaling_factor: float = 1.0
    downscaling_factor: float = 1.0
    control_interval_s: float = 1.0
    name: str = "ray-default"
    _counter: int = 0
    _since_s: float | None = None

    def reset(self) -> None:
        self._counter, self._since_s = 0, None

    def _bounded(self, n: int) -> int:
        return max(self.min_replicas, min(self.max_replicas, n))

    def __call__(self, view: FleetView) -> tuple[int, str]:
        cur, tgt, now = view.current_replicas, view.target_replicas, view.now_s
        total = view.mean_ongoing_requests(self.look_back_period_s)
        # _get_cold_start_scale_up_replicas
        if cur == 0 and total > 0:
            n = self._bounded(max(math.ceil(1 * self.upscaling_factor), tgt))
            return n, f"cold start: {total:.1f} requests and no running replica"
        # _core_replica_queue_length_policy
        desired: float = tgt if cur == 0 else cur * (total / (self.target_ongoing_requests * cur))
        # _apply_scaling_factors
        if cur == 0:
            d = math.ceil(desired)
        else:
            delta = desired - cur
            factor = self.upscaling_factor if delta > 0 else self.downscaling_factor
            d = math.ceil(cur + factor * delta)
            if math.ceil(desired) < cur and d == cur:
                d -= 1
        if cur == 0 and d > 0:
            return self._bounded(d), f"scale from zero to {d}"
        d = max(0, d)
        # _apply_delay_logic
        decision = tgt
        if d > tgt:
            if self._counter < 0:
                self._counter, self._since_s = 0, None
            self._counter += 1
            if self._since_s is None:
                self._since_s = now
            if now - self._since_s + 1e-6 >= self.upscale_delay_s:
                self._counter, self._since_s, decision = 0, None, d
        elif d < tgt:
            if self._counter > 0:
                self._counter, self._since_s = 0, None
            self._counter -= 1
            if tgt == 1:
                delay = self.downscale_to_zero_delay_s
                delay = self.downscale_delay_s if delay is None else delay
            else:
                delay = self.downscale_delay_s
                d = max(1, d)
            if self._since_s is None:
                self._since_s = now
            if now - self._since_s + 1e-6 >= delay:
                self._counter, self._since_s, decision = 0, None, d
        else:
            self._counter, self._since_s = 0, None
        decision = self._bounded(decision)
        return decision, (
            f"{total:.1f} ongoing requests (mean of {self.look_back_period_s:.0f} s) / target "
            f"{self.target_ongoing_requests:g} per replica -> {d}, decided {decision}"
        )


# --------------------------------------------------------------------------------------------------------
# Results
# --------------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ScaleEvent:
    t_s: float
    from_replicas: int
    to_replicas: int
    reason: str


@dataclass(eq=False)
class Timeline:
    """Per-step series (``dt_s`` apart) plus TTFT p95 per ``bin_s`` bin of arrival time."""

    dt_s: float
    rate_rps: np.ndarray
    arrivals: np.ndarray
    ready: np.ndarray
    provisioned: np.ndarray
    """Replicas costing GPU time: starting + ready + draining."""
    target: np.ndarray
    bin_s: float
    ttft_p95_ms: np.ndarray


@dataclass(eq=False)
class SimResult:
    """Outcome of one trace under one policy."""

    trace: str
    policy: str
    ttft_target_ms: float
    duration_s: float
    requests: int
    served: int
    attainment: float
    """Fraction of all requests whose TTFT was <= ttft_target_ms (never served counts as missed)."""
    ttft_p50_ms: float
    ttft_p95_ms: float
    ttft_p99_ms: float
    replica_hours: float
    mean_replicas: float
    peak_replicas: int
    scale_events: int
    direction_changes: int
    max_direction_changes_per_10min: int
    events: list[ScaleEvent] = field(default_factory=list)
    timeline: Timeline | None = None

    def to_dict(self, events: bool = False) -> dict[str, Any]:
        out = {
            k: getattr(self, k)
            for k in (
                "trace",
                "policy",
                "ttft_target_ms",
                "duration_s",
                "requests",
                "served",
                "attainment",
                "ttft_p50_ms",
                "ttft_p95_ms",
                "ttft_p99_ms",
                "replica_hours",
                "mean_replicas",
                "peak_replicas",
                "scale_events",
                "direction_changes",
                "max_direction_changes_per_10min",
            )
        }
        for k, v in out.items():
            if isinstance(v, float):
                out[k] = round(v, 6)
        if events:
            out["events"] = [
                {"t_s": e.t_s, "from": e.from_replicas, "to": e.to_replicas, "reason": e.reason}
                for e in self.events
            ]
        return out


def to_table(results: Sequence[SimResult], baseline: str = "static") -> str:
    """Markdown table, one row per run; replica-hours also as a ratio to ``baseline`` on the same trace."""
    base = {r.trace: r.replica_hours for r in results if r.policy == baseline}
    head = (
        "| trace | policy | TTFT<=target | TTFT p50 ms | p95 ms | p99 ms | replica-h | vs static | "
        "mean repl | peak repl | scalings | dir changes | max dir/10min |"
    )
    sep = "|" + "---|" * 13
    rows = [head, sep]
    for r in results:
        ratio = r.replica_hours / base[r.trace] if base.get(r.trace) else float("nan")
        rows.append(
            f"| {r.trace} | {r.policy} | {r.attainment:.2%} | {r.ttft_p50_ms:.0f} | {r.ttft_p95_ms:.0f} | "
            f"{r.ttft_p99_ms:.0f} | {r.replica_hours:.2f} | {ratio:.2f}x | {r.mean_replicas:.2f} | "
            f"{r.peak_replicas} | {r.scale_events} | {r.direction_changes} | "
            f"{r.max_direction_changes_per_10min} |"
        )
    return "\n".join(rows)


def _direction_stats(events: Sequence[ScaleEvent], window_s: float = 600.0) -> tuple[int, int]:
    times: list[float] = []
    prev = 0
    for e in events:
        sign = 1 if e.to_replicas > e.from_replicas else -1
        if prev and sign != prev:
            times.append(e.t_s)
        prev = sign
    worst = 0
    j = 0
    for i, t in enumerate(times):
        while times[j] <= t - window_s:
            j += 1
        worst = max(worst, i - j + 1)
    return len(times), worst


# --------------------------------------------------------------------------------------------------------
# Simulator
# --------------------------------------------------------------------------------------------------------

_STARTING, _READY, _DRAINING, _GONE = 0, 1, 2, 3


class _Sim:
    """One run. Implements :class:`FleetView` for the policy."""

    def __init__(
        self,
        trace: Trace,
        latency: LatencyModel,
        *,
        initial_replicas: int,
        replica_startup_s: float,
        ttft_target_ms: float,
        seed: int,
    ) -> None:
        self.trace, self.lat, self.dt = trace, latency, trace.dt_s
        self.startup_s, self.target_ms = replica_startup_s, ttft_target_ms
        n_steps = len(trace.rate_rps)
        rng_arr = np.random.default_rng([seed, 0])
        rng_req = np.random.default_rng([seed, 1])
        counts = rng_arr.poisson(np.maximum(trace.rate_rps, 0.0) * self.dt)
        n = int(counts.sum())
        step_start = np.repeat(np.arange(n_steps) * self.dt, counts)
        self.arrival_s = np.sort(step_start + rng_arr.random(n) * self.dt)
        self.counts = counts
        self.first = np.concatenate([[0], np.cumsum(counts)])
        s = latency.output_tokens_sigma
        mu = math.log(latency.output_tokens_mean) - s * s / 2.0
        self.out_tokens = np.clip(
            rng_req.lognormal(mu, s, n), latency.output_tokens_min, latency.output_tokens_max
        )
        self.z = rng_req.standard_normal(n)
        self.u_admit = rng_req.random(n)
        self.route_u = rng_req.random((n, 2))
        conc = np.maximum(np.arange(latency.max_num_seqs + 1), 1).astype(float)
        self.p50_tab: list[float] = np.asarray(latency.ttft_p50_ms(conc)).tolist()
        self.sigma_tab: list[float] = np.asarray(latency.ttft_sigma(conc)).tolist()
        self.tpot_tab = np.asarray(latency.tpot_ms(conc), dtype=float)
        self.tpot_list: list[float] = self.tpot_tab.tolist()
        self.ttft_ms = np.full(n, np.nan)
        self.rep_of = np.full(n, -1, dtype=np.int64)
        self.n = n

        self.state: list[int] = []
        self.ready_at: list[float] = []
        self.running_count = np.zeros(0, dtype=np.int64)
        self.run_rep = np.zeros(0, dtype=np.int64)
        self.run_rem = np.zeros(0)
        self.queue: deque[int] = deque()
        self.adm_log: deque[np.ndarray] = deque()
        self.ongoing_log: deque[float] = deque()
        self.arr_log: deque[int] = deque()
        self.now_s = 0.0
        self.target_replicas = 0
        for _ in range(initial_replicas):
            self._add_replica(ready_at=0.0, state=_READY)
        self.target_replicas = initial_replicas

    # -- FleetView ---------------------------------------------------------------------------------------

    @property
    def current_replicas(self) -> int:
        return sum(1 for s in self.state if s == _READY)

    @property
    def replicas_starting(self) -> int:
        return sum(1 for s in self.state if s == _STARTING)

    def mean_ongoing_requests(self, look_back_s: float) -> float:
        k = max(1, int(round(look_back_s / self.dt)))
        vals = list(self.ongoing_log)[-k:]
        return float(np.mean(vals)) if vals else 0.0

    def snapshot(self, window_s: float, rate_window_s: float) -> MetricsSnapshot:
        k = max(1, int(round(window_s / self.dt)))
        logs = list(self.adm_log)[-k:]
        idx = np.concatenate(logs) if logs else np.zeros(0, dtype=np.int64)
        reps_of = self.rep_of[idx]
        vals = self.ttft_ms[idx]
        kr = max(1, int(round(rate_window_s / self.dt)))
        arr = list(self.arr_log)[-kr:]
        rate = float(sum(arr)) / (len(arr) * self.dt) if arr else None
        lat = self.lat
        kv_per_req = lat.prompt_tokens + lat.output_tokens_mean / 2.0
        replicas = []
        for rid, st in enumerate(self.state):
            if st != _READY:
                continue
            sel = vals[reps_of == rid]
            p50f: float | None
            p95f: float | None
            if sel.size:
                p50, p95 = np.percentile(sel, [50.0, 95.0])
                p50f, p95f = float(p50), float(p95)
            else:
                p50f = p95f = None
            running = int(self.running_count[rid])
            replicas.append(
                ReplicaMetrics(
                    replica_id=f"r{rid}",
                    ttft_p50_ms=p50f,
                    ttft_p95_ms=p95f,
                    ttft_samples=int(sel.size),
                    num_requests_running=running,
                    num_requests_waiting=0,
                    kv_cache_usage=min(1.0, running * kv_per_req / lat.kv_cache_tokens),
                )
            )
        return MetricsSnapshot(
            now_s=self.now_s,
            taken_at_s=self.now_s,
            replicas=tuple(replicas),
            arrival_rate_rps=rate,
            current_replicas=self.current_replicas,
            target_replicas=self.target_replicas,
            replicas_starting=self.replicas_starting,
            queued_at_router=len(self.queue),
            window_s=window_s,
            rate_window_s=kr * self.dt,
        )

    # -- fleet changes -----------------------------------------------------------------------------------

    def _add_replica(self, ready_at: float, state: int) -> None:
        self.state.append(state)
        self.ready_at.append(ready_at)
        self.running_count = np.append(self.running_count, 0)

    def apply_target(self, desired: int) -> None:
        desired = max(0, int(desired))
        active = [i for i, s in enumerate(self.state) if s in (_STARTING, _READY)]
        if desired > len(active):
            for _ in range(desired - len(active)):
                self._add_replica(self.now_s + self.startup_s, _STARTING if self.startup_s > 0 else _READY)
        elif desired < len(active):
            drop = len(active) - desired
            starting = sorted(
                (i for i in active if self.state[i] == _STARTING), key=lambda i: -self.ready_at[i]
            )
            for i in starting[:drop]:
                self.state[i] = _GONE
            drop -= min(drop, len(starting))
            if drop:
                ready = sorted(
                    (i for i in active if self.state[i] == _READY), key=lambda i: self.running_count[i]
                )
                for i in ready[:drop]:
                    self.state[i] = _DRAINING if self.running_count[i] > 0 else _GONE
        self.target_replicas = desired

    # -- one step ----------------------------------------------------------------------------------------

    def _admit(self, i: int, rep: int, t_admit: float, new_rep: list[int], new_rem: list[float]) -> None:
        self.running_count[rep] += 1
        b = int(self.running_count[rep])
        prefill_ms = self.p50_tab[b] * math.exp(self.sigma_tab[b] * float(self.z[i]))
        self.ttft_ms[i] = (t_admit - float(self.arrival_s[i])) * 1000.0 + prefill_ms
        self.rep_of[i] = rep
        new_rep.append(rep)
        new_rem.append(float(self.out_tokens[i]) + prefill_ms / self.tpot_list[b])

    def step(self, k: int) -> int:
        """Advance step k; returns the number of replicas costing GPU time during it."""
        lat, dt = self.lat, self.dt
        t = k * dt
        self.now_s = t
        for i, s in enumerate(self.state):
            if s == _STARTING and self.ready_at[i] <= t + 1e-9:
                self.state[i] = _READY

        # decode
        if self.run_rem.size:
            tok = dt * 1000.0 / self.tpot_tab[self.running_count]
            self.run_rem = self.run_rem - tok[self.run_rep]
            keep = self.run_rem > 0
            self.run_rem, self.run_rep = self.run_rem[keep], self.run_rep[keep]
            self.running_count = np.bincount(self.run_rep, minlength=len(self.state)).astype(np.int64)
        for i, s in enumerate(self.state):
            if s == _DRAINING and self.running_count[i] == 0:
                self.state[i] = _GONE

        ready = [i for i, s in enumerate(self.state) if s == _READY]
        cap = lat.max_num_seqs
        new_rep: list[int] = []
        new_rem: list[float] = []
        admitted: list[int] = []
        rc = self.running_count

        # router queue first (FIFO), to the replica with the most free slots
        while self.queue and ready:
            rep = min(ready, key=lambda r: rc[r])
            if rc[rep] >= cap:
                break
            i = self.queue.popleft()
            self._admit(i, rep, t + self.u_admit[i] * dt, new_rep, new_rem)
            admitted.append(i)

        # arrivals of this step
        lo, hi = int(self.first[k]), int(self.first[k + 1])
        nr = len(ready)
        for i in range(lo, hi):
            if self.queue or nr == 0:
                self.queue.append(i)
                continue
            a = ready[int(self.route_u[i, 0] * nr)]
            b2 = ready[int(self.route_u[i, 1] * nr)]
            rep = a if rc[a] <= rc[b2] else b2
            if rc[rep] >= cap:
                rep = min(ready, key=lambda r: rc[r])
                if rc[rep] >= cap:
                    self.queue.append(i)
                    continue
            self._admit(i, rep, float(self.arrival_s[i]), new_rep, new_rem)
            admitted.append(i)

        if new_rep:
            self.run_rep = np.concatenate([self.run_rep, np.asarray(new_rep, dtype=np.int64)])
            self.run_rem = np.concatenate([self.run_rem, np.asarray(new_rem)])
        self.adm_log.append(np.asarray(admitted, dtype=np.int64))
        self.arr_log.append(hi - lo)
        self.ongoing_log.append(float(self.run_rem.size + len(self.queue)))
        for log in (self.adm_log, self.arr_log, self.ongoing_log):
            if len(log) > 1200:
                log.popleft()
        return sum(1 for s in self.state if s != _GONE)


def simulate(
    trace: Trace,
    policy: SimPolicy,
    latency: LatencyModel | None = None,
    *,
    ttft_target_ms: float = 500.0,
    initial_replicas: int = 1,
    replica_startup_s: float = 90.0,
    seed: int = 0,
    bin_s: float = 30.0,
    keep_timeline: bool = True,
    on_event: Callable[[ScaleEvent], None] | None = None,
) -> SimResult:
    """Replay ``trace`` under ``policy``; deterministic given ``seed``."""
    lat = latency or LatencyModel()
    policy.reset()
    sim = _Sim(
        trace,
        lat,
        initial_replicas=initial_replicas,
        replica_startup_s=replica_startup_s,
        ttft_target_ms=ttft_target_ms,
        seed=seed,
    )
    n_steps = len(trace.rate_rps)
    dt = trace.dt_s
    ready_s = np.zeros(n_steps, dtype=np.int64)
    prov_s = np.zeros(n_steps, dtype=np.int64)
    target_s = np.zeros(n_steps, dtype=np.int64)
    events: list[ScaleEvent] = []
    next_control = policy.control_interval_s
    for k in range(n_steps):
        prov = sim.step(k)
        t = k * dt
        if t + 1e-9 >= next_control:
            next_control += policy.control_interval_s
            before = sim.target_replicas
            desired, reason = policy(sim)
            if desired != before:
                ev = ScaleEvent(t, before, int(desired), reason)
                events.append(ev)
                if on_event is not None:
                    on_event(ev)
                sim.apply_target(desired)
                prov = sum(1 for s in sim.state if s != _GONE)
        ready_s[k] = sim.current_replicas
        prov_s[k] = prov
        target_s[k] = sim.target_replicas

    end_s = n_steps * dt
    ttft = sim.ttft_ms.copy()
    unserved = np.isnan(ttft)
    ttft[unserved] = (end_s - sim.arrival_s[unserved]) * 1000.0  # a lower bound; counted as missed
    n = sim.n
    ok = (~unserved) & (sim.ttft_ms <= ttft_target_ms)
    p50, p95, p99 = (np.percentile(ttft, [50.0, 95.0, 99.0]) if n else np.zeros(3)).tolist()
    dir_changes, worst = _direction_stats(events)
    timeline = None
    if keep_timeline:
        nb = max(1, int(math.ceil(end_s / bin_s)))
        bins = np.minimum((sim.arrival_s // bin_s).astype(np.int64), nb - 1)
        order = np.argsort(bins, kind="stable")
        splits = np.searchsorted(bins[order], np.arange(1, nb))
        p95_bins = np.array(
            [float(np.percentile(g, 95.0)) if g.size else np.nan for g in np.split(ttft[order], splits)]
        )
        timeline = Timeline(dt, trace.rate_rps, sim.counts, ready_s, prov_s, target_s, bin_s, p95_bins)
    return SimResult(
        trace=trace.name,
        policy=policy.name,
        ttft_target_ms=ttft_target_ms,
        duration_s=end_s,
        requests=n,
        served=int(n - unserved.sum()),
        attainment=float(ok.sum() / n) if n else 1.0,
        ttft_p50_ms=float(p50),
        ttft_p95_ms=float(p95),
        ttft_p99_ms=float(p99),
        replica_hours=float(prov_s.sum() * dt / 3600.0),
        mean_replicas=float(prov_s.mean()) if n_steps else 0.0,
        peak_replicas=int(prov_s.max()) if n_steps else 0,
        scale_events=len(events),
        direction_changes=dir_changes,
        max_direction_changes_per_10min=worst,
        events=events,
        timeline=timeline,
    )


# --------------------------------------------------------------------------------------------------------
# Plot
# --------------------------------------------------------------------------------------------------------


def plot(results: Sequence[SimResult], path: str | Path, title: str | None = None) -> Path:
    """PNG of load, replicas and TTFT p95 over time, one line per result (same trace expected)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in results if r.timeline is not None]
    if not runs:
        raise ValueError("plot needs results with a timeline (simulate(..., keep_timeline=True))")
    fig, axes = plt.subplots(3, 1, figsize=(11, 8.5), sharex=True)
    tl0 = runs[0].timeline
    assert tl0 is not None
    t_min = np.arange(len(tl0.rate_rps)) * tl0.dt_s / 60.0
    axes[0].plot(t_min, tl0.rate_rps, color="black", lw=1.2, label="offered rate")
    k = max(1, int(round(30.0 / tl0.dt_s)))
    arr = np.convolve(tl0.arrivals, np.ones(k) / (k * tl0.dt_s), mode="same")
    axes[0].plot(t_min, arr, color="grey", lw=0.6, alpha=0.7, label="arrivals (30 s mean)")
    axes[0].set_ylabel("requests / s")
    axes[0].legend(loc="upper left", fontsize=8)
    for r in runs:
        tl = r.timeline
        assert tl is not None
        tm = np.arange(len(tl.provisioned)) * tl.dt_s / 60.0
        (line,) = axes[1].step(
            tm, tl.provisioned, where="post", lw=1.3, label=f"{r.policy} ({r.replica_hours:.1f} replica-h)"
        )
        axes[1].step(tm, tl.ready, where="post", lw=0.7, ls=":", color=line.get_color())
        tb = (np.arange(len(tl.ttft_p95_ms)) + 0.5) * tl.bin_s / 60.0
        axes[2].plot(
            tb,
            tl.ttft_p95_ms,
            lw=1.1,
            color=line.get_color(),
            label=f"{r.policy} ({r.attainment:.2%} <= target)",
        )
    axes[1].set_ylabel("replicas (solid: paid, dotted: serving)")
    axes[1].legend(loc="upper left", fontsize=8)
    axes[2].axhline(runs[0].ttft_target_ms, color="red", ls="--", lw=1, label="TTFT target")
    axes[2].set_yscale("log")
    axes[2].set_ylabel(f"TTFT p95 per {tl0.bin_s:.0f} s (ms)")
    axes[2].set_xlabel("time (min)")
    axes[2].legend(loc="upper left", fontsize=8)
    fig.suptitle(title or f"trace: {runs[0].trace}")
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
