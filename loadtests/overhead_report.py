"""The overhead benchmark's Markdown report, from its results.json dictionary (pure)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from loadtests.engine_timing import LOOP_PROBE_INTERVAL_S
from loadtests.overhead_matrix import BARE, OUR_CLIENT, VLLM_BENCH, VLLM_BENCH_OPEN

_SERVER_COLUMNS = (
    ("TTFT p50 ms", "ttft_p50_ms", 1),
    ("TTFT p99 ms", "ttft_p99_ms", 1),
    ("TPOT p50 ms", "tpot_p50_ms", 2),
    ("ITL p50 ms", "itl_p50_ms", 2),
    ("output tok/s", "output_tokens_per_s", 0),
    ("frontend CPU us/token", "frontend_cpu_us_per_token", 0),
    ("of which HAProxy + proxies", "ingress_cpu_us_per_token", 0),
    ("engine CPU us/token", "engine_cpu_us_per_token", 0),
    ("starts within 50 ms", "starts_within_50ms", 0),
)
Columns = tuple[tuple[str, str, int], ...]  # (header, metric, digits)

_ENGINE_TIMING_COLUMNS: Columns = (
    ("client TTFT p50 ms", "ttft_p50_ms", 1),
    ("engine TTFT p50 ms", "engine_ttft_p50_ms", 1),
    ("replica loop lag p50 ms", "replica_loop_lag_p50_ms", 1),
    ("replica loop lag p99 ms", "replica_loop_lag_p99_ms", 1),
    ("prefix-cache hits %", "prefix_cache_hit_pct", 1),
)
_COMPARISON_COLUMNS = (
    ("TTFT p50 added ms", "ttft_p50_delta_ms", 1),
    ("TTFT p50 ratio", "ttft_p50_ratio", 3),
    ("TPOT p50 ratio", "tpot_p50_ratio", 3),
    ("throughput ratio", "throughput_ratio", 3),
    ("engine CPU ratio", "engine_cpu_us_per_token_ratio", 2),
    ("extra frontend CPU us/token", "frontend_cpu_us_per_token_delta", 0),
)


def fmt(s: Mapping[str, float] | None, digits: int) -> str:
    """'median [min-max]' over rounds, or the value alone from one round; '-' when not measured."""
    if s is None:
        return "-"
    median = f"{s['median']:,.{digits}f}"
    if s["n"] < 2:
        return median
    return f"{median} [{s['min']:,.{digits}f}, {s['max']:,.{digits}f}]"


def _server_table(
    rows: list[dict[str, Any]], servers: list[str], columns: Columns = _SERVER_COLUMNS
) -> list[str]:
    lines = [
        "| c | server | " + " | ".join(name for name, _, _ in columns) + " |",
        "|---:|---|" + "---:|" * len(columns),
    ]
    for row in rows:
        for s in servers:
            cells = [fmt(row[s].get(key), d) for _, key, d in columns]
            lines.append(f"| {row['concurrency']} | {s} | " + " | ".join(cells) + " |")
    return lines


def _comparison_table(rows: list[dict[str, Any]], servers: list[str]) -> list[str]:
    lines = [
        "| c | server | " + " | ".join(name for name, _, _ in _COMPARISON_COLUMNS) + " |",
        "|---:|---|" + "---:|" * len(_COMPARISON_COLUMNS),
    ]
    for row in rows:
        for s in servers:
            if s == BARE:
                continue
            cells = [fmt(row["comparison"][s][key], d) for _, key, d in _COMPARISON_COLUMNS]
            lines.append(f"| {row['concurrency']} | {s} | " + " | ".join(cells) + " |")
    return lines


def _workload_sections(report: Mapping[str, Any], servers: list[str]) -> list[str]:
    lines: list[str] = []
    for name, w in report["workloads"].items():
        prefix = f" after a {w['prefix_len']}-token prefix shared within the cell" if w["prefix_len"] else ""
        lines += [
            "",
            f"## {name}: {w['input_len']}-token prompts{prefix}, {w['output_len']} output tokens",
            "",
        ]
        for client, title in (
            (VLLM_BENCH, "`vllm bench serve`"),
            (VLLM_BENCH_OPEN, "`vllm bench serve`, open loop (Poisson arrivals, the same for every server)"),
            (OUR_CLIENT, "our client"),
        ):
            rows = [r for r in report["results"] if r["workload"] == name and r["client"] == client]
            if not rows:
                continue
            lines += [f"{title}: each server (median [min, max] over rounds)", ""]
            lines += _server_table(rows, servers)
            lines += ["", f"{title}: against bare vLLM, paired per round (median [min, max])", ""]
            lines += _comparison_table(rows, servers)
            lines.append("")
            if client != OUR_CLIENT and any(r[s].get("engine_ttft_p50_ms") for r in rows for s in servers):
                lines += [
                    "The first token inside and outside the engine: the client's TTFT beside vLLM's own "
                    "(from vLLM's renderer in `vllm serve`; in headroom from the replica's HTTP server, "
                    "serving/engine.py `arrive_at_http_start`), "
                    "the median over each cell interpolated within vLLM's buckets as Prometheus' "
                    "histogram_quantile does, and how late the replica's event loop woke from a sleep "
                    f"(Ray Serve's probe, every {LOOP_PROBE_INTERVAL_S * 1e3:g} ms, idle seconds between "
                    "cells included; `vllm serve` has none), and the share of prompt tokens vLLM found in "
                    "its prefix cache (median [min, max] over rounds)",
                    "",
                ]
                lines += _server_table(rows, servers, _ENGINE_TIMING_COLUMNS)
                lines.append("")
    return lines


def _memory_lines(memory: list[dict[str, Any]], predicted_for: str) -> list[str]:
    if not memory:
        return []
    lines = [
        "",
        f"The planner's prediction for {predicted_for}, against what vLLM logged:",
        "",
        "| engine | KV tokens predicted | KV tokens logged | error | weights GiB predicted / logged "
        "| torch.compile graphs |",
        "|---|---:|---:|---:|---|---|",
    ]
    for m in memory:
        lines.append(
            f"| {m['source']} | {m['predicted_kv_cache_tokens']:,} | {m['kv_cache_tokens']:,} | "
            f"{m['kv_error']:+.2%} | {m['predicted_weights_gib']:.2f} / {m['weights_gib']} | "
            f"{m.get('torch_compile') or 'not logged'} |"
        )
    return lines


def markdown(report: Mapping[str, Any]) -> str:
    servers = [BARE, *report["targets"]]
    v = report["versions"]
    flags = " ".join(report["engine_flags"])
    if report["bare_engine_flags"] == report["engine_flags"]:
        engine = f"the same engine flags on every server: `{flags}`."
    else:
        bare_flags = " ".join(report["bare_engine_flags"])
        engine = f"headroom's engine flags `{flags}`; bare vLLM with vLLM's defaults: `{bare_flags}`."
    lines = [
        "# headroom vs bare vLLM: serving overhead",
        "",
        f"Machine: {report['machine']}. vLLM {v['vllm']}, Ray {v['ray']}, Python {v['python']}.",
        f"Model: {report['model']}; {engine}",
        f"Layout: {report['layout']}. Rounds: {report['rounds_done']} of {report['rounds_planned']} "
        f"({report['elapsed_s']:.0f} s). Prompts per cell: "
        + ", ".join(f"{k}: {n}" for k, n in report["prompts"].items())
        + ".",
    ]
    if report["variants"]:
        lines.append(
            "Variants (headroom apps whose replicas got this environment): "
            + "; ".join(f"{k}: {env}" for k, env in report["variants"].items())
            + "."
        )
    cache = report.get("compile_cache")
    if cache:
        lines.append(
            "vLLM's torch.compile cache: "
            + ("off (every engine compiled its own graphs)." if cache == "off" else "on (vLLM's default).")
        )
    lines += [f"Note: {n}." for n in report["notes"]]
    lines += _workload_sections(report, servers)
    lines += ["## Targets (`vllm bench serve`, median of the paired per-round values)", ""]
    for server, results in report["targets"].items():
        for name, ok in results.items():
            verdict = "not measured" if ok is None else ("met" if ok else "NOT met")
            lines.append(f"- {server}: {name}: {verdict}")
    starts = ", ".join(f"{s['server']} {s['ready_s']:.0f} s (GPU {s['gpu']})" for s in report["starts"])
    lines += ["", f"Seconds from launch to serving: {starts}."]
    lines += _memory_lines(report["memory"], report["memory_predicted_for"])
    lines += ["", f"Command: `{report['command']}`", ""]
    example = next(iter(report["vllm_bench_commands"].items()), None)
    if example:
        lines += [f"`vllm bench serve` as run for {example[0]} (all: results.json): `{example[1]}`", ""]
    return "\n".join(lines)
