"""On one node with two GPUs: the autoscaler under a step load, then one model as two single-GPU replicas
against one TP=2 replica on the same concurrency ladder, and the planner's choice between them.

    python -m loadtests.gpu.scale --out OUT [--config configs/base.yaml loadtests/gpu/qwen3-8b.yaml]

Phases, in order, each skipped when the time left (--budget-s) cannot hold it:
1. autoscale: an app with min 1 / max 2 replicas and the TTFT-headroom policy; a low load, then a step to a
   load one GPU cannot serve within the TTFT target. Records every request (send time, TTFT) and Serve's
   replica states each second: when TTFT p95 first breached the target, when the policy asked for the
   second replica, and when it was RUNNING (routable).
2. replicas: the same app, now at two replicas, on the concurrency ladder.
3. tp: the model as one TP=2 replica (a STRICT_PACK placement group of two GPUs) on the same ladder.
Finally the memory vLLM logged for every engine, against the planner's prediction. Writes scale.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from loadtests import engine_logs
from loadtests.machine import cluster_here
from loadtests.streaming_client import one_request, percentile, prompts, run_load
from serve_app.config import HeadroomConfig, deep_merge, load_config_files, parse_config
from serve_app.planning.from_config import plan_config
from serve_app.serving.serve_options import apply_cluster_env

APP = "scale"
DEPLOYMENT = "LLMServer"


def variant(cfg: HeadroomConfig, overlay: dict[str, Any]) -> HeadroomConfig:
    data = deep_merge(cfg.model_dump(mode="json"), overlay)
    return parse_config(data, source="loadtests.gpu.scale")


def autoscaling_variant(cfg: HeadroomConfig, ttft_target_ms: float) -> HeadroomConfig:
    return variant(
        cfg,
        {
            "name": APP,
            "slo": {"ttft_p95_ms": ttft_target_ms},
            "deployment": {
                "num_replicas": None,
                "autoscaling": {
                    "min_replicas": 1,
                    "max_replicas": 2,
                    "policy": "ttft_headroom",
                    "window_s": 10,
                    "replica_startup_s": 120,
                    "upscale_cooldown_s": 0,
                    # No scale-down inside this run: the replicas phase measures both replicas.
                    "downscale_sustain_s": 3600,
                },
            },
        },
    )


class ReplicaWatch(threading.Thread):
    """Serve's replica states for the app, once a second, as (seconds since t0, {state: count})."""

    def __init__(self, t0: float):
        super().__init__(daemon=True)
        self.t0, self.samples, self._done = t0, [], threading.Event()

    def run(self) -> None:
        from ray import serve

        while not self._done.wait(1.0):
            try:
                app = serve.status().applications.get(APP)
                states = dict(app.deployments[DEPLOYMENT].replica_states) if app else {}
            except Exception as err:  # noqa: BLE001 (a failed poll is recorded, the run goes on)
                states = {"poll_error": str(err)[:80]}
            self.samples.append((time.monotonic() - self.t0, {str(k): v for k, v in states.items()}))

    def stop(self) -> None:
        self._done.set()
        self.join()


async def step_load(
    url: str, model: str, phases: list[tuple[int, float]], prompt_words: int, max_tokens: int, t0: float,
    until: Any = None,
) -> list[dict[str, float]]:  # fmt: skip
    """Closed-loop streaming load in phases of (concurrency, seconds); the last phase also ends early once
    `until()` is true. Returns one record per request: send time (s since t0), TTFT, e2e, tokens, ok."""
    records: list[dict[str, float]] = []
    texts = prompts(4096, prompt_words)
    counter = iter(range(10**9))
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=1024)) as client:

        async def worker(stop_at: float, last: bool) -> None:
            while time.monotonic() < stop_at and not (last and until and until()):
                prompt = texts[next(counter) % len(texts)]
                sent = time.monotonic()
                try:
                    r = await one_request(client, url + "/v1/completions", model, prompt, max_tokens)
                    record = {"ttft_s": r.ttft_s, "e2e_s": r.e2e_s, "tokens": r.output_tokens, "ok": True}
                except httpx.HTTPError:
                    failed_after = time.monotonic() - sent
                    record = {"ttft_s": failed_after, "e2e_s": failed_after, "tokens": 0, "ok": False}
                records.append({"sent_s": sent - t0, **record})

        for index, (concurrency, seconds) in enumerate(phases):
            stop_at = time.monotonic() + seconds
            last = index == len(phases) - 1
            await asyncio.gather(*(worker(stop_at, last) for _ in range(concurrency)))
    return records


