"""Step costs fitted to the engine's step log: do they carry from closed loops to an open loop's overload,
and to other runs? (An experiment; the fit it judges is the one the replay's calibration and `python -m
autoscale.calibrate --steps` use.)

    python results/autoscale/experiments/step_log_fit.py > results/autoscale/experiments/step_log_fit.txt

Six H100 replay runs saved the replica's step log during each calibration loop and each replay:
results/gpu/2026-12-07/replay-steps-seed{11,13,17} (bare step lists; the KV cache's size is read from their
Ray logs) and replay-steps-kv-seed{19,23,29} (engine_steps' {kv_cache_tokens, steps}: these three runs'
own reports were calibrated with this fit, before their replays ran). For each, the step costs are fitted to
its calibration loops' logs alone and the request overhead to its closed loops' TTFT with those costs held
(autoscale.calibrate.fit_to_step_logs). Then:

1. The busy time each replay's own log measured against what those costs give for the same steps.
2. Simulated minus measured attainment (points) of every replay window of the ten H100 runs, with each
   step-log fit and with the coordinate search over percentiles (its own points, the shipped calibration
   before the step log); the four earlier runs (no step log) are held out from every step-log fit.
3. The same with one fit to the other step-log runs' logs and points pooled (the run held out), as
   ``calibrate --steps`` fits several replicas' or runs' logs together.
4. A summary over the windows where the measured attainment was below 100% (a window that missed nothing
   is matched by every fit): a run's own fit (its replays were not fitted), the other runs' fits one by one,
   and pooled.
"""

from __future__ import annotations

import gzip
import json
import re
import tarfile
from pathlib import Path

import numpy as np
from replay_cross_fit import RUNS as EARLIER_RUNS
from replay_cross_fit import gaps, run_points

from autoscale.calibrate import fit, fit_loss, fit_to_step_logs
from autoscale.calibration import EngineCost, EngineLimits
from autoscale.step_log import STEP_WINDOW, step_windows
from loadtests.gpu.autoscale_replay import deployment_for, replay_config
from serve_app.config import load_config_files

ROOT = Path(__file__).resolve().parents[3]
CONFIG = ("configs/base.yaml", "loadtests/gpu/qwen3-8b.yaml")
STEP_RUNS = {
    **{f"seed{s}": ROOT / f"results/gpu/2026-12-07/replay-steps-seed{s}" for s in (11, 13, 17)},
    **{f"seed{s}": ROOT / f"results/gpu/2026-12-07/replay-steps-kv-seed{s}" for s in (19, 23, 29)},
}
TARGET_PP = 2.0  # the target: simulated attainment within 2 points of the measured


def kv_cache_tokens(directory: Path) -> int:
    """The engine's KV cache as vLLM logged it at start-up (it differs by a few blocks from run to run);
    for the runs whose step logs carry it, the same number."""
    with tarfile.open(directory / "ray-logs.tar.gz") as tar:
        for member in tar.getmembers():
            f = tar.extractfile(member)
            if f is None:
                continue
            found = re.search(rb"GPU KV cache size: ([\d,]+) tokens", f.read())
            if found:
                return int(found.group(1).replace(b",", b""))
    raise SystemExit(f"{directory}: no KV cache size in its Ray logs")


def steps(path: Path) -> list[dict]:
    """A saved step log's steps: a bare list (the first three runs) or engine_steps' dict."""
    log = json.loads(gzip.decompress(path.read_bytes()))
    return log["steps"] if isinstance(log, dict) else log


