"""Experiment (not shipped): the shipped policy with settings overridden, on the tuning traces only.

    python results/autoscale/experiments/overrides.py '{"spare_replicas": 3}' ... > overrides.txt

Each argument is a JSON object of autoscaling settings laid over results/autoscale/deployment.json; each
runs on the four synthetic shapes, seeds 1-2 (autoscale/scenarios.py: never the judging seeds), from the
benchmark's initial fleet, and prints one JSON line per argument: attainment, missed requests, cost
against the static 99% fleet and direction changes, per run.
"""

from __future__ import annotations

import json
import sys

from autoscale.experiment import PolicySpec, Task, load_deployment, run_task, smallest_static
from autoscale.scenarios import SYNTHETIC_KINDS, TUNING_SEEDS, TraceSpec


def main() -> None:
    dep = load_deployment()
    specs = [TraceSpec(k, s) for k in SYNTHETIC_KINDS for s in TUNING_SEEDS]
    statics = [smallest_static(sp, dep) for sp in specs]
    for arg in sys.argv[1:]:
        overrides = tuple(sorted(json.loads(arg).items()))
        out = {}
        for sp, st in zip(specs, statics, strict=True):
            task = Task(sp, PolicySpec("headroom", "headroom", overrides=overrides), st["initial_replicas"])
            r = run_task(task, dep)
            out[sp.label] = {
                "attainment": r["attainment"],
                "missed": round(r["requests"] * (1 - r["attainment"])),
                "cost_ratio": round(r["replica_hours"] / st["replica_hours"], 4),
                "max_direction_changes_per_10min": r["max_direction_changes_per_10min"],
            }
        print(json.dumps({"overrides": dict(overrides), "runs": out}), flush=True)


if __name__ == "__main__":
    main()
