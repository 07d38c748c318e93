"""The overhead benchmark's matrix and its arithmetic, with no servers, Ray or vLLM: pure, tested directly.

- Prompt counts per concurrency.
- Seeds: one per (workload, concurrency, round), the same for every server in that round, so each
  server gets the same requests and no round reuses another's prompts from the prefix cache.
- Aggregation over rounds: each metric's median with its min-max, and the paired comparison
  (headroom minus / over bare vLLM, per round: the two were measured side by side, so the pair
  shares the machine's noise).
- The time budget: whether another round (and a GPU swap, which restarts both servers) still fits.
"""

from __future__ import annotations

import statistics
import zlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

BARE = "vllm"
HEADROOM = "headroom"
HEADROOM_DIRECT = "headroom-direct"  # headroom's replica on its own port: HAProxy skipped
VLLM_BENCH = "vllm-bench"
# `vllm bench serve` in an open loop: Poisson arrivals at a fixed rate, the same schedule for every server,
# so a server's own latency cannot feed back into when the next requests arrive (as it does in a closed loop).
VLLM_BENCH_OPEN = "vllm-bench-open"
OUR_CLIENT = "ours"


def parse_counts(text: str) -> dict[int, int]:
    """'1:30,64:320' -> {1: 30, 64: 320} (prompts per cell at each concurrency)."""
    counts = {}
    for item in filter(None, text.split(",")):
        c, sep, n = item.partition(":")
        if not sep or not c.strip().isdigit() or not n.strip().isdigit():
            raise ValueError(f"prompt counts {text!r}: {item!r} is not CONCURRENCY:PROMPTS")
        counts[int(c)] = int(n)
    return counts


def parse_rates(text: str) -> dict[int, float]:
    """'64:20' -> {64: 20.0} (an open-loop run at 20 requests/s beside the closed loop at concurrency 64)."""
    rates = {}
    for item in filter(None, text.split(",")):
        c, sep, r = item.partition(":")
        try:
            rate = float(r)
        except ValueError:
            rate = 0.0
        if not sep or not c.strip().isdigit() or rate <= 0:
            raise ValueError(f"open-loop rates {text!r}: {item!r} is not CONCURRENCY:REQUESTS_PER_S (> 0)")
        rates[int(c)] = rate
    return rates


def prompt_count(concurrency: int, counts: Mapping[int, int], waves: int, min_prompts: int) -> int:
    """Prompts for one cell: the explicit count if given, else `waves` full batches (at least min_prompts)."""
    if concurrency in counts:
        return counts[concurrency]
    return max(min_prompts, waves * concurrency)


def cell_seed(
    workload: str, concurrency: int, round_index: int, client: str = VLLM_BENCH, second_door: str = ""
) -> int:
    """Deterministic and distinct per cell, round and loop; the same for every engine measured in that
    round. Prompts an engine has already served in the cell would be found in its prefix cache: an open
    loop gets prompts of its own, and so does a `second_door`, a target that loads an engine another
    target loads too (headroom's replica on its own port, bare vLLM with a longer turnaround)."""
    key = f"{workload}:{concurrency}:{round_index}" + (":open" if client == VLLM_BENCH_OPEN else "")
    return zlib.crc32((key + (f":{second_door}" if second_door else "")).encode()) % 1_000_000


WARMUP_SEED = 999_999_999

# The flags that say which model is served and how long its context is; without the others, vLLM
# chooses (its defaults: max_num_seqs, batched tokens, memory utilization, prefix caching, ...).
IDENTITY_FLAGS = ("--model", "--served-model-name", "--tokenizer", "--load-format", "--max-model-len")


def identity_flags(flags: Sequence[str]) -> list[str]:
    """`vllm serve` flags reduced to the model's identity: bare vLLM with its default engine settings."""
    out: list[str] = []
    for i, flag in enumerate(flags):
        if flag in IDENTITY_FLAGS and i + 1 < len(flags):
            out += [flag, flags[i + 1]]
    return out


