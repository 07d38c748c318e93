"""The tuner's objective: the benchmark's targets, the comparison with Ray's chosen configuration included,
and the reuse of an earlier Ray ranking (pure: no simulation runs)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from autoscale import tune
from autoscale.experiment import beats_rival, load_deployment

REPO = Path(__file__).resolve().parents[2]
STATIC_HOURS = {"constant": 5.0, "bursty": 10.0}
PEAK_TO_MEAN = {"constant": 1.0, "bursty": 2.0}


def run(kind: str, attainment: float, hours: float, dirs: int = 0, requests: int = 100) -> dict[str, Any]:
    return {
        "trace": kind,
        "requests": requests,
        "attainment": attainment,
        "replica_hours": hours,
        "max_direction_changes_per_10min": dirs,
    }


@pytest.mark.parametrize(
    ("ours", "rival", "beats"),
    [
        ((1.0, 5.0), (1.0, 6.0), True),  # as many on time for fewer replica-hours
        ((1.0, 6.0), (1.0, 6.0), True),  # equal on both counts
        ((0.99, 5.0), (1.0, 6.0), False),  # cheaper but one request more late
        ((1.0, 6.5), (1.0, 6.0), False),  # as good but dearer
    ],
)
def test_beating_the_rival_needs_attainment_and_cost_both(
    ours: tuple[float, float], rival: tuple[float, float], beats: bool
) -> None:
    a = {"attainment": ours[0], "replica_hours": ours[1]}
    b = {"attainment": rival[0], "replica_hours": rival[1]}
    assert beats_rival(a, b) is beats


def test_the_score_counts_the_comparison_with_the_rival_per_trace_kind() -> None:
    mine = [run("constant", 1.0, 5.0), run("bursty", 0.95, 8.0, dirs=3)]
    rival = tune.by_kind([run("constant", 1.0, 8.0), run("bursty", 1.0, 12.0)])
    without = tune.score(mine, STATIC_HOURS, PEAK_TO_MEAN)
    with_rival = tune.score(mine, STATIC_HOURS, PEAK_TO_MEAN, rival)
    # constant beats the rival (100% at 5 vs 8 replica-h); bursty does not (95% vs 100%)
    assert with_rival["targets_met"] == without["targets_met"] + 1 == 5


def test_a_configuration_that_beats_the_rival_outranks_a_cheaper_one_that_does_not() -> None:
    rival = tune.by_kind([run("constant", 1.0, 6.0)])
    generous = tune.score([run("constant", 1.0, 5.2)], {"constant": 5.0}, {"constant": 1.0}, rival)
    cheap = tune.score([run("constant", 0.999, 5.0)], {"constant": 5.0}, {"constant": 1.0}, rival)
    assert generous["targets_met"] > cheap["targets_met"]


def _earlier(tmp_path: Path, grid: Any, chosen: dict[str, Any]) -> Path:
    row = {"settings": chosen, "targets_met": 6, "attainment": {"constant": 1.0}, "cost_ratio": {"c": 1.2}}
    path = tmp_path / "tuning.json"
    path.write_text(json.dumps({"grids": {"ray": grid}, "ranked": {"ray": [row]}}))
    return path


def test_an_earlier_ray_ranking_gives_its_chosen_configuration_alone(tmp_path: Path) -> None:
    chosen = {k: v[0] for k, v in tune.RAY_GRID.items()}
    path = _earlier(tmp_path, json.loads(json.dumps(tune.RAY_GRID)), chosen)
    dep = load_deployment(REPO / "results/autoscale/deployment.json")
    specs, ranked = tune._ray_family(dep, str(path))
    assert [tune._settings_of(s) for s in specs] == [chosen]
    assert ranked is not None and ranked[0]["settings"] == chosen


def test_an_earlier_ranking_of_another_ray_grid_is_refused(tmp_path: Path) -> None:
    path = _earlier(tmp_path, {"target_ongoing_requests": [2.0]}, {"target_ongoing_requests": 2.0})
    dep = load_deployment(REPO / "results/autoscale/deployment.json")
    with pytest.raises(SystemExit, match="another Ray grid"):
        tune._ray_family(dep, str(path))


def test_the_earlier_ranking_is_kept_only_if_its_choice_scores_the_same_again() -> None:
    recorded = [{"targets_met": 6, "attainment": {"constant": 1.0}, "cost_ratio": {"constant": 1.2}}]
    assert tune._rank_ray([dict(recorded[0])], recorded, "x.json") is recorded
    moved = [{"targets_met": 6, "attainment": {"constant": 0.99}, "cost_ratio": {"constant": 1.2}}]
    with pytest.raises(SystemExit, match="now scores"):
        tune._rank_ray(moved, recorded, "x.json")
