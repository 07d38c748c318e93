"""Where one run misses: its requests binned by arrival (30 s), with the fleet, on tuning seeds only.

    python -m autoscale.timeline bursty 1 [--set target_engine_utilization=0.8] --out FILE.md

Runs headroom's policy as results/autoscale/deployment.json ships it (``--set`` overrides a setting) on one
trace, from the benchmark's initial fleet, and writes the bins in which requests missed the TTFT target:
the arrival rate, the requests missed, the replicas provisioned and serving (lowest in the bin); then every
scale event with its reason code. Judging seeds are refused: the benchmark forbids looking at them while
choosing knobs.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from autoscale.experiment import DEFAULT_DEPLOYMENT, PolicySpec, load_deployment, smallest_static
from autoscale.scenarios import JUDGING_SEEDS, TraceSpec, build_trace
from autoscale.sim import ScaleEvent, simulate

__all__ = ["main", "missed_bins"]


def missed_bins(timeline: dict[str, Any]) -> list[dict[str, float | int]]:
    """One row per bin with a missed request: start, rate, missed, provisioned and serving replicas."""
    bin_s = float(timeline["bin_s"])
    per = round(bin_s)
    rows = []
    for b, missed in enumerate(timeline["missed"]):
        if missed == 0:
            continue
        prov = timeline["provisioned"][b * per : (b + 1) * per] or [0]
        ready = timeline["ready"][b * per : (b + 1) * per] or [0]
        rows.append(
            {
                "start_s": b * bin_s,
                "rate_rps": round(float(timeline["rate_rps"][b]), 1),
                "missed": int(missed),
                "provisioned": max(prov),
                "serving": min(ready),
            }
        )
    return rows


def _report(spec: TraceSpec, overrides: dict[str, Any], deployment: str) -> list[str]:
    dep = load_deployment(deployment)
    trace = build_trace(spec)
    static = smallest_static(spec, dep)
    policy = PolicySpec("headroom", "headroom", overrides=tuple(sorted(overrides.items()))).build(dep, trace)
    events: list[ScaleEvent] = []
    setup = dep.setup(spec.seed, static["initial_replicas"])
    r = simulate(trace, policy, setup, keep_timeline=True, on_event=events.append)
    assert r.timeline is not None
    rows = missed_bins(r.timeline)
    missed = sum(int(x["missed"]) for x in rows)
    lines = [
        f"# {spec.label}: where headroom misses",
        "",
        f"Command: `python -m autoscale.timeline {spec.kind} {spec.seed}"
        + "".join(f" --set {k}={json.dumps(v)}" for k, v in sorted(overrides.items()))
        + "` (a tuning seed; the deployment of results/autoscale/deployment.json).",
        "",
        f"{r.requests} requests, {r.attainment:.2%} under the {r.ttft_target_ms:.0f} ms target "
        f"({missed} missed, {r.failed} failed); {r.replica_hours:.2f} replica-h against the static 99% "
        f"fleet's {static['replica_hours']:.2f} ({static['static_replicas']} replicas); start fleet "
        f"{static['initial_replicas']}.",
        "",
        "| bin start (s) | arrivals/s | missed | share of all missed | provisioned | serving |",
        "|---|---|---|---|---|---|",
    ]
    for x in rows:
        lines.append(
            f"| {x['start_s']:.0f} | {x['rate_rps']} | {x['missed']} | {x['missed'] / max(missed, 1):.1%} "
            f"| {x['provisioned']} | {x['serving']} |"
        )
    lines += ["", "Scale events:", ""]
    lines += [f"- {e.t_s:.0f} s: {e.from_replicas} -> {e.to_replicas} ({e.code})" for e in events]
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m autoscale.timeline", description=__doc__.split("\n\n")[0])
    ap.add_argument("kind")
    ap.add_argument("seed", type=int)
    ap.add_argument("--set", action="append", default=[], help="a setting override, NAME=VALUE (JSON value)")
    ap.add_argument("--deployment", default=str(DEFAULT_DEPLOYMENT))
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    if args.seed in JUDGING_SEEDS:
        raise SystemExit(f"seed {args.seed} judges the benchmark ({JUDGING_SEEDS[0]}-{JUDGING_SEEDS[-1]})")
    overrides = {k: json.loads(v) for k, v in (s.split("=", 1) for s in args.set)}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(_report(TraceSpec(args.kind, args.seed), overrides, args.deployment)) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