def main() -> None:
    committed = deployment_for(replay_config(load_config_files(*CONFIG), 1), 1)
    limits = committed.limits
    costs: dict[str, EngineCost] = {}
    engine: dict[str, EngineLimits] = {}  # each fit's limits: the plan's with its engine's KV cache
    kv = {name: kv_cache_tokens(d) for name, d in STEP_RUNS.items()}
    print(
        "Step-log fits (calibration loops only), then the request overhead fitted to the same run's points:"
    )
    # The first three runs saved bare step lists; the KV cache's size comes from their Ray logs.
    logs = {
        name: [
            {"kv_cache_tokens": kv[name], "steps": steps(p)}
            for p in sorted(d.glob("calibration_steps_c*.json.gz"))
        ]
        for name, d in STEP_RUNS.items()
    }
    all_points = {name: run_points(d) for name, d in STEP_RUNS.items()}
    for name in STEP_RUNS:
        points = all_points[name]
        cost, engine[name] = fit_to_step_logs(points, committed.cost, limits, logs[name])
        shipped = fit(points, committed.cost, limits)
        costs[f"steps {name}"] = cost
        print(
            f"  {name} (KV {kv[name]:,} tokens): "
            + ", ".join(f"{k} {v:.4g}" for k, v in vars_of(cost).items())
            + f"; loss on its points {fit_loss(points, cost, limits):.3f}"
            + f" (the percentile search's: {fit_loss(points, shipped, limits):.3f})"
        )

    # One fit to the other runs' logs and points pooled, per run: every run is held out from its own (the
    # earlier four, without step logs, share the fit to all six).
    def pooled_fit(runs: list[str]) -> tuple[EngineCost, EngineLimits]:
        points = [p for run in runs for p in all_points[run]]
        return fit_to_step_logs(points, committed.cost, limits, [log for run in runs for log in logs[run]])

    all_six = pooled_fit(list(STEP_RUNS))
    pooled = {name: all_six for name in EARLIER_RUNS}
    pooled |= {name: pooled_fit([other for other in STEP_RUNS if other != name]) for name in STEP_RUNS}
    print("  pooled, all six: " + ", ".join(f"{k} {v:.4g}" for k, v in vars_of(all_six[0]).items()))

    print()
    print(
        f"Busy time of each replay's own step log (windows of {STEP_WINDOW} busy steps), given by each fit"
        " / measured:"
    )
    print("| replay | measured s | " + " | ".join(costs) + " |")
    print("|" + "---|" * (len(costs) + 2))
    for name, d in STEP_RUNS.items():
        for k in (0, 1):
            durations, rows = step_windows(steps(d / f"steps_{k}.json.gz"), kv[name])
            cells = []
            for cost in costs.values():
                c = np.array(
                    [
                        cost.step_ms,
                        cost.prefill_ms_per_token,
                        cost.decode_ms_per_seq,
                        cost.attention_ms_per_kv_token,
                    ]
                )
                cells.append(f"{float((rows @ c).sum() / durations.sum()):.3f}")
            print(f"| {name} #{k} | {durations.sum() / 1000:.1f} | " + " | ".join(cells) + " |")

    print()
    print("Simulated minus measured attainment (points): the run's own percentile fit (as reported), each")
    print("step-log fit, and the step-log fit to every other run pooled; the earlier four runs have no step")
    print("log and are held out from every step-log fit.")
    print("| run | peak | measured | own percentile fit | " + " | ".join(costs) + " | pooled, others |")
    print("|" + "---|" * (len(costs) + 5))
    all_runs = {**EARLIER_RUNS, **STEP_RUNS}
    own_fit: list[float] = []  # windows with misses, gap with the run's own step-log fit
    other_fits: list[float] = []  # the same windows (and the earlier runs'), the other runs' step-log fits
    percentile: list[float] = []
    pooled_others: list[float] = []
    for name, d in all_runs.items():
        result = json.loads((d / "autoscale_replay.json").read_text())
        own = gaps(d, fit(run_points(d), committed.cost, limits))
        step_fits = {fitted: gaps(d, costs[f"steps {fitted}"], engine[fitted]) for fitted in STEP_RUNS}
        pooled_fit = gaps(d, *pooled[name])
        for k, replay in enumerate(result["replays"]):
            columns = [own, *step_fits.values(), pooled_fit]
            cells = " | ".join(f"{column[k]:+.2f}" for column in columns)
            print(
                f"| {name} | {replay['peak_replicas']} | {replay['measured']['attainment']:.2%} | {cells} |"
            )
            if replay["measured"]["attainment"] < 1:
                percentile.append(own[k])
                pooled_others.append(pooled_fit[k])
                for fitted, column in step_fits.items():
                    (own_fit if fitted == name else other_fits).append(column[k])

    print()
    print(f"Windows with misses, simulated minus measured (points); within {TARGET_PP:g} points:")
    for label, values in (
        ("the run's own step-log fit", own_fit),
        ("another run's step-log fit", other_fits),
        ("the other runs' step logs pooled", pooled_others),
        ("the run's own percentile fit", percentile),
    ):
        v = np.array(values)
        print(
            f"  {label}: {int((np.abs(v) <= TARGET_PP).sum())} of {v.size}, "
            f"from {v.min():+.2f} to {v.max():+.2f}, mean |gap| {np.abs(v).mean():.2f}"
        )


def vars_of(cost: EngineCost) -> dict[str, float]:
    return {k: getattr(cost, k) for k in EngineCost.__slots__}


if __name__ == "__main__":
    main()
