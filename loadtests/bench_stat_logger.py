"""What one histogram observation costs through Ray's metrics (vLLM's RayPrometheusStatLogger, which
headroom's replicas use) against prometheus_client (vLLM's PrometheusStatLogger, which `vllm serve` uses).

vLLM's stat logger observes its inter-token-latency histogram once per generated token, in the engine client's
event loop: in a headroom replica that is the replica process, which also serves the HTTP side. Both metric
kinds are measured in one Ray worker, alternating, with vLLM's own buckets and labels; the report gives the
median [min, max] microseconds per observation over the repeats and their per-repeat ratio.

    python -m loadtests.bench_stat_logger --out results/stat_logger     (make bench-stat-logger)
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from loadtests.machine import describe

# vLLM's inter-token-latency buckets (vllm/v1/metrics/loggers.py).
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0]  # fmt: skip


def measure(observations: int, repeats: int) -> dict[str, list[float]]:
    """Microseconds per observation of each kind, one value per repeat (runs in a Ray worker)."""
    import prometheus_client
    from vllm.v1.metrics.ray_wrappers import RayHistogramWrapper

    labels = ["model_name", "engine"]
    kinds = {
        "ray": RayHistogramWrapper(
            "vllm:bench_itl_seconds", "bench", labelnames=labels, buckets=ITL_BUCKETS
        ).labels("m", "0"),
        "prometheus_client": prometheus_client.Histogram(
            "bench_itl_seconds", "bench", labels, buckets=ITL_BUCKETS
        ).labels("m", "0"),
    }
    out: dict[str, list[float]] = {k: [] for k in kinds}
    for r in range(repeats):
        for name in list(kinds) if r % 2 == 0 else list(kinds)[::-1]:
            h = kinds[name]
            t0 = time.perf_counter()
            for _ in range(observations):
                h.observe(0.008)
            out[name].append((time.perf_counter() - t0) / observations * 1e6)
    return out


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def report(per_repeat: dict[str, list[float]], args: argparse.Namespace) -> dict[str, Any]:
    import ray
    import vllm

    ratios = [a / b for a, b in zip(per_repeat["ray"], per_repeat["prometheus_client"], strict=True)]
    return {
        "machine": describe(),
        "versions": {"vllm": vllm.__version__, "ray": ray.__version__},
        "observations_per_repeat": args.observations,
        "repeats": args.repeats,
        "us_per_observation": {k: spread(v) for k, v in per_repeat.items()},
        "ratio_ray_to_prometheus_client": spread(ratios),
        "per_repeat": per_repeat,
        "command": f"python -m loadtests.bench_stat_logger --observations {args.observations} "
        f"--repeats {args.repeats} --out {args.out}",
    }


def markdown(r: dict[str, Any]) -> str:
    def fmt(s: dict[str, float]) -> str:
        return f"{s['median']:.2f} [{s['min']:.2f}, {s['max']:.2f}]"

    us = r["us_per_observation"]
    return "\n".join(
        [
            "# One histogram observation: Ray's metrics against prometheus_client",
            "",
            f"Machine: {r['machine']}. vLLM {r['versions']['vllm']}, Ray {r['versions']['ray']}. "
            f"{r['repeats']} repeats of {r['observations_per_repeat']:,} observations each, alternating.",
            "",
            "| metric kind | us per observation, median [min, max] |",
            "|---|---:|",
            f"| Ray (vLLM's RayHistogramWrapper: headroom replicas) | {fmt(us['ray'])} |",
            f"| prometheus_client (`vllm serve`) | {fmt(us['prometheus_client'])} |",
            f"| ratio, paired per repeat | {fmt(r['ratio_ray_to_prometheus_client'])} |",
            "",
            f"Command: `{r['command']}`",
            "",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--observations", type=int, default=20_000)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--out", type=Path, default=Path("results/stat_logger"))
    args = p.parse_args(argv)
    import ray

    ray.init(num_cpus=1, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    try:
        per_repeat = ray.get(ray.remote(measure).remote(args.observations, args.repeats))
    finally:
        ray.shutdown()
    r = report(per_repeat, args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(r, indent=2))
    (args.out / "report.md").write_text(markdown(r))
    print(markdown(r))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
