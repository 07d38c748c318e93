"""Does the benchmark's verdict hang on the engine it simulates? (An experiment; nothing shipped.)

    R=results/gpu/2026-12-07/replay-steps-kv-seed; python -m autoscale.calibrate \
        --vllm-bench $R{19,23,29}/calibration_c{1,16,64,128,256}.json \
        --steps $R{19,23,29}/calibration_steps_c{1,16,64,128,256}.json.gz \
        --max-num-seqs 256 --max-num-batched-tokens 8192 --name "Qwen3-8B shape, bf16, one H100 80GB \
        HBM3, vLLM 0.26.0, max_num_batched_tokens 8192, chunked prefill: step costs fitted to three \
        replays' step logs" --out results/autoscale/experiments/h100_engine/h100_qwen3_8b_steplog.json
    python results/autoscale/experiments/h100_engine.py \
        > results/autoscale/experiments/h100_engine/results.txt

(the closed loops of the three H100 replays that were calibrated by the step log before they ran,
twenty-second session of results/gpu/README.md; the name is one line.)

The benchmark simulates one H200 engine with the committed calibration (autoscale/data/h200_qwen3_8b.json,
a percentile fit to closed loops that one-H100 replays found unreliable: -25 to +23 points of attainment).
The step-log fit came within 2 points on most H100 replay windows, but only H100 replicas have been measured
so. This runs the benchmark's comparisons on the tuning seeds (1-2; the four synthetic shapes, not the
production-format trace, which is judged only) twice: with the committed H200 engine, and with one H100 engine
as the step log fits it (the three runs pooled) and the KV cache those runs logged. Per trace: the smallest
static fleet meeting 99%, headroom's shipped policy and Ray's default with the knobs the tuning chose (not
tuned again for the H100), their attainment and replica-hours, and the benchmark's targets for each.
"""

from __future__ import annotations

import json
from dataclasses import asdict, replace
from pathlib import Path

from autoscale.bench import check_targets, policies, summarize
from autoscale.calibration import load_calibration
from autoscale.experiment import Task, load_deployment, run_task, smallest_static
from autoscale.scenarios import SYNTHETIC_KINDS, TUNING_SEEDS, TraceSpec

HERE = Path(__file__).resolve().parent / "h100_engine"
H100_CALIBRATION = HERE / "h100_qwen3_8b_steplog.json"
H100_KV_CACHE_TOKENS = 396_720
"""The smallest KV cache the three runs' engines logged (396,720 and 400,400 tokens at 0.9 of an H100)."""


def engines():
    shipped = load_deployment()
    h100 = replace(
        shipped,
        cost=load_calibration(H100_CALIBRATION).cost,
        calibration=str(H100_CALIBRATION.relative_to(Path.cwd())),
        limits=replace(shipped.limits, kv_cache_tokens=H100_KV_CACHE_TOKENS),
    )
    return {"H200 (committed percentile fit)": shipped, "H100 (step-log fit, 3 runs pooled)": h100}


def main() -> None:
    """Per engine: the benchmark's own summary and target checks (autoscale/bench.py) on these runs."""
    tuning = json.loads(Path("results/autoscale/tuning.json").read_text())
    specs = [TraceSpec(kind, s) for kind in SYNTHETIC_KINDS for s in TUNING_SEEDS]
    for label, dep in engines().items():
        print(f"## {label}: {dep.calibration}, KV cache {dep.limits.kv_cache_tokens:,} tokens")
        print(f"   costs: {json.dumps(asdict(dep.cost))}")
        named = {k: v for k, v in policies(dep, tuning).items() if k in ("headroom", "ray-tuned")}
        statics = [smallest_static(sp, dep) for sp in specs]
        runs = [
            run_task(Task(sp, policy, st["initial_replicas"]), dep)
            for policy in named.values()
            for sp, st in zip(specs, statics, strict=True)
        ]
        summary = summarize({"static": statics, "runs": runs, "policies": named})
        for kind, entry in summary.items():
            print(f"- {kind}: static 99% fleets {entry['static_replicas']}")
            for name, row in entry["policies"].items():
                print(
                    f"    {name:10s} {row['attainment']:.2%} on time (worst seed "
                    f"{row['attainment_min']:.2%}), {row['replica_hours']:.1f} replica-h = "
                    f"{row['cost_ratio']:.3f}x static, max {row['max_direction_changes_per_10min']} "
                    "direction changes / 10 min"
                )
        for check in check_targets(summary):
            verdict = {True: "met", False: "MISSED", None: "no target"}[check.passed]
            print(f"  {check.trace}: {check.name}: {verdict} ({check.detail})", flush=True)


if __name__ == "__main__":
    main()