def cpu_per_token(cpu_s: Mapping[str, float], output_tokens: int) -> dict[str, float | None]:
    """CPU microseconds per output token of each process group ("frontend", "engine", "ingress")."""
    return {
        f"{g}_cpu_us_per_token": (s / output_tokens * 1e6 if output_tokens else None)
        for g, s in cpu_s.items()
    }


# --------------------------------------------------------------------------------------------------------
# Aggregation over rounds
# --------------------------------------------------------------------------------------------------------

METRICS = (
    "ttft_p50_ms",
    "ttft_p99_ms",
    "tpot_p50_ms",
    "itl_p50_ms",
    "output_tokens_per_s",
    "frontend_cpu_us_per_token",
    # Of the frontend's CPU, HAProxy's and Serve's proxies' (headroom through its HTTP port only).
    "ingress_cpu_us_per_token",
    "engine_cpu_us_per_token",
    # vLLM's own TTFT, the median over the cell from bucket counts (loadtests/engine_timing.py), and how late
    # the replica's event loop woke up (Ray Serve's probe; headroom only).
    "engine_ttft_p50_ms",
    "replica_loop_lag_p50_ms",
    "replica_loop_lag_p99_ms",
    # vLLM's prefix-cache hits over the cell, percent of prompt tokens (engine_timing.py).
    "prefix_cache_hit_pct",
    # How bunched the requests' starts were (loadtests/vllm_bench.py: starts_nearby).
    "starts_within_50ms",
)


def spread(values: Iterable[float | None]) -> dict[str, float] | None:
    """Median, min, max and count of the values that were measured (None where nothing was)."""
    data = [v for v in values if v is not None]
    if not data:
        return None
    return {"median": statistics.median(data), "min": min(data), "max": max(data), "n": len(data)}


def _paired(a: Sequence[Mapping[str, Any]], b: Sequence[Mapping[str, Any]], metric: str, ratio: bool) -> list:
    """Per-round headroom-vs-bare values of one metric, for the rounds where both were measured."""
    by_round = {m["round"]: m.get(metric) for m in a}
    out = []
    for m in b:
        base, value = by_round.get(m["round"]), m.get(metric)
        if base is None or value is None or (ratio and base == 0):
            continue
        out.append(value / base if ratio else value - base)
    return out


def aggregate(measurements: Sequence[Mapping[str, Any]], servers: Sequence[str]) -> list[dict[str, Any]]:
    """One row per (workload, concurrency, client): each server's metrics as spreads over rounds, and each
    non-bare server's paired comparison with bare vLLM.

    A measurement is {"workload", "concurrency", "client", "server", "round", <metric>: value, ...}.
    """
    keys: dict[tuple[str, int, str], None] = {}
    for m in measurements:
        keys[(m["workload"], m["concurrency"], m["client"])] = None
    rows = []
    for workload, concurrency, client in keys:
        cell = [
            m
            for m in measurements
            if (m["workload"], m["concurrency"], m["client"]) == (workload, concurrency, client)
        ]
        per_server = {s: [m for m in cell if m["server"] == s] for s in servers}
        row: dict[str, Any] = {"workload": workload, "concurrency": concurrency, "client": client}
        for s in servers:
            row[s] = {metric: spread(m.get(metric) for m in per_server[s]) for metric in METRICS}
        row["comparison"] = {
            s: {
                "ttft_p50_delta_ms": spread(_paired(per_server[BARE], per_server[s], "ttft_p50_ms", False)),
                "ttft_p50_ratio": spread(_paired(per_server[BARE], per_server[s], "ttft_p50_ms", True)),
                "tpot_p50_ratio": spread(_paired(per_server[BARE], per_server[s], "tpot_p50_ms", True)),
                "throughput_ratio": spread(
                    _paired(per_server[BARE], per_server[s], "output_tokens_per_s", True)
                ),
                "frontend_cpu_us_per_token_delta": spread(
                    _paired(per_server[BARE], per_server[s], "frontend_cpu_us_per_token", False)
                ),
                "engine_cpu_us_per_token_ratio": spread(
                    _paired(per_server[BARE], per_server[s], "engine_cpu_us_per_token", True)
                ),
            }
            for s in servers
            if s != BARE
        }
        rows.append(row)
    return sorted(rows, key=lambda r: (r["workload"], r["client"], r["concurrency"]))


