"""Does a calibration fitted on one H100 run predict another run's replays? (An experiment; not shipped.)

    python results/autoscale/experiments/replay_cross_fit.py \
        > results/autoscale/experiments/replay_cross_fit.txt

Four GPU replays on one H100 each (results/gpu/2026-12-07/): `replay` (the morning run, calibrated at
c = 1/16/64/128, peaks 0.9/1.2/1.5) and `replay-c256-seed{5,7,9}` (the afternoon's three runs on one machine,
calibrated at c = 1/16/64/128/256, two peaks each). Each run's replays are predicted again with the step costs
fitted to every run's calibration points, one at a time, and with the other runs' points pooled (the run's
own left out). Each cell: simulated minus measured attainment in points; the diagonal is what the run's
report says.

Then the search itself: each run's own points fitted again from the pooled fit of all four runs instead of
from the committed H200 calibration. The coordinate search (autoscale.calibrate.fit) is local; if this start
reaches a lower loss on the run's own points, the shipped fit stopped in a local minimum, and the replay gaps
beside it show what a better fit of the same objective predicts.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import asdict, replace
from pathlib import Path

from autoscale.calibrate import Point, fit, fit_loss
from autoscale.calibration import EngineCost, EngineLimits
from loadtests import workloads
from loadtests.gpu.autoscale_replay import (
    deployment_for,
    parser,
    predict,
    replay_config,
    saved_points,
)
from serve_app.config import load_config_files

ROOT = Path(__file__).resolve().parents[3]
CONFIG = ("configs/base.yaml", "loadtests/gpu/qwen3-8b.yaml")  # every run's --config
RUNS = {
    "morning": ROOT / "results/gpu/2026-12-07/replay",
    "seed5": ROOT / "results/gpu/2026-12-07/replay-c256-seed5",
    "seed7": ROOT / "results/gpu/2026-12-07/replay-c256-seed7",
    "seed9": ROOT / "results/gpu/2026-12-07/replay-c256-seed9",
}


def run_points(directory: Path) -> list[Point]:
    result = json.loads((directory / "autoscale_replay.json").read_text())
    cells = [(q["concurrency"], q["requests"]) for q in result["calibration"]["points"]]
    points = saved_points(directory, cells)
    assert points is not None, f"{directory}: calibration results missing"
    return points


def gaps(directory: Path, cost: EngineCost, limits: EngineLimits | None = None) -> list[float]:
    """Simulated minus measured attainment (points) of each of the run's replays, with these step costs
    (and these limits, else the plan's)."""
    result = json.loads((directory / "autoscale_replay.json").read_text())
    args = parser().parse_args(shlex.split(result["command"])[3:])
    dep = replace(deployment_for(replay_config(load_config_files(*args.config), 1), 1), cost=cost)
    dep = replace(dep, limits=limits or dep.limits)
    out = []
    for replay in result["replays"]:
        steps = workloads.parse_steps(replay["arrival_rate_steps"])
        arrivals = [a.at_s for a in workloads.arrival_times(steps, seed=args.seed)]
        sim = predict(dep, arrivals, args, dep.settings.replica_startup_s)["attainment"]
        out.append(100 * (sim - replay["measured"]["attainment"]))
    return out


def main() -> None:
    committed = deployment_for(replay_config(load_config_files(*CONFIG), 1), 1)
    points = {name: run_points(d) for name, d in RUNS.items()}
    costs = {f"fit {name}": fit(pts, committed.cost, committed.limits) for name, pts in points.items()}
    for name in RUNS:
        others = [p for other, ps in points.items() if other != name for p in ps]
        costs[f"pooled without {name}"] = fit(others, committed.cost, committed.limits)
    print("| run | peak | measured | " + " | ".join(list(costs)[: len(RUNS)]) + " | pooled without the run |")
    print("|" + "---|" * (len(RUNS) + 4))
    for name, directory in RUNS.items():
        result = json.loads((directory / "autoscale_replay.json").read_text())
        columns = [gaps(directory, costs[f"fit {other}"]) for other in RUNS]
        columns.append(gaps(directory, costs[f"pooled without {name}"]))
        for k, replay in enumerate(result["replays"]):
            cells = " | ".join(f"{column[k]:+.2f}" for column in columns)
            measured = replay["measured"]["attainment"]
            print(f"| {name} | {replay['peak_replicas']} | {measured:.2%} | {cells} |")
    print()
    print("Step costs of each fit (ms):")
    for label, cost in costs.items():
        print(f"  {label}: " + ", ".join(f"{k} {v:.4g}" for k, v in asdict(cost).items()))

    pooled = fit([p for ps in points.values() for p in ps], committed.cost, committed.limits)
    print()
    print("| run | fitted from | loss on its own points | replay gaps (pp) |")
    print("|---|---|---:|---|")
    for name, directory in RUNS.items():
        starts = (("committed H200 calibration (shipped)", committed.cost), ("pooled fit", pooled))
        for start_label, start in starts:
            cost = fit(points[name], start, committed.limits)
            loss = fit_loss(points[name], cost, committed.limits)
            shown = " / ".join(f"{g:+.2f}" for g in gaps(directory, cost))
            print(f"| {name} | {start_label} | {loss:.3f} | {shown} |")


if __name__ == "__main__":
    main()