def rolling_p95(records: list[dict[str, float]], window_s: float) -> list[tuple[float, float]]:
    """TTFT p95 over the requests whose first token arrived in the trailing window, each second."""
    done = sorted((r["sent_s"] + r["ttft_s"], r["ttft_s"]) for r in records if r["ok"])
    if not done:
        return []
    out = []
    t = done[0][0]
    while t <= done[-1][0]:
        window = [ttft for at, ttft in done if t - window_s < at <= t]
        if window:
            out.append((t, percentile(window, 95)))
        t += 1.0
    return out


def first_time(samples: list[tuple[float, dict[str, int]]], predicate: Any, after: float) -> float | None:
    return next((t for t, states in samples if t >= after and predicate(states)), None)


def ladder(url: str, model: str, levels: list[int], per_worker: int, max_tokens: int) -> list[dict]:
    rows = []
    asyncio.run(run_load(url, model, 4, 8, max_tokens))  # warm-up
    for c in levels:
        summary, results = asyncio.run(run_load(url, model, c, c * per_worker, max_tokens))
        row = summary.as_dict()
        row["tpot_p99_ms"] = percentile([r.tpot_s for r in results if r.tpot_s is not None], 99) * 1000
        rows.append(row)
        print(f"  c={c}: {summary}", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", nargs="+", default=["configs/base.yaml", "loadtests/gpu/qwen3-8b.yaml"])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--ttft-target-ms", type=float, default=500)
    parser.add_argument("--low", default="4:30", help="users:seconds before the step")
    parser.add_argument("--high", default="96:240", help="users:longest seconds of the step")
    parser.add_argument("--after-scale-s", type=float, default=30, help="load kept on once both serve")
    parser.add_argument("--prompt-words", type=int, default=2000, help="about one token per word")
    parser.add_argument("--levels", type=int, nargs="+", default=[1, 16, 64, 128])
    parser.add_argument("--requests-per-worker", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--phases", nargs="+", default=["autoscale", "replicas", "tp"])
    parser.add_argument("--budget-s", type=float, default=560)
    args = parser.parse_args()
    started = time.monotonic()
    args.out.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}, "phases": {}}

    def save() -> None:
        (args.out / "scale.json").write_text(json.dumps(result, indent=2, default=str))

    def left() -> float:
        return args.budget_s - (time.monotonic() - started)

    base = load_config_files(*args.config)
    cfg_auto = autoscaling_variant(base, args.ttft_target_ms)
    gpu = base.resources.accelerator == "gpu"
    predictions: dict[str, dict[str, float]] = {}
    if gpu:
        tp2 = {"name": APP, "engine": {"tensor_parallel_size": 2}, "deployment": {"num_replicas": 1}}
        cfg_tp = variant(base, tp2)
        two_gpus, result["planned_for"] = cluster_here(base, gpus_per_node=2)
        # What the planner chooses for this model and SLO on two GPUs, and its estimates for both layouts.
        free_choice = plan_config(variant(base, {"deployment": {"num_replicas": None}}), two_gpus)
        plans = {
            "TP=1": plan_config(variant(base, {"engine": {"tensor_parallel_size": 1}}), two_gpus),
            "TP=2": plan_config(cfg_tp, two_gpus),
        }
        result["planner"] = {
            "choice": {"tensor_parallel_size": free_choice.tensor_parallel_size,
                       "replicas": free_choice.replicas, "reasons": list(free_choice.reasons)},
            **{name: p.to_json() for name, p in plans.items()},
            "slo": base.slo.model_dump(mode="json"),
        }  # fmt: skip
        predictions = {name: engine_logs.expected_memory(p) for name, p in plans.items()}

    import ray
    from ray import serve

    from serve_app.serving.deployment import build_from_config
    from serve_app.serving.driver import init_ray_driver

    apply_cluster_env(os.environ)
    init_ray_driver(num_cpus=None if gpu else 8, logging_level="WARNING", log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": 8000})
    url = "http://127.0.0.1:8000"
    model = base.served_model_name
    try:
        if "autoscale" in args.phases:
            t0 = time.monotonic()
            watch = ReplicaWatch(t0)
            watch.start()
            serve.run(build_from_config(cfg_auto), name=APP, route_prefix="/")
            ready = time.monotonic() - t0
            print(f"autoscale app ready in {ready:.0f}s", flush=True)
            low_c, low_s = (float(x) for x in args.low.split(":"))
            high_c, high_s = (float(x) for x in args.high.split(":"))
            high_s = min(high_s, left() - 200)  # keep time for the other phases
            both_at: list[float] = []

            def both_running() -> bool:
                running = watch.samples[-1][1].get("RUNNING", 0) if watch.samples else 0
                if running >= 2 and not both_at:
                    both_at.append(time.monotonic())
                return bool(both_at) and time.monotonic() - both_at[0] >= args.after_scale_s

            load_t0 = time.monotonic()
            records = asyncio.run(
                step_load(url, model, [(int(low_c), low_s), (int(high_c), high_s)], args.prompt_words,
                          64, t0, until=both_running)
            )  # fmt: skip
            watch.stop()
            step_at = load_t0 - t0 + low_s
            p95 = rolling_p95(records, cfg_auto.deployment.autoscaling.window_s)
            breach = next((t for t, v in p95 if t >= step_at and v * 1000 > args.ttft_target_ms), None)
            asked = first_time(watch.samples, lambda s: sum(v for k, v in s.items() if k != "RUNNING") > 0
                               or s.get("RUNNING", 0) >= 2, step_at)  # fmt: skip
            serving = first_time(watch.samples, lambda s: s.get("RUNNING", 0) >= 2, step_at)
            result["phases"]["autoscale"] = {
                "first_replica_ready_s": ready,
                "step_at_s": step_at,
                "ttft_target_ms": args.ttft_target_ms,
                "ttft_p95_breach_at_s": breach,
                "second_replica_requested_at_s": asked,
                "second_replica_running_at_s": serving,
                "breach_to_second_replica_serving_s": (serving - breach) if breach and serving else None,
                "replica_states": watch.samples,
                "rolling_ttft_p95_s": p95,
                "requests": records,
            }
            save()
            print(f"breach at {breach}, second replica asked {asked}, running {serving}", flush=True)

        if "replicas" in args.phases and left() > 60:
            running = serve.status().applications.get(APP)
            n = running.deployments[DEPLOYMENT].replica_states.get("RUNNING", 0) if running else 0
            if n < 2:
                serve.run(build_from_config(variant(base, {"name": APP, "deployment": {"num_replicas": 2}})),
                          name=APP, route_prefix="/")  # fmt: skip
            print("two single-GPU replicas:", flush=True)
            result["phases"]["replicas"] = {
                "ladder": ladder(url, model, args.levels, args.requests_per_worker, args.max_tokens)
            }
            save()

        if "tp" in args.phases and gpu and left() > 150:
            serve.delete(APP)
            t = time.monotonic()
            serve.run(build_from_config(cfg_tp), name=APP, route_prefix="/")
            tp_ready = time.monotonic() - t
            print(f"TP=2 replica ready in {tp_ready:.0f}s", flush=True)
            result["phases"]["tp"] = {
                "ready_s": tp_ready,
                "ladder": ladder(url, model, args.levels, args.requests_per_worker, args.max_tokens),
            }
            save()
    finally:
        engines = engine_logs.parse(engine_logs.ray_session_logs(), "headroom replica")
        result["memory"] = engine_logs.compare_each(predictions, engines) if gpu else []
        result["autoscaler_log"] = autoscaler_log_lines()
        save()
        serve.shutdown()
        ray.shutdown()


def autoscaler_log_lines(session_dir: Path = Path("/tmp/ray/session_latest")) -> list[str]:
    lines = []
    for path in sorted((session_dir / "logs" / "serve").glob("controller_*.log")):
        lines += [ln for ln in path.read_text(errors="replace").splitlines() if "headroom autoscaler" in ln]
    return lines[-200:]


if __name__ == "__main__":
    main()
