"""What one histogram observation costs through Ray's metrics (vLLM's RayPrometheusStatLogger, which
headroom's replicas use) against prometheus_client (vLLM's PrometheusStatLogger, which `vllm serve` uses),
and where Ray's cost is.

vLLM's stat logger observes its inter-token-latency histogram once per generated token, in the engine
client's event loop: in a headroom replica that is the replica process, which also serves the HTTP side.
Besides the two loggers' histograms, Ray's own recorder (the Cython object under `ray.util.metrics.Histogram`,
private API, called here only to measure) is timed with the same three tags resolved once, and with none:
what no change above Ray's recorder could save. All kinds run in one Ray worker, in rotating order, with
vLLM's own buckets and labels; the report gives the median [min, max] microseconds per observation over the
repeats and per-repeat ratios.

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


class _RayRecorder:
    """Ray's recorder under a ray.util.metrics Histogram, called with fixed tags (no merge, no checks)."""

    def __init__(self, histogram, tags: dict[str, str]):
        self._record = histogram._metric.record
        self._tags = tags

    def observe(self, value: float) -> None:
        self._record(value, tags=self._tags)


def measure(observations: int, repeats: int) -> dict[str, list[float]]:
    """Microseconds per observation of each kind, one value per repeat (runs in a Ray worker)."""
    import prometheus_client
    from ray.util.metrics import Histogram
    from vllm.v1.metrics.ray_wrappers import RayHistogramWrapper

    labels = ["model_name", "engine"]
    ray_hist = RayHistogramWrapper(
        "vllm:bench_itl_seconds", "bench", labelnames=labels, buckets=ITL_BUCKETS
    ).labels("m", "0")
    untagged = Histogram("bench_itl_untagged_seconds", "bench", boundaries=ITL_BUCKETS)
    kinds = {
        "ray": ray_hist,
        "ray_recorder_3_tags": _RayRecorder(ray_hist.metric, dict(ray_hist._tags)),
        "ray_recorder_no_tags": _RayRecorder(untagged, {}),
        "prometheus_client": prometheus_client.Histogram(
            "bench_itl_seconds", "bench", labels, buckets=ITL_BUCKETS
        ).labels("m", "0"),
    }
    names = list(kinds)
    out: dict[str, list[float]] = {k: [] for k in kinds}
    for r in range(repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:  # each kind first in turn
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

    def paired(a: str, b: str) -> dict[str, float]:
        return spread([x / y for x, y in zip(per_repeat[a], per_repeat[b], strict=True)])

    return {
        "machine": describe(),
        "versions": {"vllm": vllm.__version__, "ray": ray.__version__},
        "observations_per_repeat": args.observations,
        "repeats": args.repeats,
        "us_per_observation": {k: spread(v) for k, v in per_repeat.items()},
        "ratio_ray_to_prometheus_client": paired("ray", "prometheus_client"),
        "ratio_recorder_3_tags_to_ray": paired("ray_recorder_3_tags", "ray"),
        "ratio_recorder_3_tags_to_prometheus_client": paired("ray_recorder_3_tags", "prometheus_client"),
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
            f"{r['repeats']} repeats of {r['observations_per_repeat']:,} observations each, the kinds in "
            "rotating order, in one Ray worker.",
            "",
            "| metric kind | us per observation, median [min, max] |",
            "|---|---:|",
            f"| Ray: vLLM's RayHistogramWrapper (headroom replicas) | {fmt(us['ray'])} |",
            f"| Ray's recorder alone, the same 3 tags resolved once | {fmt(us['ray_recorder_3_tags'])} |",
            f"| Ray's recorder alone, no tags | {fmt(us['ray_recorder_no_tags'])} |",
            f"| prometheus_client (`vllm serve`) | {fmt(us['prometheus_client'])} |",
            "",
            "| ratio, paired per repeat | median [min, max] |",
            "|---|---:|",
            f"| RayHistogramWrapper / prometheus_client | {fmt(r['ratio_ray_to_prometheus_client'])} |",
            f"| Ray's recorder, 3 tags / RayHistogramWrapper | {fmt(r['ratio_recorder_3_tags_to_ray'])} |",
            "| Ray's recorder, 3 tags / prometheus_client | "
            f"{fmt(r['ratio_recorder_3_tags_to_prometheus_client'])} |",
            "",
            "Ray's recorder alone, with the tags vLLM gives it, takes "
            f"{r['ratio_recorder_3_tags_to_ray']['median']:.0%} of the time of a whole observation: that "
            "share is below anything headroom or vLLM could change in Python.",
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
