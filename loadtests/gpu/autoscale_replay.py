"""The simulator against real GPUs: one trace replayed on a headroom deployment with the policy on (min 1,
max --max-replicas, one per GPU), and the simulator's prediction for the same arrivals and start-up time.

    python -m loadtests.gpu.autoscale_replay --out OUT [--max-replicas N] [--config ...] [--predict-only]

1. The calibration (`--calibrate-at`, on by default): once the first replica serves, `vllm bench serve`
   closed loops at a few concurrencies (random --prompt-tokens/--max-tokens, EOS ignored); the simulator's
   step costs are fitted to the replica's step log during them (autoscale/step_log.py) and its request
   overhead to their TTFT (autoscale/calibrate.py), so the prediction is for this machine's GPU, not the
   committed calibration's (which is also reported, for the same arrivals).
2. The trace: the --duration-s of the synthetic production-format trace (autoscale/scenarios.py) with the
   highest peak against its mean, peaking in its middle third, arrivals per 10 s as open-loop rate steps,
   scaled so its peak needs --peak-replicas (default 0.55 x --max-replicas, at least 0.9) replicas of the
   simulated capacity for --prompt-tokens/--max-tokens. With one GPU (max 1) nothing scales: the run then
   checks the simulator's latency model alone, and several --peak-replicas (e.g. 0.9 1.2 1.5) replay the
   window one after another on the same replica, below and beyond its simulated capacity.
3. The run: Ray Serve with the policy as configs/prod.yaml sets it (min 1, max --max-replicas); Locust's
   open-loop shape (loadtests/shapes.py: the same arrival schedule for the same seed) sends the requests,
   random prompts of --prompt-tokens (words per token measured with the server's /tokenize) and exactly
   --max-tokens output (ignore_eos), no retries; Serve's replica states are polled each second.
4. The comparison: TTFT attainment (requests with TTFT within slo.ttft_p95_ms, failures missed) and
   replica-seconds over the trace, measured and simulated on the same arrivals (workloads.arrival_times),
   with the configured start-up and with the start-up this run measured.

Writes autoscale_replay.json (first with the prediction alone, so a run cut short still leaves it),
report.md, and the engine steps vLLM timed during each calibration loop and each replay
(calibration/steps_cK.json, steps_K.json: the replica's step log, one replica's when there are several).
`bash loadtests/gpu/run.sh replay` (max replicas = the machine's GPUs; nvidia-h200-x2 or larger for the
policy to scale); with a cold compile cache the first replica takes ~4 minutes, so run it detached
(`run.sh start replay`, then `wait`).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shlex
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from autoscale.calibrate import Point, fit, fit_to_step_logs, point_from_vllm_bench_result
from autoscale.experiment import Deployment, deployment_from
from autoscale.inputs import PolicyConfig
from autoscale.scenarios import PRODUCTION_CSV, production_format_csv
from autoscale.sim import HeadroomPolicy, StaticPolicy, simulate, ttft_bins
from autoscale.workload import RequestTrace, read_trace_csv
from loadtests import raw_stats, vllm_bench, workloads
from loadtests.autoscale_inputs import inputs_of
from loadtests.gpu.scale import APP, ReplicaWatch, autoscaler_log_lines, variant
from serve_app.config import HeadroomConfig, load_config_files
from serve_app.serving.serve_options import apply_cluster_env

ROOT = Path(__file__).resolve().parents[2]
BIN_S = 10.0
FITTED = "fitted to this run's vllm bench serve closed loops"
URL = "http://127.0.0.1:8000"


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
    """Highest rate on a 0.5 rps grid (from 1) at which one simulated replica keeps 99% of TTFTs within
    the target over 120 s; found by doubling, then bisection (attainment falls as the rate grows)."""

    def holds(rate: float) -> bool:
        trace = fixed_trace(list(np.arange(0.0, 120.0, 1.0 / rate)), prompt, output, 120.0)
        return simulate(trace, StaticPolicy(1), dep.setup(0, 1)).attainment >= 0.99

    lo, hi = 2, 4  # in half requests per second: lo holds (or is the floor), hi does not
    while holds(hi / 2):
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if holds(mid / 2) else (lo, mid)
    return lo / 2


def fixed_trace(arrivals: list[float], prompt: int, output: int, duration_s: float) -> RequestTrace:
    n = len(arrivals)
    return RequestTrace("replay", np.array(arrivals), np.full(n, prompt), np.full(n, output), duration_s)


def steps_spec(rates: np.ndarray) -> str:
    return ",".join(f"{r:.2f}:{BIN_S:g}" for r in rates)


@dataclass(frozen=True)
class Load:
    """The trace window scaled to the deployment's simulated capacity, as Locust's rate steps."""

    capacity_rps: float
    peak_rps: float
    steps: str
    arrivals: list[float]

    @classmethod
    def scaled(
        cls, dep: Deployment, window: np.ndarray, peak_replicas: float, args: argparse.Namespace
    ) -> Load:
        capacity = one_replica_capacity(dep, args.prompt_tokens, args.max_tokens)
        rates = window * (peak_replicas * capacity / window.max())
        steps = steps_spec(rates)
        arrivals = [a.at_s for a in workloads.arrival_times(workloads.parse_steps(steps), seed=args.seed)]
        return cls(capacity, float(rates.max()), steps, arrivals)

    def describe(self, args: argparse.Namespace) -> str:
        return (
            f"{args.duration_s:.0f} s of the SYNTHETIC production-format trace, {len(self.arrivals)} "
            f"requests of {args.prompt_tokens}/{args.max_tokens} tokens, peak {self.peak_rps:.1f} rps "
            f"(one simulated replica: {self.capacity_rps:.1f})"
        )


def predict(
    dep: Deployment, arrivals: list[float], args: argparse.Namespace, startup_s: float
) -> dict[str, Any]:
    trace = fixed_trace(arrivals, args.prompt_tokens, args.max_tokens, args.duration_s)
    config = PolicyConfig(dep.settings, dep.ttft_target_ms, dep.limits.max_num_seqs)
    result = simulate(
        trace,
        HeadroomPolicy(config),
        dep.setup(args.seed, 1, startup_s=startup_s),
        keep_timeline=True,
        timeline_bin_s=BIN_S,
    )
    assert result.timeline is not None
    return {
        "calibration": dep.calibration,
        "startup_s": startup_s,
        "attainment": result.attainment,
        "replica_seconds": result.replica_hours * 3600,
        "scale_events": [(e.t_s, e.from_replicas, e.to_replicas, e.code) for e in result.events],
        "timeline": {k: result.timeline[k] for k in ("ttft_p95_ms", "missed")},
    }


def deployment_for(cfg: HeadroomConfig, gpus: int) -> Deployment:
    """The simulator's view of the replay's config: its plan's limits and admission on one node of `gpus`
    GPUs (loadtests/autoscale_inputs.py, as the autoscaling benchmark gets them), the committed calibration.
    Locust sends a refused request once, so the simulated client does not retry either."""
    dep = deployment_from(inputs_of(cfg, gpus, 1, "the replay's config"))
    return replace(dep, admission=replace(dep.admission, client_retries=0))


def replay_config(base: HeadroomConfig, max_replicas: int) -> HeadroomConfig:
    prod = load_config_files(ROOT / "configs/base.yaml", ROOT / "configs/prod.yaml").deployment.autoscaling
    assert prod is not None
    settings = {
        **prod.model_dump(mode="json"),
        "min_replicas": 1,
        "max_replicas": max_replicas,
        "initial_replicas": None,
    }
    overlay = {
        "name": APP,
        "deployment": {"num_replicas": None, "autoscaling": settings},
        # Locust's --tokens-per-word auto measures the prompts with the server's /tokenize.
        "security": {"optional_routes": sorted({*base.security.optional_routes, "tokenize"})},
    }
    return variant(base, overlay)


def parse_cells(spec: str) -> list[tuple[int, int]]:
    """'C:N,...' (concurrency : prompts, both at least 1) as pairs; '' for none."""
    cells = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        c, _, n = part.partition(":")
        if not (c.isdigit() and n.isdigit() and int(c) >= 1 and int(n) >= 1):
            raise SystemExit(
                f"--calibrate-at {spec!r}: expected CONCURRENCY:PROMPTS,... with whole numbers >= 1, "
                "e.g. 1:16,64:320, or '' for none"
            )
        cells.append((int(c), int(n)))
    return cells


def calibrate(
    dep: Deployment, tokenizer: str, model: str, args: argparse.Namespace
) -> tuple[Deployment, dict[str, Any]]:
    """The costs fitted to closed loops on the serving replica (`vllm bench serve`) and to its step log
    during them (:func:`fitted`); the deployment with them, and the points with what the fit replays."""
    work = args.out / "calibration"
    work.mkdir(parents=True, exist_ok=True)
    shape = vllm_bench.Workload("replay", args.prompt_tokens, args.max_tokens)

    def bench(c: int, n: int, seed: int, name: str) -> dict[str, Any]:
        argv = vllm_bench.bench_args(URL, model, tokenizer, shape, c, n, seed, str(work), name)
        since = time.time()
        result = vllm_bench.run(argv)
        save_engine_steps(since, work / f"steps_{name}")
        return result

    bench(8, 16, args.seed + 100, "warmup.json")  # first requests of a fresh engine: not a point
    cells = parse_cells(args.calibrate_at)
    points = [
        point_from_vllm_bench_result(bench(c, n, args.seed + 101 + i, f"c{c}.json"), f"calibration/c{c}.json")
        for i, (c, n) in enumerate(cells)
    ]
    return fitted(dep, points, saved_step_logs(args.out, cells))


def save_engine_steps(since_s: float, path: Path) -> None:
    """The serving replica's engine steps since `since_s` and its KV cache's size (its step log,
    serve_app/serving/metrics.py), for fitting step costs to what vLLM itself timed; one replica's (the
    handle picks one)."""
    from ray import serve

    log = serve.get_app_handle(APP).engine_steps.remote(since_s).result(timeout_s=60)
    path.write_text(json.dumps(log))


def fitted(
    dep: Deployment, points: list[Point], step_logs: list[dict[str, Any]] | None = None
) -> tuple[Deployment, dict[str, Any]]:
    """`dep` with step costs fitted, and the points with what the fit gives. With the calibration loops'
    step logs, the step costs are fitted to them (autoscale/step_log.py) and the request overhead alone to
    the points, and the simulated engine gets the real one's KV cache (the plan's is for the config's GPU,
    not necessarily this one); without (runs before 2026-12-07's last three), every cost to the points,
    from `dep`'s."""
    if step_logs:
        cost, limits = fit_to_step_logs(points, dep.cost, dep.limits, step_logs)
    else:
        cost, limits = fit(points, dep.cost, dep.limits), dep.limits
    rows = [p.summary(cost, limits) for p in points]
    result = {"cost": asdict(cost), "points": rows, "committed_cost": asdict(dep.cost)}
    if step_logs:
        result["step_log_kv_cache_tokens"] = limits.kv_cache_tokens
    return replace(dep, cost=cost, limits=limits, calibration=FITTED), result


def saved_calibration_json(directory: Path, name: str) -> Any:
    """One file of a run's calibration, parsed: as the run wrote it (calibration/NAME), as run.sh brings it
    back (calibration_NAME), or as results keep it (calibration_NAME.gz); None where it is not there."""
    for path in (directory / "calibration" / name, directory / f"calibration_{name}"):
        if path.exists():
            return json.loads(path.read_bytes())
        gz = path.with_name(path.name + ".gz")
        if gz.exists():
            return json.loads(gzip.decompress(gz.read_bytes()))
    return None


def saved_step_logs(directory: Path, cells: list[tuple[int, int]]) -> list[dict[str, Any]] | None:
    """The step logs of a run's calibration loops; None where one is missing or was saved without the KV
    cache's size (the runs before it was saved)."""
    logs = [saved_calibration_json(directory, f"steps_c{c}.json") for c, _ in cells]
    return logs if all(isinstance(log, dict) for log in logs) else None


def saved_points(directory: Path, cells: list[tuple[int, int]]) -> list[Point] | None:
    """A run's calibration points from its saved `vllm bench serve` results; None if one is missing."""
    results = [saved_calibration_json(directory, f"c{c}.json") for c, _ in cells]
    if any(r is None for r in results):
        return None
    return [
        point_from_vllm_bench_result(r, f"calibration/c{c}.json")
        for r, (c, _) in zip(results, cells, strict=True)
    ]


def locust(model: str, steps: str, args: argparse.Namespace, raw: Path) -> subprocess.CompletedProcess[bytes]:
    cmd = [
        sys.executable,
        "-m",
        "locust",
        "-f",
        "loadtests/locustfile.py",
        "--headless",
        "--only-summary",
        "--host",
        URL,
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
    prompt_tokens = [r["prompt_tokens"] for r in ok if r.get("prompt_tokens")]
    return {
        "timeline": measured_timeline(records, target_ms, args.duration_s),
        "requests": len(records),
        "failed": len(records) - len(ok),
        # No request recorded is a failed measurement, not 100%: None, and the report says so.
        "attainment": under / len(records) if records else None,
        "prompt_tokens_mean": float(np.mean(prompt_tokens)) if prompt_tokens else None,
        "replica_seconds": float(sum(alive)),
        "second_replica_asked_s": None if asked is None else asked - load_t0,
        "second_replica_running_s": None if running is None else running - load_t0,
        "startup_s": None if asked is None or running is None else running - asked,
        "late_fraction": raw_stats.summarize(records).get("late_fraction") if records else None,
    }


def measured_timeline(records: list[dict[str, Any]], target_ms: float, duration_s: float) -> dict[str, Any]:
    """Per BIN_S of scheduled arrival, as the simulator's timeline: TTFT p95 (a failed request counted at
    the run's end, as the simulator counts an unserved one) and the requests that missed the target."""
    if not records:
        return {"ttft_p95_ms": [], "missed": []}
    t0 = min(r["scheduled_s"] for r in records)
    end_ms = (duration_s + 120.0) * 1000.0
    served = np.array([raw_stats.is_success(r) and r.get("ttft_s") is not None for r in records])
    ttft = np.array([r["ttft_s"] * 1000.0 if ok else end_ms for r, ok in zip(records, served, strict=True)])
    arrival = np.array([r["scheduled_s"] - t0 for r in records])
    return ttft_bins(arrival, ttft, served & (ttft <= target_ms), duration_s, BIN_S)


def run_on_gpus(
    cfg: HeadroomConfig, dep: Deployment, window: np.ndarray, args: argparse.Namespace, result: dict[str, Any]
) -> None:
    """Deploys, calibrates, then one replay per --peak-replicas on the same deployment, each planned and
    predicted (written at once) before it is measured: all into `result`."""
    import ray
    from ray import serve

    from serve_app.models.resolve import resolve_models
    from serve_app.serving.deployment import build_from_config
    from serve_app.serving.driver import init_ray_driver

    apply_cluster_env(os.environ)
    init_ray_driver(logging_level="WARNING", log_to_driver=False)  # Locust's exit code counts
    serve.start(http_options={"host": "127.0.0.1", "port": 8000})
    model = cfg.served_model_name
    try:
        t0 = time.monotonic()
        watch = ReplicaWatch(t0)
        watch.start()
        serve.run(build_from_config(cfg), name=APP, route_prefix="/")
        result["first_replica_ready_s"] = time.monotonic() - t0
        committed = None
        if parse_cells(args.calibrate_at):
            tokenizer = cfg.model.tokenizer or resolve_models(cfg).model_path
            committed, (dep, result["calibration"]) = dep, calibrate(dep, str(tokenizer), model, args)
        for i, peak in enumerate(args.peak_replicas):
            replay = plan_and_predict(dep, committed, window, peak, args)
            result["replays"].append(replay)
            write(result, args.out)
            raw = args.out / f"raw_{i}.jsonl"
            raw.unlink(missing_ok=True)
            load_t0 = time.monotonic() - t0
            since = time.time()
            proc = locust(model, replay["arrival_rate_steps"], args, raw)
            save_engine_steps(since, args.out / f"steps_{i}.json")
            records = raw_stats.load_records(raw) if raw.exists() else []
            out = measured(records, list(watch.samples), load_t0, args, cfg.slo.ttft_p95_ms)
            out.update(locust_rc=proc.returncode, locust_tail=proc.stderr.decode(errors="replace")[-2000:])
            replay["measured"] = out
            compare(dep, replay, args)
            write(result, args.out)
        watch.stop()
        result["replica_states"] = watch.samples
        result["autoscaler_log"] = autoscaler_log_lines()
    finally:
        serve.shutdown()
        ray.shutdown()


def plan_and_predict(
    dep: Deployment, committed: Deployment | None, window: np.ndarray, peak: float, args: argparse.Namespace
) -> dict[str, Any]:
    """One replay: the load scaled so its peak needs `peak` replicas of `dep`'s simulated capacity, and its
    prediction; with `committed` (dep was fitted here), that calibration's prediction for the same arrivals
    too. The arrivals ride along under a private key."""
    load = Load.scaled(dep, window, peak, args)
    startup = dep.settings.replica_startup_s
    replay: dict[str, Any] = {
        "peak_replicas": peak,
        "trace": load.describe(args),
        "arrival_rate_steps": load.steps,
        "predicted_configured_startup": predict(dep, load.arrivals, args, startup),
        "_arrivals": load.arrivals,
    }
    if committed is not None:
        replay["predicted_committed_calibration"] = predict(committed, load.arrivals, args, startup)
    return replay


def compare(dep: Deployment, replay: dict[str, Any], args: argparse.Namespace) -> None:
    """The prediction at the start-up this run measured (when a second replica came), and the gap."""
    arrivals = replay.pop("_arrivals")
    startup = replay["measured"]["startup_s"]
    if startup is not None:
        replay["predicted_measured_startup"] = predict(dep, arrivals, args, startup)
    sim = replay.get("predicted_measured_startup", replay["predicted_configured_startup"])
    got = replay["measured"]["attainment"]
    replay["attainment_gap_pp"] = None if got is None else round(100 * (sim["attainment"] - got), 2)


def public(v: Any) -> Any:
    """`v` without its private (underscore) keys, at every depth."""
    if isinstance(v, dict):
        return {k: public(x) for k, x in v.items() if not k.startswith("_")}
    return [public(x) for x in v] if isinstance(v, list) else v


def write(result: dict[str, Any], out: Path) -> None:
    (out / "autoscale_replay.json").write_text(json.dumps(public(result), indent=2, default=str))


def _percent(value: float | None) -> str:
    return "not measured" if value is None else f"{value:.2%}"


def significant(cost: dict[str, float]) -> dict[str, float]:
    """Step costs to four significant digits, as a report shows them: the fit's last digits differ
    between machines' floating-point libraries, and no one reads them."""
    return {name: float(f"{value:.4g}") for name, value in cost.items()}


def report(result: dict[str, Any]) -> str:
    lines = [
        "# Autoscaling replay: simulator against the GPUs",
        "",
        f"Policy: configs/prod.yaml's settings, min 1 / max {result['max_replicas']} replicas; TTFT target "
        f"{result['ttft_target_ms']:.0f} ms. Command: `{result['command']}`. First replica ready "
        f"{result.get('first_replica_ready_s', 0):.0f} s after the deployment was submitted.",
    ]
    for replay in result["replays"]:
        lines += ["", *replay_lines(replay)]
    cal = result.get("calibration")
    if cal:
        how = (
            "the step costs fitted to the replica's step log during the loops and its KV cache "
            f"({cal['step_log_kv_cache_tokens']:,} tokens) simulated, the request overhead fitted to their "
            "TTFT, from the"
            if "step_log_kv_cache_tokens" in cal
            else "fitted from the"
        )
        lines += [
            "",
            f"Calibration on this machine (`vllm bench serve` closed loops on the replica, {how} "
            f"committed step costs {significant(cal['committed_cost'])}): {significant(cal['cost'])}",
            "",
            "TTFT in the closed loop (the simulated loop does not fall into the real one's waves) and given "
            "the measured arrivals (what the fit matches), and TPOT given the arrivals (a check, not "
            "fitted), measured / simulated:",
            "",
            "| point | TTFT p50 ms, closed loop | TTFT p50 ms, given arrivals | TTFT p90 ms, given arrivals "
            "| TPOT p50 ms | TPOT p50 ms, given arrivals | output tok/s |",
            "|---|---|---|---|---|---|---|",
            *[calibration_row(p) for p in cal["points"]],
        ]
    return "\n".join(lines) + "\n"


def calibration_row(p: dict[str, Any]) -> str:
    sim, given = p["simulated"], p.get("given_arrivals")

    def pair(measured: float | None, simulated: float, fmt: str = ".0f") -> str:
        return "-" if measured is None else f"{measured:{fmt}} / {simulated:{fmt}}"

    def given_pair(metric: str, fmt: str = ".0f") -> str:
        if not given or metric not in given["measured"]:
            return "-"
        return pair(given["measured"][metric], given["simulated"][metric], fmt)

    return (
        f"| {p['label']} | {pair(p['ttft_p50_ms'], sim['ttft_p50_ms'])} | {given_pair('ttft_p50_ms')} | "
        f"{given_pair('ttft_p90_ms')} | {pair(p['tpot_p50_ms'], sim['tpot_p50_ms'], '.2f')} | "
        f"{given_pair('tpot_p50_ms', '.2f')} | {pair(p['output_tokens_per_s'], sim['output_tokens_per_s'])} |"
    )


def replay_lines(replay: dict[str, Any]) -> list[str]:
    m = replay.get("measured")
    rows = [
        ("measured on the GPUs", m),
        ("simulated, configured start-up", replay["predicted_configured_startup"]),
        ("simulated, measured start-up", replay.get("predicted_measured_startup")),
        ("simulated with the committed calibration", replay.get("predicted_committed_calibration")),
    ]
    gap = replay.get("attainment_gap_pp")
    return [
        f"## Peak at {replay['peak_replicas']:g} replicas of the simulated capacity",
        "",
        f"Trace: {replay['trace']}. "
        + (
            f"Measured: {m['requests']} requests, {m['failed']} failed, prompts "
            f"{m['prompt_tokens_mean'] or 0:.0f} tokens on average, {100 * (m['late_fraction'] or 0):.1f}% "
            "sent late by the client."
            if m
            else "Not measured (the run ended first)."
        ),
        "",
        "| | TTFT within target | replica-seconds | start-up s | calibration |",
        "|---|---:|---:|---:|---|",
        *[
            f"| {name} | {_percent(r['attainment'])} | {r['replica_seconds']:.0f} | "
            f"{r.get('startup_s') or '-'} | {r.get('calibration', '-')} |"
            for name, r in rows
            if r
        ],
        "",
        "Attainment difference (simulated at the measured start-up, else the configured one, minus "
        "measured): "
        + (
            f"{gap} pp (target: within 2 pp)."
            if gap is not None
            else "not measured: the load generator recorded no request (see locust_tail in the JSON)."
        ),
        *(timeline_lines(replay) if m and m.get("timeline", {}).get("missed") else []),
    ]


def _ms(value: float) -> str:
    """A timeline's TTFT: past 100 s it is the stand-in for a failed or unserved request."""
    return "failed" if value >= 100_000 else f"{value:.0f}"


def timeline_lines(replay: dict[str, Any]) -> list[str]:
    """Measured against simulated per BIN_S of arrivals (the simulated columns: configured start-up)."""
    m, sim = replay["measured"]["timeline"], replay["predicted_configured_startup"]["timeline"]
    rates = [step.value for step in workloads.parse_steps(replay["arrival_rate_steps"])]
    return [
        "",
        f"Per {BIN_S:g} s of arrivals: TTFT p95 ('failed' where the 95th percentile is a failed or unserved "
        "request) and the requests that missed the target, measured / simulated at the configured start-up.",
        "",
        "| from s | scheduled rps | TTFT p95 ms | missed |",
        "|---:|---:|---|---|",
        *[
            f"| {i * BIN_S:g} | {rate:.1f} | {_ms(m['ttft_p95_ms'][i])} / {_ms(sim['ttft_p95_ms'][i])} | "
            f"{m['missed'][i]} / {sim['missed'][i]} |"
            for i, rate in enumerate(rates)
            if i < min(len(m["missed"]), len(sim["missed"]))
        ],
    ]


def render(directory: Path) -> dict[str, Any]:
    """A run's result again from its files (autoscale_replay.json, raw_K.jsonl or raw_K.jsonl.gz, the
    calibration runs): the step costs fitted again to the run's calibration points (with this fit), each
    replay's measured timeline from its raw records and its predictions recomputed (deterministic) with
    the run's own arguments; the replica-seconds and start-up measured live are kept."""
    result: dict[str, Any] = json.loads((directory / "autoscale_replay.json").read_text())
    if "replays" not in result:
        raise SystemExit(
            f"{directory}: an early run's file, one replay without the per-peak 'replays' that --render "
            "reads; its report.md stays as written"
        )
    args = parser().parse_args(shlex.split(result["command"])[3:])
    cfg = replay_config(load_config_files(*args.config), args.max_replicas)
    committed = deployment_for(cfg, args.max_replicas)
    # The points the run fitted (not the flag's default now): their saved results.
    cells = [(q["concurrency"], q["requests"]) for q in result.get("calibration", {}).get("points", [])]
    points = saved_points(directory, cells) if cells else None
    if points:
        dep, result["calibration"] = fitted(committed, points, saved_step_logs(directory, cells))
    elif result.get("calibration"):
        raise SystemExit(f"{directory}: the run was calibrated, but its calibration results are not there")
    else:
        dep = committed
    cal = result.get("calibration")
    startup = dep.settings.replica_startup_s
    for k, replay in enumerate(result["replays"]):
        steps = workloads.parse_steps(replay["arrival_rate_steps"])
        arrivals = [a.at_s for a in workloads.arrival_times(steps, seed=args.seed)]
        replay["predicted_configured_startup"] = predict(dep, arrivals, args, startup)
        if cal:
            replay["predicted_committed_calibration"] = predict(committed, arrivals, args, startup)
        raws = [directory / f"raw_{k}.jsonl", directory / f"raw_{k}.jsonl.gz"]
        raw = next((path for path in raws if path.exists()), None)
        if raw is not None and "measured" in replay:
            records = raw_stats.load_records(raw)
            replay["measured"]["timeline"] = measured_timeline(records, dep.ttft_target_ms, args.duration_s)
            replay["_arrivals"] = arrivals
            compare(dep, replay, args)
    return result


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", nargs="+", default=["configs/base.yaml", "loadtests/gpu/qwen3-8b.yaml"])
    ap.add_argument("--out", type=Path, help="where the run's files go (required unless --render)")
    ap.add_argument("--duration-s", type=float, default=240.0)
    ap.add_argument("--prompt-tokens", type=int, default=1024)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--max-replicas", type=int, default=2, help="the policy's bound: one replica per GPU")
    ap.add_argument(
        "--peak-replicas",
        type=float,
        nargs="+",
        default=None,
        help="the trace's peak in simulated replicas, one replay each (several only with --max-replicas 1: "
        "a replay must start from one replica); default 0.55 x max, at least 0.9",
    )
    ap.add_argument(
        "--calibrate-at",
        default="1:16,16:128,64:320,128:384,256:768",
        help="closed loops CONCURRENCY:PROMPTS,... fitted on the replica before the replay; '' for the "
        "committed calibration",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--predict-only", action="store_true", help="no GPUs: the trace and the prediction")
    ap.add_argument(
        "--render", type=Path, metavar="DIR", help="a finished run's report again from DIR's files"
    )
    return ap


def main() -> None:
    ap = parser()
    args = ap.parse_args()
    if args.render is not None:
        if not (args.render / "autoscale_replay.json").is_file():
            ap.error(
                f"--render {args.render}: no autoscale_replay.json there (a replay run's --out directory)"
            )
        result = render(args.render)
        (args.render / "report.md").write_text(report(result))
        write(result, args.render)
        print(report(result))
        return
    if args.out is None:
        ap.error("--out is required (or --render DIR)")
    if args.max_replicas < 1:
        ap.error(f"--max-replicas must be at least 1, got {args.max_replicas}")
    if args.peak_replicas is None:
        args.peak_replicas = [max(0.9, 0.55 * args.max_replicas)]
    if len(args.peak_replicas) > 1 and args.max_replicas > 1:
        ap.error("--peak-replicas: several replays need --max-replicas 1 (each must start from one replica)")
    if min(args.peak_replicas) <= 0:
        ap.error(f"--peak-replicas must be > 0, got {args.peak_replicas}")
    parse_cells(args.calibrate_at)
    args.out.mkdir(parents=True, exist_ok=True)
    cfg = replay_config(load_config_files(*args.config), args.max_replicas)
    dep = deployment_for(cfg, args.max_replicas)
    window = window_rates(args.duration_s)
    result: dict[str, Any] = {
        "command": " ".join(["python -m loadtests.gpu.autoscale_replay", *sys.argv[1:]]),
        "ttft_target_ms": dep.ttft_target_ms,
        "max_replicas": args.max_replicas,
        "replays": [],
    }
    if args.predict_only:
        result["replays"] = [plan_and_predict(dep, None, window, p, args) for p in args.peak_replicas]
    else:
        run_on_gpus(cfg, dep, window, args, result)
        (args.out / "report.md").write_text(report(result))
    write(result, args.out)
    print(report(result) if not args.predict_only else json.dumps(public(result), indent=2, default=str))


if __name__ == "__main__":
    main()
