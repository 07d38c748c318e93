"""Experiment (not shipped): does a second, shorter trend window catch a burst's climb earlier?

    python results/autoscale/experiments/fast_trend.py FAST_WINDOW_S ... > fast_trend.txt

On the tuning traces only (autoscale/scenarios.py: seeds 1-2), the shipped policy
(results/autoscale/deployment.json) runs with its trend taken as the larger of the persistent trends over
trend_window_s and over FAST_WINDOW_S (0: the shipped policy unchanged). A fit over a window that is
mostly flat load underestimates a climb that has just begun; the shorter window sees it sooner and noisier.
Patched in here (autoscale/signals.py is unchanged), so the policy that ships is not touched.
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace

from autoscale import signals
from autoscale.experiment import PolicySpec, Task, load_deployment, run_task, smallest_static
from autoscale.scenarios import SYNTHETIC_KINDS, TUNING_SEEDS, TraceSpec

ORIGINAL = signals._persistent_trend


def patched(fast_s: float):  # type: ignore[no-untyped-def]
    def trend(history, snapshot, cfg):  # type: ignore[no-untyped-def]
        slow = ORIGINAL(history, snapshot, cfg)
        fast_cfg = replace(cfg, settings=cfg.settings.model_copy(update={"trend_window_s": fast_s}))
        return max(slow, ORIGINAL(history, snapshot, fast_cfg))

    return trend


def main() -> None:
    dep = load_deployment()
    specs = [TraceSpec(k, s) for k in SYNTHETIC_KINDS for s in TUNING_SEEDS]
    statics = [smallest_static(sp, dep) for sp in specs]
    for arg in sys.argv[1:]:
        fast_s = float(arg)
        signals._persistent_trend = patched(fast_s) if fast_s > 0 else ORIGINAL  # type: ignore[assignment]
        out = {}
        for sp, st in zip(specs, statics, strict=True):
            r = run_task(Task(sp, PolicySpec("headroom", "headroom"), st["initial_replicas"]), dep)
            out[sp.label] = {
                "attainment": r["attainment"],
                "missed": round(r["requests"] * (1 - r["attainment"])),
                "cost_ratio": round(r["replica_hours"] / st["replica_hours"], 4),
                "max_direction_changes_per_10min": r["max_direction_changes_per_10min"],
            }
        print(json.dumps({"fast_window_s": fast_s, "runs": out}), flush=True)


if __name__ == "__main__":
    main()