# The issue's targets, judged on `vllm bench serve`'s numbers (median of the per-round paired values).
TTFT_ADDED_MAX_MS = 3.0
THROUGHPUT_RATIO_MIN = 0.98
TTFT_RATIO_MAX = 1.05


def targets(
    rows: Sequence[Mapping[str, Any]], server: str = HEADROOM, against_vllm_defaults: bool = False
) -> dict[str, bool | None]:
    """Per workload, against bare vLLM with the same flags: TTFT p50 added at concurrency 1 <= 3 ms; output
    throughput >= 98% of bare at the two lowest concurrencies above 1; TTFT p50 within 5% at the lowest of
    them (GPU: 64 and 128; the CPU build's matrix is scaled down). Without c=1 there is no added-ms target.
    Against bare vLLM with its own defaults, the issue's target is output throughput >= 98% of bare at
    every concurrency; latencies are reported beside it, not judged. None: not measured."""
    if against_vllm_defaults:
        return _throughput_targets(rows, server)
    out: dict[str, bool | None] = {}
    for workload in sorted({r["workload"] for r in rows}):
        cells = sorted(
            (r for r in rows if r["workload"] == workload and r["client"] == VLLM_BENCH),
            key=lambda r: r["concurrency"],
        )
        if not cells:
            continue

        def median(row: Mapping[str, Any], key: str) -> float | None:
            s = row["comparison"].get(server, {}).get(key)
            return None if s is None else s["median"]

        single = [r for r in cells if r["concurrency"] == 1]
        others = [r for r in cells if r["concurrency"] > 1][:2]
        if single:
            d = median(single[0], "ttft_p50_delta_ms")
            name = f"{workload}: TTFT p50 added at c=1 <= {TTFT_ADDED_MAX_MS:g} ms"
            out[name] = None if d is None else d <= TTFT_ADDED_MAX_MS
        for row in others:
            r = median(row, "throughput_ratio")
            name = f"{workload}: throughput at c={row['concurrency']} >= {THROUGHPUT_RATIO_MIN:.0%} of bare"
            out[name] = None if r is None else r >= THROUGHPUT_RATIO_MIN
        if others:
            r = median(others[0], "ttft_p50_ratio")
            c = others[0]["concurrency"]
            name = f"{workload}: TTFT p50 at c={c} within {TTFT_RATIO_MAX - 1:.0%} of bare"
            out[name] = None if r is None else r <= TTFT_RATIO_MAX
    return out


def _throughput_targets(rows: Sequence[Mapping[str, Any]], server: str) -> dict[str, bool | None]:
    out: dict[str, bool | None] = {}
    for row in sorted(
        (r for r in rows if r["client"] == VLLM_BENCH), key=lambda r: (r["workload"], r["concurrency"])
    ):
        s = row["comparison"].get(server, {}).get("throughput_ratio")
        name = (
            f"{row['workload']}: throughput at c={row['concurrency']} >= {THROUGHPUT_RATIO_MIN:.0%} "
            "of bare vLLM with its defaults"
        )
        out[name] = None if s is None else s["median"] >= THROUGHPUT_RATIO_MIN
    return out


# --------------------------------------------------------------------------------------------------------
# Time budget
# --------------------------------------------------------------------------------------------------------


def next_round(time_left_s: float, round_s: float, restart_s: float, swap_due: bool) -> str:
    """What fits in the time left: "swap" (restart on swapped GPUs, then a round), "round" (a round on the
    same GPUs), or "stop". A swap is preferred when due and it fits; a round without it otherwise."""
    if swap_due and time_left_s >= restart_s + round_s:
        return "swap"
    if time_left_s >= round_s:
        return "round"
    return "stop"
