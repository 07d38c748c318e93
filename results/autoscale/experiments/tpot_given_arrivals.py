"""Should the calibration also fit TPOT given each request's real send time? (An experiment; not shipped.)

    python results/autoscale/experiments/tpot_given_arrivals.py \
        > results/autoscale/experiments/tpot_given_arrivals.txt

The H100 replay's calibration runs (results/gpu/2026-12-07/replay, c = 1/16/64/128, random 1024/128) are
fitted from the committed H200 calibration twice: as shipped (closed-loop TPOT fitted, TTFT p50/p90 given the
arrivals), and with the closed-loop TPOT replaced by TPOT given the arrivals. Both are then checked on bare
vLLM's closed loops on another H100 (2026-12-05, c=64 and c=128, three rounds each; half the GPU's memory,
compilation off), never fitted. Each row: simulated / measured for output tokens/s, TPOT p50 given the
arrivals (the simulated loop's own TPOT in brackets), TTFT p50 and p90 given the arrivals. The loss sums the
squared log ratios of all but the bracketed one.
"""

from __future__ import annotations

import math
import sys
import tarfile
import tempfile
from dataclasses import asdict, replace
from pathlib import Path

from autoscale.calibrate import ARRIVAL_FITTED, Point, fit, point_from_vllm_bench
from autoscale.calibration import EngineCost, EngineLimits, load_calibration

ROOT = Path(__file__).resolve().parents[3]
REPLAY = ROOT / "results/gpu/2026-12-07/replay"
HELD_OUT = ROOT / "results/gpu/2026-12-05/overhead-compile-off/overhead.tar.gz"
FIT_LIMITS = EngineLimits(256, 8192, 400_000, 100_000)  # the replica's KV cache never binds at c <= 128
HELD_LIMITS = EngineLimits(256, 8192, 137_264, 100_000)  # half the GPU's memory, as those runs had


def as_shipped(p: Point) -> Point:
    return p


def tpot_given_arrivals(p: Point) -> Point:
    return p if p.concurrency == 1 else replace(p, fit=("output_tokens_per_s",))


def check(label: str, points: list[Point], cost: EngineCost, limits: EngineLimits) -> float:
    print(label)
    total = 0.0
    for p in points:
        row = p.summary(cost, limits)  # its own loop, and given the arrivals (replayed once)
        sim, given = row["simulated"], row["given_arrivals"]["simulated"]
        measured = row["given_arrivals"]["measured"]
        ratios = [sim["output_tokens_per_s"] / p.output_tokens_per_s]
        ratios += [given[m] / measured[m] for m in ("tpot_p50_ms", "ttft_p50_ms", "ttft_p90_ms")]
        total += sum(math.log(r) ** 2 for r in ratios)
        print(
            f"  c={p.concurrency:3}  tok/s x{ratios[0]:.2f}  TPOT given arrivals x{ratios[1]:.2f} "
            f"(own loop x{sim['tpot_p50_ms'] / p.tpot_p50_ms:.2f})  TTFT p50 x{ratios[2]:.2f}  "
            f"p90 x{ratios[3]:.2f}"
        )
    print(f"  loss {total:.3f}")
    return total


def main() -> None:
    fitted = [point_from_vllm_bench(str(REPLAY / f"calibration_c{c}.json")) for c in (1, 16, 64, 128)]
    with tempfile.TemporaryDirectory() as tmp:
        with tarfile.open(HELD_OUT) as tar:
            tar.extractall(tmp, filter="data")
        held = [
            point_from_vllm_bench(f"{tmp}/overhead/raw/vllm-random-1024-c{c}-r{r}.json")
            for c in (64, 128)
            for r in (0, 1, 2)
        ]
    start = load_calibration().cost
    variants = (
        ("as shipped", as_shipped, ARRIVAL_FITTED),
        ("TPOT given arrivals fitted", tpot_given_arrivals, (*ARRIVAL_FITTED, "tpot_p50_ms")),
    )
    for name, variant, given_arrivals in variants:
        cost = fit([variant(p) for p in fitted], start, FIT_LIMITS, given_arrivals=given_arrivals)
        print(f"== {name}: {', '.join(f'{k} {v:.4g}' for k, v in asdict(cost).items())}")
        check("calibration runs (fitted)", fitted, cost, FIT_LIMITS)
        check("held out", held, cost, HELD_LIMITS)
        sys.stdout.flush()


if __name__ == "__main__":
    main()
