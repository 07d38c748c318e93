"""Prefix-affinity routing against least-loaded routing, measured side by side on one cluster.

1. The router's side call (`--side-call-rounds`): two one-replica apps at once, one per routing mode; the
   same distinct requests at concurrency 1 alternate between them, in rounds that alternate which goes
   first. TTFT p50 per mode and their difference, per round (the spread) and pooled.
2. The effect (`--profiles`): the config with `--replicas` replicas, deployed fresh (empty prefix caches)
   once per routing mode and repeat, mode order alternating per repeat; each measured with Locust on the
   workload profiles, one concurrency step each. TTFT, TPOT and throughput from Locust's raw file; the
   prefix-cache hit rate of each replica from vLLM's own counters (ray_vllm_prefix_cache_hits_total over
   ..._queries_total, by ReplicaId); the router's decisions (preferred, spilled, no key).

    python -m loadtests.bench_routing --env local --replicas 2 --max-tokens 32 --tokens-per-word 4.5 \\
        --prefix-tokens 1200 --profiles shared-prefix:4:40 multi-turn:4:40 --out results/bench_routing

Writes results.json and report.md to --out after every measurement, so a run cut short keeps what it
measured. It starts its own Ray cluster unless RAY_ADDRESS names one.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from loadtests import raw_stats
from loadtests.ladder import LADDER_CLUSTER_ENV, REQUEST_TIMEOUT_S, step_results, versions
from loadtests.ladder_report import compress
from loadtests.machine import describe
from loadtests.measure import percentile
from loadtests.smoke import locust_command
from loadtests.streaming_client import StreamError, one_request, prompts, run_load
from serve_app.config import HeadroomConfig, deep_merge, load_config_files, load_env_config, parse_config
from serve_app.serving.serve_options import SERVE_CLUSTER_ENV, apply_cluster_env

MODES = ("least_loaded", "prefix_affinity")
HITS, QUERIES = "ray_vllm_prefix_cache_hits_total", "ray_vllm_prefix_cache_queries_total"
DECISIONS = "ray_headroom_routing_decisions_total"
# Counters reach Prometheus every report interval: 2 s on a cluster started here (LADDER_CLUSTER_ENV), so
# counters that stay put over a longer quiet spell have settled.
COUNTERS_QUIET_S = 4.5
MEANS = ("ttft_p50_ms", "output_tokens_per_s")


def routed(cfg: HeadroomConfig, mode: str, replicas: int, name: str) -> HeadroomConfig:
    data = deep_merge(cfg.model_dump(mode="json"), {"name": name})
    data["deployment"] |= {"routing": mode, "num_replicas": replicas, "autoscaling": None}
    return parse_config(data, source=f"bench_routing {mode}")


def scrape() -> dict[str, list[tuple[dict[str, str], float]]]:
    """Every node's Prometheus export: {sample name: [(labels, value), ...]}."""
    import ray

    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    for node in (n for n in ray.nodes() if n["Alive"]):
        url = f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"
        for family in text_string_to_metric_families(httpx.get(url, timeout=10).text):
            for s in family.samples:
                samples.setdefault(s.name, []).append((s.labels, s.value))
    return samples


def app_replica_ids(app: str) -> set[str]:
    """The unique ids of the app's LLMServer replicas now (Serve names their actors
    SERVE_REPLICA::<app>#<deployment>#<id>; vLLM's counters carry the id as ReplicaId)."""
    import ray

    prefix = f"SERVE_REPLICA::{app}#LLMServer#"
    named = ray.util.list_named_actors(all_namespaces=True)
    return {a["name"].removeprefix(prefix) for a in named if a["name"].startswith(prefix)}


def counters(model: str, app: str) -> dict[str, Any]:
    """The app's prefix-cache counters by replica and its router's decisions, as exported now. Only this
    app's replicas: those of apps deleted before it (same served model) are still exported."""
    samples, replicas = scrape(), app_replica_ids(app)
    cache: dict[str, dict[str, float]] = {}
    for key, name in (("hits", HITS), ("queries", QUERIES)):
        for labels, value in samples.get(name, []):
            if labels.get("model_name") == model and labels.get("ReplicaId") in replicas:
                replica = cache.setdefault(labels.get("ReplicaId", ""), {"hits": 0.0, "queries": 0.0})
                replica[key] += value
    decisions: dict[str, float] = {}
    for labels, value in samples.get(DECISIONS, []):
        if labels.get("application") == app:
            decisions[labels["decision"]] = decisions.get(labels["decision"], 0.0) + value
    return {"cache": cache, "decisions": decisions}


