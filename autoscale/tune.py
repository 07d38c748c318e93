"""Tunes headroom's policy and Ray's default on the tuning traces, with one objective for both.

    python -m autoscale.tune --out results/autoscale [--jobs 2] [--ray-from results/autoscale/tuning.json]

Each policy family is searched over a grid (Ray's is at least as large as ours) on the tuning traces
only (autoscale/scenarios.py: the four synthetic shapes, seeds 1-2; the judging seeds and the
production-format trace are never run here). A configuration's score (:func:`score`): first how many of
the benchmark's own targets it meets on the tuning traces, more is better; then the share of all their
requests under the TTFT target; then the mean replica-hours against the smallest static fleet that
reaches 99%, less is better. Ray's family is ranked first; headroom's targets then include the
benchmark's comparison with it (as many requests under target as Ray's chosen configuration at no more
replica-hours, per trace kind), so headroom is tuned on every target the benchmark judges it by, and Ray
on all of them but that comparison. The best of each family goes to ``tuning.json``: the benchmark judges
Ray's with those knobs, and headroom's chosen settings are what configs/prod.yaml ships (the report shows
both).

``--ray-from`` takes Ray's ranking from an earlier ``tuning.json`` of the same Ray grid instead of
searching it again (its runs read none of headroom's settings); Ray's chosen configuration is still run
on the tuning traces, and its score must equal the one recorded there, or the tuning stops.

Runs are cached in ``tuning_runs.jsonl`` (one line per run) so an interrupted tuning resumes.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from autoscale.experiment import (
    ATTAINMENT_TARGET,
    DEFAULT_DEPLOYMENT,
    STEADY_KINDS,
    Deployment,
    PolicySpec,
    Task,
    beats_rival,
    cost_limit,
    default_jobs,
    load_deployment,
    pooled,
    run_task,
    run_tasks,
    smallest_static,
)
from autoscale.ray_default import RayKnobs
from autoscale.scenarios import SYNTHETIC_KINDS, TUNING_SEEDS, TraceSpec

__all__ = ["HEADROOM_GRID", "HEADROOM_SLOT_GRID", "RAY_GRID", "main", "score"]

HEADROOM_GRID: Mapping[str, Sequence[Any]] = {
    "target_engine_utilization": (0.6, 0.7, 0.8, 0.9, 0.95),
    "surge_lookback_s": (0.0,),
    "trend_window_s": (60.0, 120.0),
    "trend_min_t_stat": (2.0, 4.0),
    "downscale_sustain_s": (300.0,),
}
"""0.95: the constant trace's static 99% fleets run near saturation, so its 1.05x needs a utilization target
above 0.9 (the previous tuning's choice, 0.9, cost 1.0503x on the tuning constant traces: commit 5fdb3bc's
results/autoscale/tuning.json). Left out, from that 64-point tuning, to make room for it on two shared
cores: downscale_sustain_s 600
(it met more targets than its 300 s twin in 3 of 32 pairs, all at utilization 0.6 and 1.21-1.28x the
static fleet, and cost more in all 32) and surge_lookback_s 1800 (more targets than its 0 s twin in 1 of
32 pairs, cost more in all 32)."""
HEADROOM_SLOT_GRID: Mapping[str, Sequence[Any]] = {
    **HEADROOM_GRID,
    "target_engine_utilization": (0.9, 0.95),
    "target_slot_utilization": (0.95,),
}
"""Searched as well: at target_engine_utilization 0.9 and 0.95 the sequence-slot term of the replica's
capacity binds (autoscale/capacity.py: 0.95 gave the very runs 0.9 gave, all 8 tuning traces, every trend
setting), so the constant trace's cost moves only with target_slot_utilization (0.85 by default)."""
RAY_GRID: Mapping[str, Sequence[Any]] = {
    "target_ongoing_requests": (20.0, 30.0, 40.0, 60.0, 80.0, 120.0),
    "upscale_delay_s": (0.0, 30.0),
    "downscale_delay_s": (120.0, 600.0),
    "downscaling_factor": (0.3, 1.0),
    "upscaling_factor": (1.0, 2.0),
}
"""Ray's grid has more points (96) than headroom's (20 + 8): its baseline is searched at least as widely."""


def _grid(grid: Mapping[str, Sequence[Any]]) -> list[dict[str, Any]]:
    return [dict(zip(grid, values, strict=True)) for values in itertools.product(*grid.values())]


def headroom_specs() -> list[PolicySpec]:
    return [
        PolicySpec("headroom", f"headroom {i}", overrides=tuple(sorted(c.items())))
        for i, c in enumerate([*_grid(HEADROOM_GRID), *_grid(HEADROOM_SLOT_GRID)])
    ]


