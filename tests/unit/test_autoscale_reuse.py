"""Reusing an earlier benchmark's runs: a run is reused only when everything it reads is the same."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from autoscale import reuse
from autoscale.experiment import Deployment, PolicySpec, Task, load_deployment
from autoscale.ray_default import RayKnobs
from autoscale.scenarios import TraceSpec

REPO = Path(__file__).resolve().parents[2]
SPEC = TraceSpec("constant", 101)


def deployment(**settings: Any) -> Deployment:
    dep = load_deployment(REPO / "results/autoscale/deployment.json")
    return Deployment(**{**dep.__dict__, "settings": dep.settings.model_copy(update=settings)})


def headroom(*overrides: tuple[str, Any]) -> Task:
    return Task(SPEC, PolicySpec("headroom", "headroom", overrides=overrides), 4)


def ray(target: float = 30.0) -> Task:
    knobs = RayKnobs(min_replicas=2, max_replicas=16, target_ongoing_requests=target)
    return Task(SPEC, PolicySpec("ray", "ray-tuned", ray=knobs), 4)


def test_a_headroom_run_is_the_same_only_with_the_same_settings_in_effect() -> None:
    base, other = deployment(target_engine_utilization=0.9), deployment(target_engine_utilization=0.8)
    assert reuse.identity(headroom(), base) != reuse.identity(headroom(), other)
    # an override that lands on the same settings is the same run, whatever the name says
    lowered = headroom(("target_engine_utilization", 0.8))
    assert reuse.identity(lowered, base) == reuse.identity(headroom(), other)


def test_rays_runs_read_none_of_headrooms_settings_but_all_of_their_own() -> None:
    a, b = deployment(target_engine_utilization=0.9), deployment(target_engine_utilization=0.5)
    assert reuse.identity(ray(), a) == reuse.identity(ray(), b)
    assert reuse.identity(ray(30.0), a) != reuse.identity(ray(40.0), a)
    assert reuse.identity(ray(), a) != reuse.identity(ray(), deployment(replica_startup_s=60.0))


def test_the_clients_retries_and_the_initial_fleet_are_part_of_a_run() -> None:
    dep, task = deployment(), ray()
    assert reuse.identity(task, dep) != reuse.identity(Task(SPEC, task.policy, 5), dep)
    assert reuse.identity(task, dep) != reuse.identity(Task(SPEC, task.policy, 4, client_retries=0), dep)


def _earlier(dep: Deployment) -> dict[str, Any]:
    static = {"trace": "constant", "seed": 101, "static_replicas": 9, "initial_replicas": 4}
    runs = [
        {"policy": "ray-tuned", "trace": "constant", "seed": 101, "attainment": 1.0},
        {"policy": "headroom", "trace": "constant", "seed": 101, "attainment": 0.99},
    ]
    return {
        "deployment": dep.source,
        "calibration": dep.calibration,
        "tuning": {},
        "static": [static],
        "runs": runs,
    }


def _tasks_of(
    dep: Deployment, tuning: Mapping[str, Any], specs: list[TraceSpec], statics: list[dict[str, Any]]
) -> list[Task]:
    return [ray(), headroom()]


def test_earlier_runs_are_found_by_what_they_read() -> None:
    earlier_dep = deployment()
    earlier = _earlier(earlier_dep)
    now = Deployment(**{**earlier_dep.__dict__, "settings": earlier_dep.settings})
    statics, runs = reuse.reusable(earlier, now, [SPEC], _tasks_of)
    assert statics[reuse.static_identity(SPEC, now)]["static_replicas"] == 9
    assert runs[reuse.identity(ray(), now)]["policy"] == "ray-tuned"
    assert runs[reuse.identity(headroom(), now)]["attainment"] == 0.99


def test_nothing_is_reused_for_traces_the_earlier_benchmark_did_not_judge() -> None:
    dep = deployment()
    assert reuse.reusable(_earlier(dep), dep, [SPEC, TraceSpec("step", 101)], _tasks_of) == ({}, {})
    assert reuse.reusable(None, dep, [SPEC], _tasks_of) == ({}, {})


def test_a_record_that_comes_out_different_stops_the_reuse() -> None:
    reuse._same({"attainment": 1.0, "timeline": [1]}, {"attainment": 1.0}, "x")
    with pytest.raises(SystemExit, match="differs when run again"):
        reuse._same({"attainment": 0.98}, {"attainment": 1.0}, "x")
