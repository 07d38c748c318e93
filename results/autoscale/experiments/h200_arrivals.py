"""The H200 calibration refitted with each request's arrival, and what it does to the shipped policy
(an experiment, not shipped; seed 3 only: neither a tuning nor a judging seed).

    python results/autoscale/experiments/h200_arrivals.py results/autoscale/experiments/h200_arrivals

1. Points: bare vLLM's closed loops on the H200 kept in the GPU runs' archives (round 0 of each cell), with
   each request's send time and TTFT; fitted from the committed calibration, the committed points kept.
2. Check: rounds 1 and 2 of the same cells, never fitted, on the committed and the refitted costs.
   Also bare vLLM under Poisson arrivals (20 requests/s), the regime the autoscaling simulator replays.
3. The shipped deployment (results/autoscale/deployment.json) on three traces, seed 3, with either
   calibration: the smallest static 99% fleet, headroom's attainment and its cost against that fleet.
"""

from __future__ import annotations

import json
import sys
import tarfile
from dataclasses import asdict
from pathlib import Path

from autoscale.calibrate import Point, fit, point_from_vllm_bench_result
from autoscale.calibration import DEFAULT_CALIBRATION, EngineLimits, load_calibration
from autoscale.experiment import DEFAULT_DEPLOYMENT, PolicySpec, load_deployment, smallest_static
from autoscale.scenarios import TraceSpec, build_trace
from autoscale.sim import simulate

ROOT = Path(__file__).resolve().parents[3]
CELLS = [  # (archive, member prefix, cell name)
    ("results/gpu/2026-12-02c/overhead/overhead.tar.gz", "overhead/raw/", "vllm-random-1024-c64"),
    ("results/gpu/2026-12-03/overhead/overhead.tar.gz", "overhead/raw/", "vllm-random-1024-c128"),
    ("results/gpu/2026-12-03/defaults/defaults.tar.gz", "defaults/raw/", "vllm-random-1024-c256"),
    ("results/gpu/2026-12-03b/overhead/overhead.tar.gz", "overhead/raw/", "vllm-short-c64"),
    ("results/gpu/2026-12-03b/overhead/overhead.tar.gz", "overhead/raw/", "vllm-short-c128"),
]
# Poisson arrivals at 20 requests/s (at most 64 in flight), the regime the autoscaling simulator replays:
# checked given their arrivals, never fitted.
OPEN_LOOP = (
    "results/gpu/2026-12-02c/overhead/overhead.tar.gz",
    "overhead/raw/",
    "vllm-random-1024-c64-open20",
)
LIMITS = EngineLimits(256, 8192, 335_968, 100_000)  # half an H200 in the shared-GPU runs; KV never binds
TRACES = ("diurnal", "bursty", "synthetic-production-format")


def points(round_no: int, cells: list[tuple[str, str, str]] = CELLS) -> list[Point]:
    out = []
    for archive, prefix, cell in cells:
        with tarfile.open(ROOT / archive) as tar:
            member = tar.extractfile(f"{prefix}{cell}-r{round_no}.json")
            assert member is not None
            data = json.loads(member.read())
        out.append(point_from_vllm_bench_result(data, f"{archive}:{prefix}{cell}-r{round_no}.json"))
    return out


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    committed = load_calibration()
    kept = [Point.from_dict({k: v for k, v in p.items() if k != "simulated"}) for p in committed.points]
    cost = fit(kept + points(0), committed.cost, LIMITS)
    refit = committed.with_cost(
        cost, "measured", "refitted with arrivals: " + ", ".join(c for *_, c in CELLS)
    )
    refit_path = out / "calibration.json"
    refit_path.write_text(json.dumps(refit.to_dict(), indent=2) + "\n")
    lines = [f"refitted costs: {asdict(cost)}", f"committed costs: {asdict(committed.cost)}", "",
             "held-out rounds (1, 2): measured / committed / refitted"]  # fmt: skip
    for r in (1, 2):
        for p in points(r):
            a, b = p.summary(committed.cost, LIMITS), p.summary(cost, LIMITS)
            tok = [
                p.output_tokens_per_s,
                a["simulated"]["output_tokens_per_s"],
                b["simulated"]["output_tokens_per_s"],
            ]
            tpot = [p.tpot_p50_ms, a["simulated"]["tpot_p50_ms"], b["simulated"]["tpot_p50_ms"]]
            given = (
                a["given_arrivals"]["measured"]["ttft_p50_ms"],
                a["given_arrivals"]["simulated"]["ttft_p50_ms"],
            )
            ttft = [*given, b["given_arrivals"]["simulated"]["ttft_p50_ms"]]
            lines.append(
                f"{p.label} r{r}: tok/s {' / '.join(f'{v:.0f}' for v in tok)}; TPOT "
                f"{' / '.join(f'{v:.1f}' for v in tpot)}; TTFT p50 given arrivals "
                f"{' / '.join(f'{v:.0f}' for v in ttft)}"
            )
    lines += [
        "",
        "open loop, 20 requests/s, given its arrivals: TTFT p50, p90 measured / committed / refitted",
    ]
    for r in (0, 1, 2):
        (p,) = points(r, [OPEN_LOOP])
        a, b = p.summary(committed.cost, LIMITS), p.summary(cost, LIMITS)
        for m in ("ttft_p50_ms", "ttft_p90_ms"):
            got = [a["given_arrivals"]["measured"][m], a["given_arrivals"]["simulated"][m]]
            got.append(b["given_arrivals"]["simulated"][m])
            lines.append(f"open20 r{r} {m}: {' / '.join(f'{v:.1f}' for v in got)}")
    lines += ["", "shipped policy, seed 3: calibration, static 99% fleet, headroom on time, cost vs static"]
    for kind in TRACES:
        spec = TraceSpec(kind, 3)
        for name, path in (("committed", DEFAULT_CALIBRATION), ("refitted", refit_path)):
            dep = load_deployment(DEFAULT_DEPLOYMENT, path)
            static = smallest_static(spec, dep)
            trace = build_trace(spec)
            policy = PolicySpec("headroom", "headroom").build(dep, trace)
            r = simulate(trace, policy, dep.setup(spec.seed, static["initial_replicas"]))
            lines.append(
                f"{spec.label} {name}: static {static['static_replicas']} replicas, headroom "
                f"{r.attainment:.2%}, {r.replica_hours / static['replica_hours']:.3f}x"
            )
            print(lines[-1], flush=True)
    (out / "results.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
