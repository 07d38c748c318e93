"""Runs policies on traces for the tuning and the benchmark: one deployment, many runs, in parallel.

A run is a :class:`Task` (a trace spec, a policy spec, the initial fleet), picklable so a process pool can
take it; its outcome is :meth:`SimResult.summary` plus the policy's reason-code counts. The smallest static
fleet that keeps 99% of requests under the target is found per trace by search (:func:`smallest_static`).
Every dynamic policy starts with the same fleet: the static fleet scaled by the trace's first five minutes
against its peak minute.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import numpy as np

from autoscale.calibration import (
    DEFAULT_CALIBRATION,
    Admission,
    EngineCost,
    EngineLimits,
    load_calibration,
)
from autoscale.capacity import ServiceEstimate
from autoscale.inputs import PolicyConfig
from autoscale.ray_default import RayKnobs
from autoscale.scenarios import STEP_DOWN_S, STEP_UP_S, TraceSpec, build_trace
from autoscale.settings import AutoscalingSettings
from autoscale.sim import (
    HeadroomPolicy,
    RayDefaultPolicy,
    SimPolicy,
    SimResult,
    SimSetup,
    StaticPolicy,
    StepOracle,
    simulate,
)
from autoscale.workload import RequestTrace

__all__ = [
    "Deployment",
    "PolicySpec",
    "Task",
    "beats_rival",
    "deployment_from",
    "load_deployment",
    "run_tasks",
    "smallest_static",
]

ATTAINMENT_TARGET = 0.99
PEAKY = 1.5
"""Traces whose peak minute is at least this times their mean get the 0.85x cost target."""
STEADY_KINDS = ("constant", "diurnal")
"""Trace kinds on which at most one direction change per 10 minutes is allowed."""


def cost_limit(kind: str, peak_to_mean: float) -> float | None:
    """The most replica-hours against the static 99% fleet a trace allows; None: no cost target."""
    if kind == "constant":
        return 1.05
    return 0.85 if peak_to_mean >= PEAKY else None


def beats_rival(ours: Mapping[str, Any], rival: Mapping[str, Any]) -> bool:
    """The benchmark's comparison with Ray's tuned default, on :func:`pooled` rows of one trace kind: at
    least as many requests under the target at no more replica-hours."""
    return bool(ours["attainment"] >= rival["attainment"] and ours["replica_hours"] <= rival["replica_hours"])


DEFAULT_DEPLOYMENT = Path("results/autoscale/deployment.json")


@dataclass(frozen=True)
class Deployment:
    """What the benchmark knows of the deployment (loadtests/autoscale_inputs.py writes it)."""

    settings: AutoscalingSettings
    ttft_target_ms: float
    limits: EngineLimits
    cost: EngineCost
    calibration: str
    admission: Admission = Admission()
    source: Mapping[str, Any] = field(default_factory=dict)

    def setup(self, seed: int, initial_replicas: int, startup_s: float | None = None) -> SimSetup:
        return SimSetup(
            cost=self.cost,
            limits=self.limits,
            ttft_target_ms=self.ttft_target_ms,
            startup_s=self.settings.replica_startup_s if startup_s is None else startup_s,
            initial_replicas=initial_replicas,
            window_s=self.settings.window_s,
            seed=seed,
            admission=self.admission,
        )


def load_deployment(
    path: str | Path = DEFAULT_DEPLOYMENT, calibration: str | Path = DEFAULT_CALIBRATION
) -> Deployment:
    """The deployment as configured, except that max_replicas is what its plan fits on the cluster it was
    planned for (the traces peak beyond configs/prod.yaml's bound of 8 replicas)."""
    return deployment_from(json.loads(Path(path).read_text()), calibration)


def deployment_from(data: Mapping[str, Any], calibration: str | Path = DEFAULT_CALIBRATION) -> Deployment:
    """:func:`load_deployment` from the file's contents (e.g. the ``deployment`` of a results.json)."""
    settings = AutoscalingSettings(**data["autoscaling"])
    settings = settings.model_copy(
        update={"max_replicas": max(settings.max_replicas, data["replicas_that_fit"])}
    )
    return Deployment(
        settings=settings,
        ttft_target_ms=float(data["ttft_target_ms"]),
        limits=EngineLimits(**data["limits"]),
        cost=load_calibration(calibration).cost,
        calibration=_repo_relative(Path(calibration)),
        admission=Admission(**data.get("admission", {})),
        source=data,
    )


def _repo_relative(path: Path) -> str:
    """The path as the result files name it: from the repository root when it lies inside it."""
    root, full = Path(__file__).resolve().parents[1], path.resolve()
    return str(full.relative_to(root)) if full.is_relative_to(root) else str(path)


@dataclass(frozen=True)
class PolicySpec:
    """A policy to run: a static fleet, headroom's (settings overrides, capacity seed), Ray's default, or
    the step trace's oracle (a reference: :class:`~autoscale.sim.StepOracle`)."""

    kind: Literal["static", "headroom", "ray", "step_oracle"]
    name: str
    replicas: int = 0
    """static: the fleet; step_oracle: the fleet it asks for when the step comes."""
    overrides: tuple[tuple[str, Any], ...] = ()
    seed_factor: float | None = None
    """headroom only: seed capacity at this factor of the trace's true per-request cost; None: no seed."""
    ray: RayKnobs | None = None
    before: int = 0
    """step_oracle only: the replicas serving before the step."""

    def build(self, dep: Deployment, trace: RequestTrace) -> SimPolicy:
        if self.kind == "static":
            return StaticPolicy(self.replicas, name=self.name)
        if self.kind == "step_oracle":
            return StepOracle(STEP_UP_S, STEP_DOWN_S, self.before, self.replicas, name=self.name)
        if self.kind == "ray":
            assert self.ray is not None
            return RayDefaultPolicy(self.ray, name=self.name)
        settings = dep.settings.model_copy(update=dict(self.overrides))
        AutoscalingSettings.model_validate(settings.model_dump())  # the overrides must be valid settings
        seed = None if self.seed_factor is None else true_service(dep.cost, trace).scaled(self.seed_factor)
        return HeadroomPolicy(
            PolicyConfig(settings, dep.ttft_target_ms, dep.limits.max_num_seqs, seed), name=self.name
        )


def true_service(cost: EngineCost, trace: RequestTrace) -> ServiceEstimate:
    """What a ladder on this very traffic would measure: the engine cost of the trace's mean request."""
    prompt, out = float(np.mean(trace.prompt_tokens)), float(np.mean(trace.output_tokens))
    per_token = cost.decode_ms_per_seq + cost.attention_ms_per_kv_token * (prompt + out / 2)
    work = prompt * cost.prefill_ms_per_token + out * per_token
    return ServiceEstimate(cost.step_ms + cost.decode_ms_per_seq, work, out, "seed", "the trace's own mix")


@dataclass(frozen=True)
class Task:
    trace: TraceSpec
    policy: PolicySpec
    initial_replicas: int
    keep_timeline: bool = False
    client_retries: int | None = None
    """How often the simulated clients retry a refused request; None: the deployment's Admission."""


def initial_replicas(trace: RequestTrace, static_replicas: int, min_replicas: int) -> int:
    """The static fleet scaled by the first five minutes' rate against the peak minute."""
    per_min = trace.rate_per_bin(60.0)
    start = float(np.mean(per_min[:5])) / float(per_min.max())
    return max(min_replicas, math.ceil(static_replicas * start - 1e-9))


def run_task(task: Task, dep: Deployment) -> dict[str, Any]:
    trace = build_trace(task.trace)
    policy = task.policy.build(dep, trace)
    setup = dep.setup(task.trace.seed, task.initial_replicas)
    if task.client_retries is not None:
        setup = replace(setup, admission=replace(setup.admission, client_retries=task.client_retries))
    result = simulate(trace, policy, setup, keep_timeline=task.keep_timeline)
    return _record(task.trace, result)


def _record(spec: TraceSpec, r: SimResult) -> dict[str, Any]:
    out = {**r.summary(), "trace": spec.kind, "codes": r.codes, "events": len(r.events)}
    if r.timeline is not None:
        out["timeline"] = r.timeline
    return out


def smallest_static(spec: TraceSpec, dep: Deployment) -> dict[str, Any]:
    """The smallest static fleet reaching 99% on the trace, by search from a first guess."""
    trace = build_trace(spec)
    # About what a replica serves of the default mix (scenarios.py): the search starts near the answer.
    guess = max(1, math.ceil(trace.peak_rps(60.0) / 21.0))
    results: dict[int, SimResult] = {}

    def attain(n: int) -> float:
        if n not in results:
            results[n] = simulate(trace, StaticPolicy(n, name="static-99"), dep.setup(spec.seed, n))
        return results[n].attainment

    n = guess
    if attain(n) >= ATTAINMENT_TARGET:
        while n > 1 and attain(n - 1) >= ATTAINMENT_TARGET:
            n -= 1
    else:
        while attain(n) < ATTAINMENT_TARGET:
            n += 1
    record = _record(spec, results[n])
    record.update(
        static_replicas=n, peak_to_mean=trace.peak_rps(60.0) / trace.mean_rps, searched=sorted(results)
    )
    record["initial_replicas"] = initial_replicas(trace, n, dep.settings.min_replicas)
    return record


def _call(fn_dep_arg: tuple[Callable[[Any, Deployment], dict[str, Any]], Any, Deployment]) -> dict[str, Any]:
    fn, arg, dep = fn_dep_arg
    return fn(arg, dep)


def run_tasks(
    fn: Callable[[Any, Deployment], dict[str, Any]],
    args: Iterable[Any],
    dep: Deployment,
    jobs: int,
    progress: Callable[[int, int], None] | None = None,
) -> list[dict[str, Any]]:
    """``fn(arg, dep)`` for every arg, ``jobs`` processes at a time, in order."""
    work = [(fn, a, dep) for a in args]
    if jobs <= 1:
        out = []
        for i, w in enumerate(work):
            out.append(_call(w))
            if progress:
                progress(i + 1, len(work))
        return out
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        out = []
        for i, rec in enumerate(pool.map(_call, work, chunksize=1)):
            out.append(rec)
            if progress:
                progress(i + 1, len(work))
        return out


def default_jobs() -> int:
    return max(1, min(2, os.cpu_count() or 1))


def pooled(records: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """Across seeds: attainment over all requests, summed replica-hours, worst seed."""
    requests = sum(r["requests"] for r in records)
    under = sum(r["attainment"] * r["requests"] for r in records)
    atts = [r["attainment"] for r in records]
    hours = [r["replica_hours"] for r in records]
    return {
        "seeds": len(records),
        "requests": requests,
        "missed": round(requests - under),
        "attainment": under / requests if requests else 1.0,
        "attainment_min": min(atts),
        "attainment_max": max(atts),
        "seeds_below_target": sum(1 for a in atts if a < ATTAINMENT_TARGET),
        "replica_hours": float(sum(hours)),
        "replica_hours_min": min(hours),
        "replica_hours_max": max(hours),
        "max_direction_changes_per_10min": max(r["max_direction_changes_per_10min"] for r in records),
    }