def ray_specs(dep: Deployment) -> list[PolicySpec]:
    s = dep.settings
    return [
        PolicySpec(
            "ray", f"ray {i}", ray=RayKnobs(min_replicas=s.min_replicas, max_replicas=s.max_replicas, **c)
        )
        for i, c in enumerate(_grid(RAY_GRID))
    ]


def by_kind(records: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, float]]:
    """:func:`pooled` rows per trace kind."""
    kinds: dict[str, list[Mapping[str, Any]]] = {}
    for r in records:
        kinds.setdefault(r["trace"], []).append(r)
    return {k: pooled(rs) for k, rs in sorted(kinds.items())}


def score(
    records: Sequence[Mapping[str, Any]],
    static_hours: Mapping[str, float],
    peak_to_mean: Mapping[str, float],
    rival: Mapping[str, Mapping[str, Any]] | None = None,
) -> dict[str, Any]:
    """The tuning objective over one configuration's runs (any number of seeds per kind): how many of the
    benchmark's own targets it meets on the tuning traces (99% under the TTFT target, the cost limit,
    the direction changes and, given ``rival`` (:func:`by_kind` rows of Ray's chosen configuration on the
    same runs), the comparison with it), then the attainment over all their requests, then the mean
    replica-hours against the static 99% fleet."""
    kinds = by_kind(records)
    ratios = {k: p["replica_hours"] / static_hours[k] for k, p in kinds.items()}
    met = 0
    for k, p in kinds.items():
        limit = cost_limit(k, peak_to_mean[k])
        met += p["attainment"] >= ATTAINMENT_TARGET
        met += limit is not None and ratios[k] <= limit
        met += k in STEADY_KINDS and p["max_direction_changes_per_10min"] <= 1
        met += rival is not None and beats_rival(p, rival[k])
    return {
        "targets_met": met,
        "attainment_all": pooled(records)["attainment"],
        "mean_cost_ratio": sum(ratios.values()) / len(ratios),
        "attainment": {k: round(p["attainment"], 5) for k, p in kinds.items()},
        "cost_ratio": {k: round(v, 4) for k, v in ratios.items()},
    }


def _key(task: Task, dep: Deployment) -> str:
    """A run's identity: the deployment, the trace and what the policy does (not its name, its grid
    index), so a run cached for another plan or calibration is never reused."""
    s = dep.settings
    deployment: list[Any] = [
        asdict(dep.limits),
        asdict(dep.admission),
        asdict(dep.cost),
        dep.ttft_target_ms,
        s.replica_startup_s,
        s.window_s,
    ]
    if task.policy.kind == "headroom":  # Ray's runs read none of headroom's settings
        deployment.append(s.model_dump(mode="json"))
    return json.dumps([deployment, asdict(task.trace), repr(replace(task.policy, name=""))], sort_keys=True)


def _cached_runs(path: Path, tasks: Sequence[Task], dep: Deployment, jobs: int) -> list[dict[str, Any]]:
    done: dict[str, dict[str, Any]] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            row = json.loads(line)
            done[row["key"]] = row["record"]
    todo = [t for t in tasks if _key(t, dep) not in done]
    started = time.perf_counter()

    def progress(i: int, n: int) -> None:
        if i % 20 == 0 or i == n:
            print(f"  {i}/{n} runs, {time.perf_counter() - started:.0f} s", flush=True)

    for chunk_start in range(0, len(todo), 40):
        chunk = todo[chunk_start : chunk_start + 40]
        with open(path, "a") as f:
            for task, rec in zip(chunk, run_tasks(run_task, chunk, dep, jobs, progress), strict=True):
                done[_key(task, dep)] = rec
                f.write(json.dumps({"key": _key(task, dep), "record": rec}) + "\n")
    return [done[_key(t, dep)] for t in tasks]


def _runs_of(spec: PolicySpec, tasks: list[Task], records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for t, r in zip(tasks, records, strict=True) if t.policy == spec]


def _best(
    family: list[PolicySpec],
    tasks: list[Task],
    records: list[dict[str, Any]],
    static_hours: Mapping[str, float],
    peak_to_mean: Mapping[str, float],
    rival: Mapping[str, Mapping[str, Any]] | None = None,
) -> list[dict[str, Any]]:
    rows = []
    for spec in family:
        mine = score(_runs_of(spec, tasks, records), static_hours, peak_to_mean, rival)
        rows.append({"name": spec.name, "settings": _settings_of(spec), **mine})
    rows.sort(key=lambda r: (-r["targets_met"], -r["attainment_all"], r["mean_cost_ratio"]))
    return rows


def _settings_of(spec: PolicySpec) -> dict[str, Any]:
    if spec.ray is not None:
        return {k: v for k, v in asdict(spec.ray).items() if k in RAY_GRID}
    return dict(spec.overrides)


