"""The simulator against real GPUs: one trace replayed on a headroom deployment with the policy on (min 1,
max --max-replicas, one per GPU), and the simulator's prediction for the same arrivals and start-up time.

    python -m loadtests.gpu.autoscale_replay --out OUT [--max-replicas N] [--config ...] [--predict-only]

1. The trace: the --duration-s of the synthetic production-format trace (autoscale/scenarios.py) with the
   highest peak against its mean, peaking in its middle third, arrivals per 10 s as open-loop rate steps,
   scaled so its peak needs --peak-replicas (default 0.55 x --max-replicas, at least 0.9) replicas of the
   simulated capacity for --prompt-tokens/--max-tokens. With one GPU (max 1) nothing scales: the run then
   checks the simulator's latency model alone, one replica loaded up to 0.9 of its capacity.
2. The run: Ray Serve with the policy as configs/prod.yaml sets it (min 1, max --max-replicas); Locust's
   open-loop shape (loadtests/shapes.py: the same arrival schedule for the same seed) sends the requests,
   random prompts of --prompt-tokens and exactly --max-tokens output (ignore_eos); Serve's replica states
   are polled each second.
3. The comparison: TTFT attainment (requests with TTFT within slo.ttft_p95_ms, failures missed) and
   replica-seconds over the trace, measured and simulated on the same arrivals (workloads.arrival_times),
   with the configured start-up and with the start-up this run measured.

Writes autoscale_replay.json (first with the prediction alone, so a run cut short still leaves it) and
report.md. One 10-minute `device` call (`bash loadtests/gpu/run.sh replay`: max replicas = the machine's
GPUs; nvidia-h200-x2 for the policy to scale); with a cold compile cache the first replica takes ~4 minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from autoscale.calibration import EngineLimits, load_calibration
from autoscale.experiment import Deployment
from autoscale.inputs import PolicyConfig
from autoscale.scenarios import PRODUCTION_CSV, production_format_csv
from autoscale.sim import HeadroomPolicy, StaticPolicy, simulate
from autoscale.workload import RequestTrace, read_trace_csv
from loadtests import raw_stats, workloads
from loadtests.gpu.scale import APP, ReplicaWatch, autoscaler_log_lines, variant
from serve_app.config import HeadroomConfig, load_config_files
from serve_app.planning.from_config import cluster_spec, plan_config
from serve_app.serving.serve_options import apply_cluster_env

ROOT = Path(__file__).resolve().parents[2]
BIN_S = 10.0


def window_rates(duration_s: float) -> np.ndarray:
    """Arrivals per second in BIN_S bins over the trace window with the highest peak against its mean,
    among windows whose peak comes in their middle third (the policy sees the rise coming)."""
    if not PRODUCTION_CSV.exists():
        production_format_csv()
    rates = read_trace_csv(PRODUCTION_CSV).rate_per_bin(BIN_S)
    n = int(duration_s // BIN_S)

    def score(i: int) -> float:
        w = rates[i : i + n]
        return float(w.max() / w.mean()) if n / 3 <= int(np.argmax(w)) < 2 * n / 3 else 0.0

    best = max(range(len(rates) - n), key=score)
    return rates[best : best + n]


def one_replica_capacity(dep: Deployment, prompt: int, output: int) -> float:
    """Highest rate (0.5 rps steps) one simulated replica serves with 99% of TTFTs within the target."""
    rate = 1.0
    while True:
        trace = fixed_trace(list(np.arange(0.0, 120.0, 1.0 / (rate + 0.5))), prompt, output, 120.0)
        r = simulate(trace, StaticPolicy(1), dep.setup(0, 1))
        if r.attainment < 0.99:
            return rate
        rate += 0.5


def fixed_trace(arrivals: list[float], prompt: int, output: int, duration_s: float) -> RequestTrace:
    n = len(arrivals)
    return RequestTrace("replay", np.array(arrivals), np.full(n, prompt), np.full(n, output), duration_s)


def steps_spec(rates: np.ndarray) -> str:
    return ",".join(f"{r:.2f}:{BIN_S:g}" for r in rates)


def predict(
    dep: Deployment, arrivals: list[float], args: argparse.Namespace, startup_s: float
) -> dict[str, Any]:
    trace = fixed_trace(arrivals, args.prompt_tokens, args.max_tokens, args.duration_s)
    config = PolicyConfig(dep.settings, dep.ttft_target_ms, dep.limits.max_num_seqs)
    result = simulate(trace, HeadroomPolicy(config), dep.setup(args.seed, 1, startup_s=startup_s))
    return {
        "startup_s": startup_s,
        "attainment": result.attainment,
        "replica_seconds": result.replica_hours * 3600,
        "scale_events": [(e.t_s, e.from_replicas, e.to_replicas, e.code) for e in result.events],
    }


def deployment_for(cfg: HeadroomConfig) -> Deployment:
    """The simulator's view of the GPU config: its plan's limits, the calibration, its policy settings."""
    assert cfg.deployment.autoscaling is not None
    plan = plan_config(cfg, cluster_spec(cfg, gpus_per_node=2))
    limits = EngineLimits(
        plan.max_num_seqs,
        plan.max_num_batched_tokens,
        plan.kv_cache_tokens_per_replica,
        cfg.deployment.max_ongoing_requests,
    )
    return Deployment(
        cfg.deployment.autoscaling, cfg.slo.ttft_p95_ms, limits, load_calibration().cost, "default"
    )


def replay_config(base: HeadroomConfig, max_replicas: int) -> HeadroomConfig:
    prod = load_config_files(ROOT / "configs/base.yaml", ROOT / "configs/prod.yaml").deployment.autoscaling
    assert prod is not None
    settings = {
        **prod.model_dump(mode="json"),
        "min_replicas": 1,
        "max_replicas": max_replicas,
        "initial_replicas": None,
    }
    return variant(base, {"name": APP, "deployment": {"num_replicas": None, "autoscaling": settings}})


def locust(
    url: str, model: str, steps: str, args: argparse.Namespace, raw: Path
) -> subprocess.CompletedProcess[bytes]:
    cmd = [
        sys.executable,
        "-m",
        "locust",
        "-f",
        "loadtests/locustfile.py",
        "--headless",
        "--only-summary",
        "--host",
        url,
        "--model",
        model,
        "--api",
        "completions",
        "--profile",
        "random",
        "--input-tokens",
        str(args.prompt_tokens),
        "--max-tokens",
        str(args.max_tokens),
        "--tokens-per-word",
        "auto",
        "--arrival-rate",
        steps,
        "--max-in-flight",
        "1024",
        "--seed",
        str(args.seed),
        "--raw-file",
        str(raw),
        "-t",
        f"{int(args.duration_s + 120)}s",
    ]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, timeout=args.duration_s + 240)


def measured(
    records: list[dict[str, Any]],
    samples: list[tuple[float, dict[str, int]]],
    load_t0: float,
    args: argparse.Namespace,
    target_ms: float,
) -> dict[str, Any]:
    ok = [r for r in records if raw_stats.is_success(r) and r.get("ttft_s") is not None]
    under = sum(1 for r in ok if r["ttft_s"] * 1000 <= target_ms)
    in_window = [s for t, s in samples if load_t0 <= t < load_t0 + args.duration_s]
    alive = [sum(v for k, v in s.items() if k != "poll_error") for s in in_window]
    asked = next(
        (t for t, s in samples if t >= load_t0 and sum(v for k, v in s.items() if k != "poll_error") >= 2),
        None,
    )
    running = next((t for t, s in samples if t >= load_t0 and s.get("RUNNING", 0) >= 2), None)
    return {
        "requests": len(records),
        "failed": len(records) - len(ok),
        # No request recorded is a failed measurement, not 100%: None, and the report says so.
        "attainment": under / len(records) if records else None,
        "replica_seconds": float(sum(alive)),
        "second_replica_asked_s": None if asked is None else asked - load_t0,
        "second_replica_running_s": None if running is None else running - load_t0,
        "startup_s": None if asked is None or running is None else running - asked,
        "late_fraction": raw_stats.summarize(records).get("late_fraction") if records else None,
    }


def run_on_gpus(cfg: HeadroomConfig, steps: str, args: argparse.Namespace) -> dict[str, Any]:
    import ray
    from ray import serve

    from serve_app.serving.deployment import build_from_config
    from serve_app.serving.driver import init_ray_driver

    apply_cluster_env(os.environ)
    init_ray_driver(logging_level="WARNING", log_to_driver=False)  # Locust's exit code counts
    serve.start(http_options={"host": "127.0.0.1", "port": 8000})
    raw = args.out / "raw.jsonl"
    try:
        t0 = time.monotonic()
        watch = ReplicaWatch(t0)
        watch.start()
        serve.run(build_from_config(cfg), name=APP, route_prefix="/")
        ready_s = time.monotonic() - t0
        load_t0 = time.monotonic() - t0
        proc = locust("http://127.0.0.1:8000", cfg.served_model_name, steps, args, raw)
        watch.stop()
        records = raw_stats.load_records(raw) if raw.exists() else []
        out = measured(records, watch.samples, load_t0, args, cfg.slo.ttft_p95_ms)
        out.update(first_replica_ready_s=ready_s, locust_rc=proc.returncode, replica_states=watch.samples)
        out["locust_tail"] = proc.stderr.decode(errors="replace")[-2000:]
        out["autoscaler_log"] = autoscaler_log_lines()
        return out
    finally:
        serve.shutdown()
        ray.shutdown()


def _percent(value: float | None) -> str:
    return "not measured" if value is None else f"{value:.2%}"


def report(result: dict[str, Any]) -> str:
    m, p, q = (
        result["measured"],
        result["predicted_configured_startup"],
        result.get("predicted_measured_startup"),
    )
    rows = [("measured on the GPUs", m), ("simulated, configured start-up", p)] + (
        [("simulated, measured start-up", q)] if q else []
    )
    lines = [
        "# Autoscaling replay: simulator against H200s",
        "",
        f"Trace: {result['trace']}. Policy: configs/prod.yaml's settings, min 1 / max "
        f"{result['max_replicas']} replicas; "
        f"TTFT target {result['ttft_target_ms']:.0f} ms. Command: `{result['command']}`.",
        "",
        "| | TTFT within target | replica-seconds | start-up s |",
        "|---|---:|---:|---:|",
        *[
            f"| {name} | {_percent(r['attainment'])} | {r['replica_seconds']:.0f} | "
            f"{r.get('startup_s') or '-'} |"
            for name, r in rows
        ],
        "",
        "Attainment difference (simulated at the measured start-up minus measured): "
        + (
            f"{result['attainment_gap_pp']} pp (target: within 2 pp)."
            if result["attainment_gap_pp"] is not None
            else "not measured: the load generator recorded no request (see locust_tail in the JSON)."
        ),
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", nargs="+", default=["configs/base.yaml", "loadtests/gpu/qwen3-8b.yaml"])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--duration-s", type=float, default=240.0)
    ap.add_argument("--prompt-tokens", type=int, default=1024)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--max-replicas", type=int, default=2, help="the policy's bound: one replica per GPU")
    ap.add_argument(
        "--peak-replicas",
        type=float,
        default=None,
        help="the trace's peak in simulated replicas; default 0.55 x max, at least 0.9",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--predict-only", action="store_true", help="no GPUs: the trace and the prediction")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.max_replicas < 1:
        ap.error(f"--max-replicas must be at least 1, got {args.max_replicas}")
    peak_replicas = max(0.9, 0.55 * args.max_replicas) if args.peak_replicas is None else args.peak_replicas
    cfg = replay_config(load_config_files(*args.config), args.max_replicas)
    dep = deployment_for(cfg)
    rates = window_rates(args.duration_s)
    capacity = one_replica_capacity(dep, args.prompt_tokens, args.max_tokens)
    rates = rates * (peak_replicas * capacity / rates.max())
    steps = steps_spec(rates)
    arrivals = [a.at_s for a in workloads.arrival_times(workloads.parse_steps(steps), seed=args.seed)]
    result: dict[str, Any] = {
        "command": " ".join(["python -m loadtests.gpu.autoscale_replay", *sys.argv[1:]]),
        "trace": f"{args.duration_s:.0f} s of the SYNTHETIC production-format trace, {len(arrivals)} "
        f"requests of {args.prompt_tokens}/{args.max_tokens} tokens, peak {rates.max():.1f} rps (one "
        f"simulated replica: {capacity:.1f})",
        "ttft_target_ms": dep.ttft_target_ms,
        "max_replicas": args.max_replicas,
        "arrival_rate_steps": steps,
        "predicted_configured_startup": predict(dep, arrivals, args, dep.settings.replica_startup_s),
    }
    (args.out / "autoscale_replay.json").write_text(json.dumps(result, indent=2, default=str))
    if not args.predict_only:
        result["measured"] = run_on_gpus(cfg, steps, args)
        startup = result["measured"]["startup_s"]
        if startup is not None:
            result["predicted_measured_startup"] = predict(dep, arrivals, args, startup)
        sim = result.get("predicted_measured_startup", result["predicted_configured_startup"])
        got = result["measured"]["attainment"]
        result["attainment_gap_pp"] = None if got is None else round(100 * (sim["attainment"] - got), 2)
        (args.out / "report.md").write_text(report(result))
        (args.out / "autoscale_replay.json").write_text(json.dumps(result, indent=2, default=str))
    print(json.dumps({k: v for k, v in result.items() if k != "measured"}, indent=2, default=str)[:3000])


if __name__ == "__main__":
    main()
