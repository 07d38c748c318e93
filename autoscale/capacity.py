"""How many requests per second one replica serves, learned from what the replicas report: no oracle.

A vLLM engine works in steps. Each step costs a fixed time (reading the weights once: the decode step of a
single sequence, ``step_ms``) plus time per token it processes (prefill tokens, one decode token per
running sequence, attention over their context). Over any stretch of time::

    busy_s = steps x step_ms + (work per request) x requests finished

so the replicas' own counters (engine busy seconds, steps, finished requests, generated tokens; see
autoscale/replica_stats.py) give ``work_ms_per_request`` for whatever mix of prompt and output lengths is
arriving now, and ``step_ms`` is the duration of light decode-only steps, which every replica times for
itself. With the engine's ``max_num_seqs`` slots ``S``, one replica serving ``x`` requests/s runs steps of
``step_ms / (1 - x w)`` (``w`` the work per request) and holds ``x o step_ms / (1 - x w)`` decoding
sequences (``o`` output tokens per request). Keeping the work share ``x w`` at most the target engine
utilization and the sequences at most the target share of ``S`` gives the replica-seconds one request
needs::

    max(w / target_engine_utilization,  w + o step_ms / (S x target_slot_utilization))

and capacity is its inverse. Until the replicas have finished enough requests to measure ``w``, a seed
read from a ``headroom ladder`` result stands in (:func:`seed_from_ladder`), or nothing: the policy then
sizes from queueing and TTFT alone.

Pure: no Ray, no serve_app.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

__all__ = [
    "MIN_FINISHED_PER_ESTIMATE",
    "ServiceEstimate",
    "capacity_rps",
    "estimate_service",
    "replica_seconds_per_request",
    "seed_from_ladder",
]

MIN_FINISHED_PER_ESTIMATE = 20
"""Finished requests a report window needs before its engine counters replace the estimate."""
_SMOOTHING = 0.1
"""Weight of a new window's measurement against the running estimate: a window's mix of prompt and output
lengths varies by a few percent, which must not move the fleet across its scale-down margin."""
_STEADY_TOLERANCE = 0.3
"""A window is measured only if its finished requests are within this share of its arrivals."""
_MIN_WORK_FRACTION = 0.05
"""Work per request is floored at this share of its observed step-time total (a too-high step_ms)."""

Source = Literal["seed", "observed"]


@dataclass(frozen=True, slots=True)
class ServiceEstimate:
    """What one request costs a replica's engine, and where the numbers come from."""

    step_ms: float
    """Fixed time of one engine step (a decode step of one sequence)."""
    work_ms_per_request: float
    """Engine time per request beyond the per-step cost: its prefill, decode and attention tokens."""
    output_tokens_per_request: float
    """Mean generated tokens per request: how many steps it holds a sequence slot."""
    source: Source
    detail: str = ""

    def scaled(self, capacity_factor: float) -> ServiceEstimate:
        """The same estimate with every cost divided by ``capacity_factor`` (capacity x factor)."""
        return replace(
            self,
            step_ms=self.step_ms / capacity_factor,
            work_ms_per_request=self.work_ms_per_request / capacity_factor,
            detail=f"{self.detail} (x{capacity_factor:g} capacity)",
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "step_ms": self.step_ms,
            "work_ms_per_request": self.work_ms_per_request,
            "output_tokens_per_request": self.output_tokens_per_request,
            "source": self.source,
            "detail": self.detail,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ServiceEstimate:
        source = data.get("source", "seed")
        return cls(
            step_ms=float(data["step_ms"]),
            work_ms_per_request=float(data["work_ms_per_request"]),
            output_tokens_per_request=float(data["output_tokens_per_request"]),
            source="observed" if source == "observed" else "seed",
            detail=str(data.get("detail", "")),
        )


def replica_seconds_per_request(
    est: ServiceEstimate,
    max_num_seqs: int,
    target_engine_utilization: float,
    target_slot_utilization: float,
) -> float:
    """Seconds of one replica each request needs at the target utilizations (the module docstring)."""
    work_s = est.work_ms_per_request / 1000.0
    compute = work_s / target_engine_utilization
    slots = work_s + est.output_tokens_per_request * est.step_ms / 1000.0 / (
        max_num_seqs * target_slot_utilization
    )
    return max(compute, slots)


def capacity_rps(
    est: ServiceEstimate, max_num_seqs: int, target_engine_utilization: float, target_slot_utilization: float
) -> float:
    """Requests per second one replica serves at the target utilizations."""
    return 1.0 / replica_seconds_per_request(
        est, max_num_seqs, target_engine_utilization, target_slot_utilization
    )


@dataclass(frozen=True, slots=True)
class FleetEngineRates:
    """The serving replicas' engine rates over the report window, summed (per second)."""

    finished_rps: float
    arrival_rps: float | None
    """Requests arriving per second over the same window (None: unknown)."""
    steps_per_s: float
    busy_replicas: float
    """Sum of busy fractions: how many replicas' worth of engine time was spent in steps."""
    generation_tokens_per_s: float
    decode_step_floor_ms: float | None
    """The lowest replica's light decode-step time; None when no replica has timed one yet."""


def estimate_service(
    rates: FleetEngineRates | None,
    window_s: float,
    previous: ServiceEstimate | None,
    seed: ServiceEstimate | None,
) -> ServiceEstimate | None:
    """The measured estimate after one more report: from this window's counters when it finished enough
    requests and about as many as arrived (steady state; smoothed with the previous measurement), else
    the previous one (None: none yet). The seed only lends its step time while no replica has timed a
    light decode step."""
    if rates is None or rates.finished_rps * window_s < MIN_FINISHED_PER_ESTIMATE:
        return previous
    if rates.arrival_rps and abs(rates.finished_rps / rates.arrival_rps - 1.0) > _STEADY_TOLERANCE:
        return previous  # filling up or draining: busy time belongs to requests not counted as finished
    known = previous if previous is not None else seed
    if rates.decode_step_floor_ms is not None:
        step_ms = rates.decode_step_floor_ms
    elif known is not None:
        step_ms = known.step_ms
    else:
        return None
    busy_ms = rates.busy_replicas * 1000.0
    step_total_ms = rates.steps_per_s * step_ms
    work_ms = max(busy_ms - step_total_ms, _MIN_WORK_FRACTION * busy_ms) / rates.finished_rps
    out_tokens = rates.generation_tokens_per_s / rates.finished_rps
    if previous is not None:
        a = _SMOOTHING
        work_ms = previous.work_ms_per_request + a * (work_ms - previous.work_ms_per_request)
        out_tokens = previous.output_tokens_per_request + a * (
            out_tokens - previous.output_tokens_per_request
        )
    return ServiceEstimate(
        step_ms=step_ms,
        work_ms_per_request=work_ms,
        output_tokens_per_request=out_tokens,
        source="observed",
        detail=f"{rates.finished_rps * window_s:.0f} requests finished in the last {window_s:.0f} s",
    )


# --------------------------------------------------------------------------------------------------------
# Seed from a `headroom ladder` results.json
# --------------------------------------------------------------------------------------------------------

_LIGHT_CONCURRENCY = 4
"""A ladder needs a step at or below this concurrency to time the engine's fixed per-step cost."""


def _ladder_steps(data: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    runs = data.get("runs")
    if not isinstance(runs, Sequence) or not runs:
        raise ValueError("a ladder result needs a non-empty 'runs' list (headroom ladder's results.json)")
    wanted = (data.get("recommendation") or {}).get("setting")
    run = next((r for r in runs if r.get("setting") == wanted), runs[-1])
    steps = [s for s in run.get("steps", ()) if s.get("ok", 1) and s.get("e2e_p50_ms")]
    if not steps:
        raise ValueError(f"ladder run {run.get('setting')!r} has no step with finished requests")
    return sorted(steps, key=lambda s: float(s["concurrency"]))


def seed_from_ladder(data: Mapping[str, Any], ttft_target_ms: float, source: str) -> ServiceEstimate:
    """A seed from a ladder result: the recommended setting's run (else the last), ``step_ms`` from its
    lightest step's TPOT, work per request from its heaviest step within the TTFT target (closed loop:
    ``c`` requests in flight at ``c / e2e`` requests/s, steps of TPOT, so work = (1 - step/TPOT) / rate).
    The ladder's prompt and output lengths need not match production: the replicas' own counters replace
    the seed once they finish requests."""
    steps = _ladder_steps(data)
    light = steps[0]
    if float(light["concurrency"]) > _LIGHT_CONCURRENCY:
        raise ValueError(
            f"{source}: the ladder's lightest step is concurrency {light['concurrency']}; a seed needs one "
            f"at <= {_LIGHT_CONCURRENCY} to time the engine's per-step cost (add a 1:30 step)"
        )
    step_ms = float(light["tpot_p50_ms"])
    within = [s for s in steps if float(s["ttft_p95_ms"]) <= ttft_target_ms]
    point = within[-1] if within else steps[0]
    rate_rps = float(point["concurrency"]) / (float(point["e2e_p50_ms"]) / 1000.0)
    busy_share = max(0.0, 1.0 - step_ms / float(point["tpot_p50_ms"]))
    out_tokens = float(point["output_tokens_per_s"]) / rate_rps
    work_ms = max(busy_share, _MIN_WORK_FRACTION) / rate_rps * 1000.0
    return ServiceEstimate(
        step_ms=step_ms,
        work_ms_per_request=work_ms,
        output_tokens_per_request=out_tokens,
        source="seed",
        detail=f"{source}: concurrency {point['concurrency']} within {ttft_target_ms:.0f} ms",
    )
