"""Reusing an earlier benchmark's runs whose inputs are the same: a run is a pure function of its inputs.

A run's identity (:func:`identity`) is everything the simulation reads: the trace spec, the initial fleet,
the clients' retries, the policy (for headroom the settings in effect, overrides applied; for Ray its
knobs; for a static fleet or the step oracle their replica counts) and the deployment's engine limits,
admission, calibration, TTFT target, start-up and report window. An earlier results.json gives the
identities of its runs by rebuilding its task list with the same code from what it recorded (its
deployment, its tuning, its static fleets). A run whose identity matches is taken from there; a run that
needs a timeline (not stored in results.json) is always run again. Before anything is reused, one reused
record of each policy kind is run again and must come out identical (the calibration's contents are not
in results.json: this catches a changed engine model).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, replace
from typing import Any

from autoscale.experiment import Deployment, Task, deployment_from, run_task, smallest_static
from autoscale.scenarios import TraceSpec

__all__ = ["Reused", "identity", "reusable", "static_identity"]

Reused = tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]]]
"""(static fleet records by static identity, run records by run identity)."""


def _world(dep: Deployment) -> list[Any]:
    s = dep.settings
    return [
        asdict(dep.limits),
        asdict(dep.admission),
        dep.calibration,
        dep.ttft_target_ms,
        s.replica_startup_s,
        s.window_s,
    ]


def static_identity(spec: TraceSpec, dep: Deployment) -> str:
    """What the static search reads (min_replicas sets the dynamic policies' initial fleet)."""
    return json.dumps([_world(dep), asdict(spec), dep.settings.min_replicas], sort_keys=True)


def identity(task: Task, dep: Deployment) -> str:
    policy = task.policy
    what: list[Any] = [repr(replace(policy, name="", overrides=()))]
    if policy.kind == "headroom":
        settings = dep.settings.model_copy(update=dict(policy.overrides))
        what.append(settings.model_dump(mode="json"))
    retries = task.client_retries
    return json.dumps(
        [_world(dep), asdict(task.trace), task.initial_replicas, retries, what], sort_keys=True, default=str
    )


def _earlier_identities(
    earlier: Mapping[str, Any],
    specs: Sequence[TraceSpec],
    tasks_of: Callable[[Deployment, Mapping[str, Any], list[TraceSpec], list[dict[str, Any]]], list[Task]],
) -> tuple[Deployment, dict[tuple[str, str], str]]:
    """The earlier benchmark's deployment and the identity of each of its runs, by (policy, trace label)."""
    dep = deployment_from(earlier["deployment"], earlier["calibration"])
    by_label = {f"{st['trace']}/{st['seed']}": st for st in earlier["static"]}
    statics = [by_label[sp.label] for sp in specs]
    tasks = tasks_of(dep, earlier["tuning"], list(specs), statics)
    return dep, {(t.policy.name, t.trace.label): identity(t, dep) for t in tasks}


def reusable(
    earlier: Mapping[str, Any] | None,
    dep: Deployment,
    specs: Sequence[TraceSpec],
    tasks_of: Callable[[Deployment, Mapping[str, Any], list[TraceSpec], list[dict[str, Any]]], list[Task]],
) -> Reused:
    """The earlier benchmark's static fleets and runs, by identity; empty when there is none, or when it
    judged other traces."""
    if earlier is None:
        return {}, {}
    labels = {f"{st['trace']}/{st['seed']}" for st in earlier["static"]}
    if any(sp.label not in labels for sp in specs):
        return {}, {}
    old_dep, ids = _earlier_identities(earlier, specs, tasks_of)
    statics = {
        static_identity(TraceSpec(st["trace"], st["seed"]), old_dep): st
        for st in earlier["static"]
        if TraceSpec(st["trace"], st["seed"]) in specs
    }
    runs = {}
    for r in earlier["runs"]:
        key = ids.get((r["policy"], f"{r['trace']}/{r['seed']}"))
        if key is not None:
            runs[key] = r
    return statics, runs


def check_reused(
    reused: Reused, tasks: Sequence[Task], specs: Sequence[TraceSpec], dep: Deployment
) -> list[str]:
    """Runs again the first reused static search and the first reused run of each policy kind; returns
    what was checked, or raises SystemExit when a record came out different."""
    statics, runs = reused
    checked = []
    for sp in specs:
        old = statics.get(static_identity(sp, dep))
        if old is not None:
            _same(smallest_static(sp, dep), old, f"static fleet on {sp.label}")
            checked.append(f"static fleet on {sp.label}")
            break
    kinds: set[str] = set()
    for task in tasks:
        old = runs.get(identity(task, dep))
        if old is None or task.keep_timeline or task.policy.kind in kinds:
            continue
        name = f"{task.policy.name} on {task.trace.label}"
        _same({**run_task(task, dep), "policy": task.policy.name}, old, name)
        kinds.add(task.policy.kind)
        checked.append(name)
    return checked


def _same(again: Mapping[str, Any], old: Mapping[str, Any], what: str) -> None:
    keys = sorted(k for k in again if k not in ("timeline", "policy") and k in old)
    diff = {k: (old[k], again[k]) for k in keys if old[k] != again[k]}
    if diff:
        raise SystemExit(f"reused {what} differs when run again ({diff}): run without --reuse")
