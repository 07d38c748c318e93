"""How long the first token takes inside vLLM, from the engine's own TTFT histogram (pure).

A server's histograms are read before and after a cell; the difference of their bucket counts is the
cell's distribution, and its median is interpolated within a bucket as Prometheus' `histogram_quantile`
does. Bucket counts, not `_sum`: Ray's metrics agent, which exports a headroom replica's vLLM metrics,
rebuilds each histogram from its bucket counts and bucket midpoints, so its `_sum` is an approximation
(ray-project/ray#64852) while its counts are exact. Both servers get the same treatment, so their medians
compare at the resolution of vLLM's buckets (for TTFT: 0.1, 0.25, 0.5, 0.75, 1 s, ...). vLLM's queue and
prefill histograms start at a 0.3 s bucket, too coarse to split a first token of under a second.

The histograms are vLLM's as `vllm serve` exposes them (`vllm:time_to_first_token_seconds`) or as Ray
exports a replica's (`ray_vllm_time_to_first_token_seconds`). vLLM's TTFT runs from the request's arrival
in the engine client (the API server or the replica) to the first token back there: a client TTFT well
above it was spent outside the engine (HTTP in, the first chunk out). vLLM stamps the first token when the
engine client's event loop handles it, so a busy loop shows in it too.

A headroom replica also has Ray Serve's own probe of its event loop
(`ray_serve_event_loop_scheduling_latency_ms`, `component="replica"`, `loop_type="main"`): how late a sleep
on the loop wakes up, sampled every `RAY_SERVE_EVENT_LOOP_MONITORING_INTERVAL_S` (the benchmark sets
LOOP_PROBE_INTERVAL_S), in buckets of 1, 5, 10, 25, 50 ms and up. Between two readings it covers the cell and
the seconds spent waiting for the export to settle after it, when the loop is idle; so its median leans low,
and its 99th percentile is the figure to read. `vllm serve` has no such probe.

vLLM's prefix-cache counters (`vllm:prefix_cache_queries` and `_hits`, in prompt tokens) are read the same
way: a cell's hit rate tells a cell that found earlier prompts in the cache (another target's, on the same
engine) from one that did not.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

# vLLM's histogram (without prefix) -> our name.
ENGINE_HISTOGRAMS = {
    "time_to_first_token_seconds": "engine_ttft",
    "e2e_request_latency_seconds": "engine_e2e",
}
FINISHED = "engine_e2e"  # requests the engine finished: the end-to-end histogram's count
# Ray Serve's event-loop probe (without Ray's prefix), the replica's main loop only; in milliseconds.
LOOP_LAG_HISTOGRAM = "serve_event_loop_scheduling_latency_ms"
LOOP_LAG = "replica_loop_lag"
LOOP_LAG_LABELS = {"component": "replica", "loop_type": "main"}
# Serve's default is 5 s. 20 samples a second, each three Ray metric calls: about 1 ms of loop time a second.
LOOP_PROBE_INTERVAL_S = 0.05
# vLLM's prefix-cache counters (without prefix and `_total`), kept as a Totals entry with one +Inf "bucket".
PREFIX_CACHE_QUERIES, PREFIX_CACHE_HITS = "prefix_cache_queries", "prefix_cache_hits"

Buckets = dict[float, float]  # upper bound (le) -> cumulative count, summed over series
Totals = dict[str, Buckets]  # our name -> its buckets


def histogram_totals(samples: Iterable[tuple[str, Mapping[str, str], float]]) -> Totals:
    """The engine histograms' cumulative bucket counts from Prometheus samples (name, labels, value), and
    the prefix-cache counters' totals (under +Inf)."""
    out: Totals = {}
    for name, labels, value in samples:
        base = name.removeprefix("ray_").replace(":", "_").removeprefix("vllm_")
        counter = base.removesuffix("_total")
        if counter in (PREFIX_CACHE_QUERIES, PREFIX_CACHE_HITS):
            out.setdefault(counter, {})[math.inf] = out.get(counter, {}).get(math.inf, 0.0) + value
            continue
        key = ENGINE_HISTOGRAMS.get(base.removesuffix("_bucket")) if base.endswith("_bucket") else None
        if base == f"{LOOP_LAG_HISTOGRAM}_bucket" and LOOP_LAG_LABELS.items() <= labels.items():
            key = LOOP_LAG
        if key is not None and "le" in labels:
            le = float(labels["le"])
            out.setdefault(key, {})[le] = out.get(key, {}).get(le, 0.0) + value
    return out


def finished(totals: Totals) -> float:
    """Requests counted so far (the +Inf bucket of the end-to-end histogram)."""
    return totals.get(FINISHED, {}).get(math.inf, 0.0)


def quantile(q: float, buckets: Buckets) -> float | None:
    """Prometheus' histogram_quantile: linear within the bucket that holds rank q x count (the lowest
    bucket from 0); None without observations; the highest finite bound when the rank is in +Inf."""
    bounds = sorted(buckets)
    total = buckets.get(math.inf, 0.0)
    if not bounds or total <= 0:
        return None
    rank = q * total
    lower, below = 0.0, 0.0
    for le in bounds:
        count = buckets[le]
        if count >= rank:
            if math.isinf(le):
                return lower
            return lower + (le - lower) * ((rank - below) / (count - below) if count > below else 0.0)
        lower, below = le, count
    return lower


def cell_quantiles_ms(before: Totals, after: Totals) -> dict[str, float | None]:
    """Each engine histogram's median over the requests between two readings, in ms ({name}_p50_ms), and
    the replica's event-loop lag there, median and 99th percentile (None where it was not exported)."""

    def between(key: str) -> Buckets:
        b, a = before.get(key, {}), after.get(key, {})
        return {le: a[le] - b.get(le, 0.0) for le in a}

    out: dict[str, float | None] = {}
    for key in ENGINE_HISTOGRAMS.values():
        if key != FINISHED:
            p50_s = quantile(0.5, between(key))
            out[f"{key}_p50_ms"] = None if p50_s is None else p50_s * 1e3
    lag = between(LOOP_LAG)
    out[f"{LOOP_LAG}_p50_ms"], out[f"{LOOP_LAG}_p99_ms"] = quantile(0.5, lag), quantile(0.99, lag)
    return out


def cell_prefix_cache_hit_pct(before: Totals, after: Totals) -> float | None:
    """The share of prompt tokens found in the prefix cache between two readings, in percent (None where
    no token was looked up or the counters were not exported)."""

    def grown(key: str) -> float:
        return after.get(key, {}).get(math.inf, 0.0) - before.get(key, {}).get(math.inf, 0.0)

    queries = grown(PREFIX_CACHE_QUERIES)
    return 100.0 * grown(PREFIX_CACHE_HITS) / queries if queries > 0 else None
