"""What the replica's security layer (serving/asgi.py: routes, API keys, body limits, bounded queue) costs
per request, measured two ways in one run; writes JSON and a Markdown table.

1. In-process, no Ray or engine: the layer in front of a stand-in app that reads the body and answers,
   against the layer as it was before it guarded anything (serving/asgi.py at git `--base`, loaded from
   `git show`) and against the stand-in alone, for three body sizes; microseconds per request, median of
   `--repeats` repeats with their spread.
2. End to end (`--e2e`): one Ray cluster serving the same engine config twice, `guarded` (two API keys,
   every limit, the bounded queue) and `open` (no keys, no token limits, no queue), TTFT p50 of streamed
   completions at concurrency 1, the two apps alternating round by round.
3. Overload (`--overload`): two replicas of max_num_seqs 4 at 4x their safe concurrency (the drill of
   tests/integration/test_security_overload.py), `--overload-repeats` times per `--queue-fractions`: TTFT
   of admitted requests against TTFT at safe concurrency (p50 and p99, and their ratios per drill), and
   refusal latency at the client and at the replica.

    python -m loadtests.bench_security --e2e --overload --out results/security
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path

import httpx

from loadtests.machine import describe
from loadtests.streaming_client import one_request, percentile
from serve_app.config import deep_merge, load_env_config, parse_config
from serve_app.config.security import APIKeysSource, RequestLimits, SecuritySection

KEYS = ["bench-key-one-0123456789abcdef", "bench-key-two-0123456789abcdef"]
KEYS_ENV = "HEADROOM_BENCH_API_KEYS"
GUARDED = SecuritySection(
    api_keys=APIKeysSource(env=KEYS_ENV),
    limits=RequestLimits(max_n=4, max_tokens=256, max_prompt_tokens=1900, max_logprobs=5),
)
BODIES = {  # prompt words ~ tokens for the tiny model's tokenizer
    "chat, 10 words": {
        "model": "m",
        "messages": [{"role": "user", "content": "hello " * 10}],
        "max_tokens": 16,
    },
    "completion, 1024 words": {"model": "m", "prompt": "token " * 1024, "max_tokens": 16, "stream": True},
    "completion, 8192 words": {"model": "m", "prompt": "token " * 8192, "max_tokens": 16, "stream": True},
}


class StandIn:
    """The app behind the layer: reads the body, answers 200."""

    async def __call__(self, scope, receive, send):
        message = await receive()
        while message.get("more_body"):
            message = await receive()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})


def layer_at(base: str):
    """serving/asgi.py as it is at git `base`, as a module."""
    source = subprocess.run(
        ["git", "show", f"{base}:serve_app/serving/asgi.py"], capture_output=True, text=True, check=True
    ).stdout
    module = types.ModuleType("asgi_at_base")
    exec(compile(source, f"{base}:serve_app/serving/asgi.py", "exec"), module.__dict__)
    return module


async def per_request_us(app, body: bytes, n: int) -> float:
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"authorization", f"Bearer {KEYS[1]}".encode()),
    ]
    scope = {
        "type": "http",
        "method": "POST",
        "path": "/v1/completions",
        "root_path": "",
        "headers": headers,
        "query_string": b"",
    }
    message = {"type": "http.request", "body": body, "more_body": False}

    async def receive():
        return message

    async def send(_):
        pass

    start = time.perf_counter()
    for _ in range(n):
        await app(dict(scope), receive, send)
    return (time.perf_counter() - start) / n * 1e6


def microbench(base: str, n: int, repeats: int) -> list[dict]:
    from autoscale.replica_stats import ReplicaStatsWindow
    from serve_app.serving.asgi import ReplicaASGI
    from serve_app.serving.metrics import ServingMetrics

    old = layer_at(base)
    metrics = ServingMetrics({"application": "bench"}, ReplicaStatsWindow(30))
    # The old layer looks routes up in the app's router; give the stand-in one that matches everything.
    stand_in = StandIn()
    stand_in.router = types.SimpleNamespace(
        routes=[types.SimpleNamespace(matches=lambda s: (old.Match.FULL, {}))]
    )
    apps = {
        "stand-in alone": stand_in,
        f"layer at {base}": old.ReplicaASGI(stand_in, metrics),
        "layer, no keys, no queue": ReplicaASGI(stand_in, metrics, SecuritySection(overload=None)),
        "layer, 2 keys, limits, queue": ReplicaASGI(stand_in, metrics, GUARDED, KEYS, admission_bound=40),
    }
    rows = []
    for name, payload in BODIES.items():
        body = json.dumps(payload).encode()
        row: dict = {"body": name, "body_bytes": len(body)}
        runs: dict[str, list[float]] = {label: [] for label in apps}
        for app in apps.values():
            asyncio.run(per_request_us(app, body, n // 10))  # warm-up
        for _ in range(repeats):  # the variants take turns, so the machine's noise lands on all of them
            for label, app in apps.items():
                runs[label].append(asyncio.run(per_request_us(app, body, n)))
        for label, values in runs.items():
            row[label] = {
                "median_us": statistics.median(values),
                "min_us": min(values),
                "max_us": max(values),
            }
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def e2e(rounds: int, requests: int, prompt_words: int, max_tokens: int, http_port: int) -> dict:
    import ray
    from ray import serve

    from serve_app.serving.deployment import build_from_config
    from serve_app.serving.driver import init_ray_driver
    from serve_app.serving.serve_options import apply_cluster_env

    local = load_env_config("local").model_dump(mode="json")
    guarded = GUARDED.model_dump(mode="json")
    apps = {
        "guarded": parse_config(
            deep_merge(local, {"name": "guarded", "route_prefix": "/guarded", "security": guarded})
        ),
        "open": parse_config(
            deep_merge(local, {"name": "open", "route_prefix": "/open", "security": {"overload": None}})
        ),
    }
    headers = {"guarded": {"Authorization": f"Bearer {KEYS[1]}"}, "open": {}}
    os.environ[KEYS_ENV] = ",".join(KEYS)  # read by the guarded app's replica
    apply_cluster_env(os.environ)
    ttft_ms: dict[str, list[float]] = {name: [] for name in apps}
    per_round = []
    try:
        init_ray_driver(address="local", num_cpus=8, logging_level="WARNING", log_to_driver=False)
        serve.start(http_options={"host": "127.0.0.1", "port": http_port})
        for cfg in apps.values():
            serve.run(build_from_config(cfg), name=cfg.name, route_prefix=cfg.route_prefix)
        prompt = " ".join(f"w{i % 50}" for i in range(prompt_words))

        async def one_round(name: str) -> list[float]:
            url = f"http://127.0.0.1:{http_port}/{name}/v1/completions"
            async with httpx.AsyncClient(timeout=120, headers=headers[name]) as client:
                return [
                    (await one_request(client, url, "tiny-qwen3", f"{i} {prompt}", max_tokens)).ttft_s * 1000
                    for i in range(requests)
                ]

        for name in apps:  # warm-up
            asyncio.run(one_round(name))
        for r in range(rounds):
            for name in list(apps) if r % 2 == 0 else list(apps)[::-1]:
                values = asyncio.run(one_round(name))
                ttft_ms[name] += values
                per_round.append({"round": r, "app": name, "ttft_p50_ms": percentile(values, 50)})
                print(json.dumps(per_round[-1]), flush=True)
    finally:
        serve.shutdown()
        ray.shutdown()
    summary = {name: {"requests": len(v), "ttft_p50_ms": percentile(v, 50)} for name, v in ttft_ms.items()}
    rounds_p50 = {name: [x["ttft_p50_ms"] for x in per_round if x["app"] == name] for name in apps}
    deltas = [g - o for g, o in zip(rounds_p50["guarded"], rounds_p50["open"], strict=True)]
    return {
        "summary": summary,
        "ttft_p50_delta_ms": summary["guarded"]["ttft_p50_ms"] - summary["open"]["ttft_p50_ms"],
        "round_deltas_ms": deltas,
        "rounds": per_round,
    }


def overload(queue_fractions: list[float], overload_s: float, http_port: int, repeats: int) -> list[dict]:
    import gc

    import ray
    from ray import serve

    from loadtests.overload_client import overload_drill
    from loadtests.processes import serve_replicas
    from serve_app.serving.deployment import build_from_config
    from serve_app.serving.driver import init_ray_driver
    from serve_app.serving.serve_options import apply_cluster_env

    local = load_env_config("local").model_dump(mode="json")
    apply_cluster_env(os.environ)
    rows = []
    gc.collect()
    gc.freeze()  # a full collection over vLLM's and torch's objects would stall this load generator
    try:
        init_ray_driver(address="local", num_cpus=8, logging_level="WARNING", log_to_driver=False)
        serve.start(http_options={"host": "127.0.0.1", "port": http_port})
        for fraction in queue_fractions:
            overlay = {
                "name": "overload",
                "route_prefix": "/overload",
                "engine": {"max_num_seqs": 4},
                "deployment": {"num_replicas": 2},
                "security": {"overload": {"queue_fraction": fraction}},
            }
            cfg = parse_config(deep_merge(local, overlay))
            serve.run(build_from_config(cfg), name=cfg.name, route_prefix=cfg.route_prefix)
            pids = {p.pid for p in serve_replicas(cfg.name)}
            base_url = f"http://127.0.0.1:{http_port}{cfg.route_prefix}"
            for r in range(repeats):
                drill = asyncio.run(
                    overload_drill(
                        base_url, "tiny-qwen3", {}, 8, pids, cfg.route_prefix, overload_s=overload_s
                    )
                )
                rows.append({"queue_fraction": fraction, "repeat": r, **drill.report})
                print(json.dumps(rows[-1]), flush=True)
            serve.delete(cfg.name)
    finally:
        gc.unfreeze()
        serve.shutdown()
        ray.shutdown()
    return rows


def overload_summary(rows: list[dict]) -> list[dict]:
    """Per queue fraction: admitted TTFT against safe concurrency's, p50 and p99, each drill's ratio, median
    [min, max] over the repeats."""
    out = []
    for fraction in dict.fromkeys(r["queue_fraction"] for r in rows):
        mine = [r for r in rows if r["queue_fraction"] == fraction]
        entry: dict = {"queue_fraction": fraction, "drills": len(mine)}
        for q in ("p50", "p99"):
            ratios = [r["ttft admitted at 4x"][q] / r["ttft at safe concurrency"][q] for r in mine]
            entry[f"ttft_{q}_ratio"] = {
                "median": statistics.median(ratios),
                "min": min(ratios),
                "max": max(ratios),
            }
        refusals = [r["refusal, replica"].get("p99", 0.0) for r in mine]
        entry["refusal_replica_p99_ms_max"] = max(refusals)
        out.append(entry)
    return out


def markdown(report: dict) -> str:
    lines = [
        "# Cost of the replica's security layer",
        "",
        f"Command: `{report['command']}`  ",
        f"Machine: {report['machine']}",
        "",
        "## In process: microseconds per request (median of repeats, [min, max])",
        "",
    ]
    labels = [k for k in report["microbench"][0] if k not in ("body", "body_bytes")]
    lines += ["| body | bytes | " + " | ".join(labels) + " |", "|---|---|" + "---|" * len(labels)]
    for row in report["microbench"]:
        cells = [
            f"{row[k]['median_us']:.1f} [{row[k]['min_us']:.1f}, {row[k]['max_us']:.1f}]" for k in labels
        ]
        lines.append(f"| {row['body']} | {row['body_bytes']} | " + " | ".join(cells) + " |")
    if report.get("e2e"):
        e = report["e2e"]
        lines += [
            "",
            "## End to end: TTFT p50 at concurrency 1, same cluster, apps alternating",
            "",
            "| app | requests | TTFT p50 (ms) |",
            "|---|---|---|",
        ]
        lines += [f"| {n} | {s['requests']} | {s['ttft_p50_ms']:.2f} |" for n, s in e["summary"].items()]
        deltas = ", ".join(f"{d:+.2f}" for d in e["round_deltas_ms"])
        lines += ["", f"guarded - open, pooled: {e['ttft_p50_delta_ms']:+.2f} ms; per round: {deltas} ms"]
    if report.get("overload"):
        lines += [
            "",
            "## Overload: 2 replicas of max_num_seqs 4, 8 clients then 32 (ms: p50 / p99, n)",
            "",
            "| queue_fraction | TTFT at 8 | TTFT admitted at 32 | refusal, client | refusal, replica "
            "| /health | client loop lag at 8 | at 32 |",
            "|---|---|---|---|---|---|---|---|",
        ]
        keys = ("ttft at safe concurrency", "ttft admitted at 4x", "refusal, client", "refusal, replica")
        for row in report["overload"]:
            cells = [f"{row[k].get('p50', 0):.0f} / {row[k].get('p99', 0):.0f}, {row[k]['n']}" for k in keys]
            for k in ("health, client", "client loop lag at safe concurrency", "client loop lag at 4x"):
                cells.append(f"{row.get(k, {}).get('p50', 0):.0f} / {row.get(k, {}).get('p99', 0):.0f}")
            lines.append(f"| {row['queue_fraction']} | " + " | ".join(cells) + " |")
        lines += [
            "",
            "Admitted TTFT at 4x over TTFT at safe concurrency, per drill (median [min, max]):",
            "",
            "| queue_fraction | drills | p50 ratio | p99 ratio | refusal p99 at the replica, worst (ms) |",
            "|---|---|---|---|---|",
        ]
        for e in report["overload_summary"]:
            p50, p99 = e["ttft_p50_ratio"], e["ttft_p99_ratio"]
            lines.append(
                f"| {e['queue_fraction']} | {e['drills']} | {p50['median']:.2f} "
                f"[{p50['min']:.2f}, {p50['max']:.2f}] | {p99['median']:.2f} [{p99['min']:.2f}, "
                f"{p99['max']:.2f}] | {e['refusal_replica_p99_ms_max']:.1f} |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--base", default="main", help="git revision whose layer is the 'before' (default main)"
    )
    parser.add_argument("--iterations", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--e2e", action="store_true", help="also measure TTFT end to end (starts Ray)")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--prompt-words", type=int, default=1000)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--overload", action="store_true", help="also run the overload drill (starts Ray)")
    parser.add_argument("--queue-fractions", type=float, nargs="+", default=[0.0, 0.25])
    parser.add_argument("--overload-s", type=float, default=60)
    parser.add_argument("--overload-repeats", type=int, default=3, help="drills per client kind")
    parser.add_argument("--http-port", type=int, default=8320)
    parser.add_argument("--out", type=Path, default=Path("results/security"))
    args = parser.parse_args()
    report = {
        "command": "python -m loadtests.bench_security " + " ".join(sys.argv[1:]),
        "machine": describe() if callable(describe) else platform.platform(),
        "microbench": microbench(args.base, args.iterations, args.repeats),
    }
    if args.e2e:
        report["e2e"] = e2e(args.rounds, args.requests, args.prompt_words, args.max_tokens, args.http_port)
    if args.overload:
        report["overload"] = overload(
            args.queue_fractions, args.overload_s, args.http_port, args.overload_repeats
        )
        report["overload_summary"] = overload_summary(report["overload"])
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_security.json").write_text(json.dumps(report, indent=2))
    (args.out / "bench_security.md").write_text(markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main()