def _ray_family(
    dep: Deployment, ray_from: str | None
) -> tuple[list[PolicySpec], list[dict[str, Any]] | None]:
    """Ray's grid; or, from an earlier tuning of the same grid, its chosen configuration alone and the
    ranking recorded there."""
    specs = ray_specs(dep)
    if ray_from is None:
        return specs, None
    earlier = json.loads(Path(ray_from).read_text())
    if earlier["grids"]["ray"] != json.loads(json.dumps(RAY_GRID)):
        raise SystemExit(
            f"{ray_from} searched another Ray grid ({earlier['grids']['ray']}); run without --ray-from"
        )
    ranked: list[dict[str, Any]] = earlier["ranked"]["ray"]
    return [sp for sp in specs if _settings_of(sp) == ranked[0]["settings"]], ranked


def _rank_ray(
    rows: list[dict[str, Any]], recorded: list[dict[str, Any]] | None, ray_from: str | None
) -> list[dict[str, Any]]:
    """The ranking to keep: this run's, or the recorded one once its chosen configuration scores the same
    again (the same deployment, traces and simulator)."""
    if recorded is None:
        return rows
    keys = ("targets_met", "attainment", "cost_ratio")
    if any(rows[0][k] != recorded[0][k] for k in keys):
        again = {k: rows[0][k] for k in keys}
        before = {k: recorded[0][k] for k in keys}
        raise SystemExit(f"Ray's chosen configuration now scores {again}, {ray_from} says {before}")
    return recorded


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m autoscale.tune", description=__doc__.split("\n\n")[0])
    ap.add_argument("--deployment", default=str(DEFAULT_DEPLOYMENT))
    ap.add_argument("--out", default="results/autoscale")
    ap.add_argument("--jobs", type=int, default=default_jobs())
    ap.add_argument("--ray-from", help="an earlier tuning.json whose Ray ranking to keep (same Ray grid)")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dep = load_deployment(args.deployment)
    specs = [TraceSpec(k, s) for k in SYNTHETIC_KINDS for s in TUNING_SEEDS]
    print(f"static 99% fleets for {len(specs)} tuning traces", flush=True)
    statics = run_tasks(smallest_static, specs, dep, args.jobs)
    static_hours: dict[str, float] = {}
    peaks: dict[str, list[float]] = {}
    for st in statics:
        static_hours[st["trace"]] = static_hours.get(st["trace"], 0.0) + st["replica_hours"]
        peaks.setdefault(st["trace"], []).append(st["peak_to_mean"])
    peak_to_mean = {k: sum(v) / len(v) for k, v in peaks.items()}
    ray_pols, recorded = _ray_family(dep, args.ray_from)
    family = {"headroom": headroom_specs(), "ray": ray_pols}
    tasks = [
        Task(sp, pol, st["initial_replicas"])
        for pols in family.values()
        for pol in pols
        for sp, st in zip(specs, statics, strict=True)
    ]
    sizes = f"{len(family['headroom'])} headroom and {len(family['ray'])} Ray configurations"
    print(f"{len(tasks)} tuning runs ({sizes})")
    records = _cached_runs(out / "tuning_runs.jsonl", tasks, dep, args.jobs)
    ray_rows = _best(ray_pols, tasks, records, static_hours, peak_to_mean)
    ray_chosen = next(sp for sp in ray_pols if _settings_of(sp) == ray_rows[0]["settings"])
    rival = by_kind(_runs_of(ray_chosen, tasks, records))
    ranked = {
        "headroom": _best(family["headroom"], tasks, records, static_hours, peak_to_mean, rival),
        "ray": _rank_ray(ray_rows, recorded, args.ray_from),
    }
    command = "python -m autoscale.tune --out " + args.out
    payload = {
        "command": command + (f" --ray-from {args.ray_from}" if args.ray_from else ""),
        "ray_from": None if recorded is None else {"path": args.ray_from, "rows": len(recorded)},
        "tuning_traces": [sp.label for sp in specs],
        "static": [
            {k: st[k] for k in ("trace", "seed", "static_replicas", "replica_hours", "attainment")}
            for st in statics
        ],
        "grids": {"headroom": [HEADROOM_GRID, HEADROOM_SLOT_GRID], "ray": RAY_GRID},
        "rival": {k: {f: v[f] for f in ("missed", "attainment", "replica_hours")} for k, v in rival.items()},
        "chosen": {name: rows[0] for name, rows in ranked.items()},
        "ranked": ranked,
    }
    (out / "tuning.json").write_text(json.dumps(payload, indent=2) + "\n")
    for name, rows in ranked.items():
        print(f"{name}: best {json.dumps(rows[0])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