def settled_counters(
    model: str, app: str, quiet_s: float = COUNTERS_QUIET_S, timeout_s: float = 60
) -> dict[str, Any]:
    """Counters once they stop moving (the last requests' counts have been exported)."""
    deadline = time.time() + timeout_s
    last = counters(model, app)
    while time.time() < deadline:
        time.sleep(quiet_s)
        now = counters(model, app)
        if now == last:
            return now
        last = now
    return last


def deltas(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """Hit rate per replica (replica ids shortened to 8 characters) and decisions over one measurement."""
    replicas = {}
    for replica, now in sorted(after["cache"].items()):
        was = before["cache"].get(replica, {"hits": 0.0, "queries": 0.0})
        hits, queries = now["hits"] - was["hits"], now["queries"] - was["queries"]
        replicas[replica[:8]] = {
            "hit_tokens": hits,
            "queried_tokens": queries,
            "hit_rate": hits / queries if queries else math.nan,
        }
    decisions = {k: v - before["decisions"].get(k, 0.0) for k, v in after["decisions"].items()}
    total = {k: sum(r[k] for r in replicas.values()) for k in ("hit_tokens", "queried_tokens")}
    rate = total["hit_tokens"] / total["queried_tokens"] if total["queried_tokens"] else math.nan
    return {"replicas": replicas, "hit_rate": rate, "decisions": decisions}


async def alternate(
    urls: dict[str, str], model: str, texts: list[str], max_tokens: int, order: list[str]
) -> tuple[dict[str, list[float]], int]:
    """Each prompt to every app in `order`, one request at a time: TTFT in seconds by mode, and how many
    prompts were left out because a request failed (in either mode, so that the modes stay paired: the
    toy model answers a few prompts with tokens that decode to no text)."""
    ttft: dict[str, list[float]] = {mode: [] for mode in order}
    failed = 0
    async with httpx.AsyncClient(timeout=600) as client:
        for text in texts:
            try:
                pair = {
                    m: await one_request(client, urls[m] + "/v1/completions", model, text, max_tokens)
                    for m in order
                }
            except StreamError as e:
                print(f"left out: {e}", flush=True)
                failed += 1
                continue
            for mode, result in pair.items():
                ttft[mode].append(result.ttft_s)
    return ttft, failed


def measure_side_call(cfg: HeadroomConfig, args: argparse.Namespace, base_url: str, report: dict) -> None:
    from ray import serve

    from serve_app.serving.deployment import build_from_config

    names = {mode: f"side-{mode.replace('_', '-')}" for mode in MODES}
    urls = {mode: f"{base_url}/{name}" for mode, name in names.items()}
    for mode, name in names.items():
        serve.run(build_from_config(routed(cfg, mode, 1, name)), name=name, route_prefix=f"/{name}")
    for url in urls.values():  # a fresh engine's first requests pay one-time costs
        asyncio.run(run_load(url, cfg.served_model_name, 2, 6, args.max_tokens))
    rounds, pooled, left_out = [], {mode: [] for mode in MODES}, 0
    texts = prompts(args.side_call_rounds * args.side_call_requests)
    for r in range(args.side_call_rounds):
        order = list(MODES) if r % 2 == 0 else list(MODES[::-1])
        batch = texts[r * args.side_call_requests : (r + 1) * args.side_call_requests]
        ttft, failed = asyncio.run(alternate(urls, cfg.served_model_name, batch, args.max_tokens, order))
        left_out += failed
        p50 = {mode: percentile(v, 50) * 1000 for mode, v in ttft.items()}
        rounds.append({"round": r, "first": order[0], "ttft_p50_ms": p50,
                       "delta_ms": p50["prefix_affinity"] - p50["least_loaded"]})  # fmt: skip
        for mode, values in ttft.items():
            pooled[mode] += values
        print(f"side call round {r}: {rounds[-1]}", flush=True)
    for name in names.values():
        serve.delete(name)
    p50 = {mode: percentile(v, 50) * 1000 for mode, v in pooled.items()}
    report["side_call"] = {
        "requests_per_mode": len(pooled["least_loaded"]),
        "prompts_left_out": left_out,
        "max_tokens": args.max_tokens,
        "ttft_p50_ms": p50,
        "delta_ms": p50["prefix_affinity"] - p50["least_loaded"],
        "round_delta_ms": [r["delta_ms"] for r in rounds],
        "rounds": rounds,
    }


def run_locust(url: str, model: str, profile: str, ladder: str, raw: Path, args: argparse.Namespace) -> None:
    """One Locust run of `profile` at the ladder's steps, every request in `raw`."""
    flags: dict[str, str | int | float] = {
        "--ladder": ladder,
        "--profile": profile,
        "--max-tokens": args.max_tokens,
        "--seed": args.seed,
        "--request-timeout": REQUEST_TIMEOUT_S,
        # Failed requests are data here (the error-rate column), not a failed run.
        "--exit-code-on-error": 0,
    }
    if args.tokens_per_word:
        flags["--tokens-per-word"] = args.tokens_per_word
    if args.prefix_tokens:
        flags["--prefix-tokens"] = args.prefix_tokens
    if args.prefix_count > 1:
        flags["--prefix-count"] = args.prefix_count
    limit_s = int(ladder.split(":")[1]) + REQUEST_TIMEOUT_S + 60
    result = subprocess.run(
        locust_command(url, model, raw, flags), capture_output=True, text=True, timeout=limit_s, check=False
    )
    if not raw.exists():
        raise RuntimeError(f"locust wrote no results (exit {result.returncode}): {result.stderr[-2000:]}")


def measure_mode(cfg: HeadroomConfig, mode: str, args: argparse.Namespace, base_url: str) -> list[dict]:
    from ray import serve

    from serve_app.serving.deployment import build_from_config

    name = f"effect-{mode.replace('_', '-')}"
    url, model = f"{base_url}/{name}", cfg.served_model_name
    serve.run(build_from_config(routed(cfg, mode, args.replicas, name)), name=name, route_prefix=f"/{name}")
    asyncio.run(run_load(url, model, 2 * args.replicas, 4 * args.replicas, args.max_tokens))  # warm-up
    rows = []
    before = settled_counters(model, name)
    for spec in args.profiles:
        profile, concurrency, seconds = spec.split(":")
        ladder = f"{concurrency}:{seconds}"
        raw = args.out / f"raw_{mode}_{profile}_c{concurrency}_{len(list(args.out.glob('raw_*')))}.jsonl"
        run_locust(url, model, profile, ladder, raw, args)
        [step] = step_results(raw_stats.load_records(raw), [int(concurrency)])
        compress(raw)
        after = settled_counters(model, name)
        rows.append({"mode": mode, "profile": profile, **asdict(step), **deltas(before, after)})
        before = after
        print(f"{mode} {profile}: {rows[-1]}", flush=True)
    serve.delete(name)
    return rows


def comparisons(effect: list[dict]) -> list[dict]:
    """prefix_affinity against least_loaded per (profile, concurrency), pooled over repeats (means)."""
    out = []
    for profile, c in dict.fromkeys((r["profile"], r["concurrency"]) for r in effect):
        mean = {}
        for mode in MODES:
            rows = [r for r in effect if (r["profile"], r["concurrency"], r["mode"]) == (profile, c, mode)]
            if rows:
                mean[mode] = {k: sum(r[k] for r in rows) / len(rows) for k in MEANS}
        if len(mean) < len(MODES):
            continue
        ll, pa = mean["least_loaded"], mean["prefix_affinity"]
        out.append(
            {
                "profile": profile,
                "concurrency": c,
                "ttft_p50_ratio_ll_over_pa": ll["ttft_p50_ms"] / pa["ttft_p50_ms"],
                "ttft_p50_delta_ms": pa["ttft_p50_ms"] - ll["ttft_p50_ms"],
                "throughput_ratio_pa_over_ll": pa["output_tokens_per_s"] / ll["output_tokens_per_s"],
                **per_repeat(effect, profile, c),
            }
        )
    return out


def per_repeat(effect: list[dict], profile: str, c: int) -> dict[str, list[float]]:
    """The spread: prefix_affinity minus least_loaded TTFT p50, and their throughput ratio, per repeat that
    measured both."""
    by_repeat: dict[int, dict[str, dict]] = {}
    for r in effect:
        if (r["profile"], r["concurrency"]) == (profile, c):
            by_repeat.setdefault(r.get("repeat", 0), {})[r["mode"]] = r
    pairs = [(m["least_loaded"], m["prefix_affinity"]) for _, m in sorted(by_repeat.items()) if len(m) == 2]
    return {
        "repeat_ttft_p50_delta_ms": [pa["ttft_p50_ms"] - ll["ttft_p50_ms"] for ll, pa in pairs],
        "repeat_throughput_ratio": [
            pa["output_tokens_per_s"] / ll["output_tokens_per_s"] for ll, pa in pairs
        ],
    }


def side_call_lines(side: dict) -> list[str]:
    per_round = ", ".join(f"{d:+.1f}" for d in side["round_delta_ms"])
    p50 = side["ttft_p50_ms"]
    return [
        "## The router's side call (one replica per mode, concurrency 1, alternating)",
        "",
        f"TTFT p50 over {side['requests_per_mode']} requests per mode, {side['max_tokens']} output tokens "
        f"each: least_loaded {p50['least_loaded']:.1f} ms, prefix_affinity {p50['prefix_affinity']:.1f} ms, "
        f"**{side['delta_ms']:+.1f} ms**; per round: {per_round} ms. Prompts left out (a request failed in "
        f"either mode): {side['prompts_left_out']}.",
        "",
    ]


def effect_lines(effect: list[dict], compared: list[dict]) -> list[str]:
    lines = [
        "## The effect",
        "",
        "| profile | c | routing | TTFT p50 ms | TTFT p95 ms | TPOT p50 ms | output tok/s | errors "
        "| prefix-cache hit rate (per replica that got requests) | router: preferred / spilled / no key |",
        "|---|---:|---|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in effect:
        per = ", ".join(
            f"{rid} {v['hit_rate']:.0%}" for rid, v in r["replicas"].items() if v["queried_tokens"]
        )
        d = r["decisions"]
        routed_by = " / ".join(f"{d.get(k, 0):.0f}" for k in ("preferred", "spilled", "no_key")) if d else "-"
        lines.append(
            f"| {r['profile']} | {r['concurrency']} | {r['mode']} | {r['ttft_p50_ms']:.1f} "
            f"| {r['ttft_p95_ms']:.1f} | {r['tpot_p50_ms']:.2f} | {r['output_tokens_per_s']:.0f} "
            f"| {r['error_rate']:.1%} | {r['hit_rate']:.0%} ({per}) | {routed_by} |"
        )
    lines += [
        "",
        "Means over repeats; per repeat in brackets (the spread).",
        "",
        "| profile | c | TTFT p50 least_loaded / prefix_affinity | TTFT p50 delta ms "
        "| throughput prefix_affinity / least_loaded |",
        "|---|---:|---:|---:|---:|",
    ]
    for c in compared:
        deltas_text = ", ".join(f"{d:+.1f}" for d in c["repeat_ttft_p50_delta_ms"])
        ratios_text = ", ".join(f"x{x:.3f}" for x in c["repeat_throughput_ratio"])
        lines.append(
            f"| {c['profile']} | {c['concurrency']} | x{c['ttft_p50_ratio_ll_over_pa']:.2f} | "
            f"{c['ttft_p50_delta_ms']:+.1f} ({deltas_text}) | x{c['throughput_ratio_pa_over_ll']:.3f} "
            f"({ratios_text}) |"
        )
    return lines


def markdown(report: dict) -> str:
    versions_text = ", ".join(f"{k} {v}" for k, v in report["versions"].items())
    lines = [
        f"# Prefix-affinity vs least-loaded routing: {report['model']}, {report['replicas']} replicas",
        "",
        f"Machine: {report['machine']}. Versions: {versions_text}.",
        f"Command: `{report['command']}`",
        "",
    ]
    if report.get("side_call"):
        lines += side_call_lines(report["side_call"])
    if report["effect"]:
        lines += effect_lines(report["effect"], report["comparisons"])
    return "\n".join(lines) + "\n"


def write(report: dict, out: Path) -> None:
    (out / "results.json").write_text(json.dumps(report, indent=2, default=str))
    (out / "report.md").write_text(markdown(report))


def start_cluster(accelerator: str) -> str:
    """Ray (a new local cluster with headroom's settings, unless RAY_ADDRESS names one) and Serve; the HTTP
    base URL."""
    address = os.environ.get("RAY_ADDRESS") or "local"
    if address == "local":
        for key, value in LADDER_CLUSTER_ENV.items():
            os.environ.setdefault(key, value)
    apply_cluster_env(os.environ)  # before Ray Serve reads its settings
    from ray import serve

    from serve_app.serving.driver import init_ray_driver

    num_cpus = 8 if accelerator == "cpu" and address == "local" else None
    init_ray_driver(address=address, num_cpus=num_cpus, logging_level="ERROR", log_to_driver=False)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    return f"http://127.0.0.1:{port}"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--env", default=None, help="configs/base.yaml + configs/<env>.yaml (default local)")
    p.add_argument("--config", nargs="+", type=Path, default=None, help="config files, merged in order")
    p.add_argument("--replicas", type=int, default=2, help="replicas per app in the effect measurement")
    p.add_argument("--profiles", nargs="*", default=["shared-prefix:4:40", "multi-turn:4:40"],
                   help="PROFILE:CONCURRENCY:SECONDS, each measured in every routing mode")  # fmt: skip
    p.add_argument("--repeats", type=int, default=1, help="effect measurements per mode, order alternating")
    p.add_argument("--first-mode", choices=MODES, default=MODES[0], help="measured first in the first repeat")
    p.add_argument("--side-call-rounds", type=int, default=4, help="0 skips the side-call measurement")
    p.add_argument("--side-call-requests", type=int, default=20, help="requests per mode and round")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--tokens-per-word", default=None, help="prompt sizing for Locust (tiny-qwen3: 4.5)")
    p.add_argument("--prefix-tokens", type=int, default=None, help="shared-prefix system prompt, tokens")
    p.add_argument("--prefix-count", type=int, default=1,
                   help="shared-prefix: distinct system prompts; more than one replica's KV cache holds "
                   "makes routing decide the hit rate")  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("results/bench_routing"))
    args = p.parse_args(argv)
    for spec in args.profiles:
        if len(spec.split(":")) != 3:
            p.error(f"--profiles {spec!r}: expected PROFILE:CONCURRENCY:SECONDS, e.g. multi-turn:64:30")
    if args.prefix_count < 1:
        p.error(f"--prefix-count {args.prefix_count}: expected a whole number >= 1")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    cfg = load_config_files(*args.config) if args.config else load_env_config(args.env or "local")
    base_url = start_cluster(cfg.resources.accelerator)
    report: dict[str, Any] = {
        "machine": describe(),
        "versions": versions(),
        "model": cfg.served_model_name,
        "replicas": args.replicas,
        "serve_env": {k: os.environ.get(k) for k in SERVE_CLUSTER_ENV},
        "command": " ".join(["python -m loadtests.bench_routing", *sys.argv[1:]]),
        "effect": [],
        "comparisons": [],
    }
    import ray
    from ray import serve

    # `timeout` (loadtests/gpu/run.sh) ends a run with SIGTERM: stop what was started on the way out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        if args.side_call_rounds:
            measure_side_call(cfg, args, base_url, report)
            write(report, args.out)
        for repeat in range(args.repeats):
            first = MODES.index(args.first_mode)
            for mode in MODES if (repeat + first) % 2 == 0 else MODES[::-1]:
                report["effect"] += [
                    {**row, "repeat": repeat} for row in measure_mode(cfg, mode, args, base_url)
                ]
                report["comparisons"] = comparisons(report["effect"])
                write(report, args.out)
    finally:
        serve.shutdown()
        ray.shutdown()
    print(markdown(report))


if __name__ == "__main__":
    main()
