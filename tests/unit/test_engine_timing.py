"""The engine's own timing over a cell, from vLLM's Prometheus histograms as `vllm serve` exposes them and
as Ray exports a replica's (loadtests/engine_timing.py)."""

from __future__ import annotations

import math

import pytest
from prometheus_client.parser import text_string_to_metric_families

from loadtests.engine_timing import (
    cell_prefix_cache_hit_pct,
    cell_quantiles_ms,
    finished,
    histogram_totals,
    quantile,
)

TTFT_BOUNDS = (0.1, 0.25, 0.5, 0.75, 1.0)


def exposition(prefix: str, ttft: dict[float, int], engines: int = 1, junk_sum: float = 123.0) -> str:
    """TTFT and end-to-end histograms in Prometheus text format (cumulative buckets), split over engines;
    the _sum is junk, as in Ray's export (rebuilt from bucket midpoints), and must not matter."""
    lines = []
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds"):
        lines.append(f"# TYPE {prefix}{name} histogram")
        for engine in range(engines):
            labels = f'engine="{engine}",model_name="tiny-qwen3"'
            running = 0
            for le in (*TTFT_BOUNDS, math.inf):
                running += ttft.get(le, 0)
                bound = "+Inf" if math.isinf(le) else str(le)
                lines.append(f'{prefix}{name}_bucket{{{labels},le="{bound}"}} {running / engines}')
            lines += [
                f"{prefix}{name}_sum{{{labels}}} {junk_sum}",
                f"{prefix}{name}_count{{{labels}}} {running / engines}",
            ]
    lines += ["# TYPE vllm:num_requests_running gauge", 'vllm:num_requests_running{engine="0"} 3']
    return "\n".join(lines) + "\n"


def totals(text: str):
    return histogram_totals(
        (s.name, s.labels, s.value) for f in text_string_to_metric_families(text) for s in f.samples
    )


@pytest.mark.parametrize("prefix", ["vllm:", "ray_vllm_", "ray_vllm:"])
def test_cell_median_from_bucket_deltas_of_either_source(prefix):
    before = totals(exposition(prefix, {0.1: 10}))
    # The cell: 10 more under 0.1 s (the next cell's warm-up, say), 20 in (0.5, 0.75], 10 in (0.75, 1].
    after = totals(exposition(prefix, {0.1: 20, 0.75: 20, 1.0: 10}, engines=2, junk_sum=999.0))
    assert finished(before) == 10 and finished(after) == 50
    medians = cell_quantiles_ms(before, after)
    # 40 in the cell: rank 20 falls in (0.5, 0.75] after 10 below it: 0.5 + 0.25 x 10/20
    assert medians["engine_ttft_p50_ms"] == pytest.approx(625.0)


def test_quantile_follows_prometheus_histogram_quantile():
    buckets = {0.1: 4.0, 0.25: 8.0, math.inf: 10.0}
    assert quantile(0.25, buckets) == pytest.approx(0.1 * 2.5 / 4)  # rank 2.5 in the lowest bucket, from 0
    assert quantile(0.6, buckets) == pytest.approx(0.1 + 0.15 * 0.5)
    assert quantile(0.99, buckets) == pytest.approx(0.25)  # in +Inf: the highest finite bound
    assert quantile(0.5, {0.1: 0.0, math.inf: 0.0}) is None
    assert quantile(0.5, {}) is None


def test_no_request_between_readings_gives_no_median():
    same = totals(exposition("vllm:", {0.1: 10}))
    assert set(cell_quantiles_ms(same, same).values()) == {None}
    assert finished({}) == 0


def loop_probe(counts: dict[float, int], proxy_counts: dict[float, int]) -> str:
    """Ray Serve's event-loop probe as Ray exports it: the replica's main loop and a proxy's, which must not
    count."""
    name = "ray_serve_event_loop_scheduling_latency_ms"
    lines = [f"# TYPE {name} histogram"]
    for component, per_bucket in (("replica", counts), ("proxy", proxy_counts)):
        labels = f'actor_id="a",application="headroom",component="{component}",loop_type="main"'
        running = 0
        for le in (1.0, 5.0, 10.0, 25.0, 50.0, math.inf):
            running += per_bucket.get(le, 0)
            bound = "+Inf" if math.isinf(le) else str(le)
            lines.append(f'{name}_bucket{{{labels},le="{bound}"}} {running}')
        lines.append(f"{name}_count{{{labels}}} {running}")
    return "\n".join(lines) + "\n"


def test_replica_loop_lag_over_a_cell_from_serves_probe_replica_main_loop_only():
    before = totals(exposition("ray_vllm_", {0.1: 10}) + loop_probe({1.0: 100}, {50.0: 7}))
    # The cell: 50 samples under 1 ms, 40 in (1, 5], 10 in (10, 25]; the proxy's slow samples are ignored.
    after = totals(
        exposition("ray_vllm_", {0.1: 20}) + loop_probe({1.0: 150, 5.0: 40, 25.0: 10}, {50.0: 500})
    )
    lag = cell_quantiles_ms(before, after)
    assert lag["replica_loop_lag_p50_ms"] == pytest.approx(1.0)  # rank 50 of 100: the top of the 1 ms bucket
    assert lag["replica_loop_lag_p99_ms"] == pytest.approx(10 + 15 * 9 / 10)  # rank 99: 9 into the 10 there
    assert lag["engine_ttft_p50_ms"] == pytest.approx(50.0)  # vLLM's TTFT still read beside it


def test_no_loop_probe_gives_no_lag():
    """`vllm serve` exports no such probe: the lag is None, not 0."""
    text = exposition("vllm:", {0.1: 10})
    lag = cell_quantiles_ms(totals(text), totals(text))
    assert lag["replica_loop_lag_p50_ms"] is None and lag["replica_loop_lag_p99_ms"] is None


def prefix_cache(prefix: str, queries: float, hits: float, suffix: str) -> str:
    """vLLM's prefix-cache counters: `_total` and a `_created` timestamp from prometheus_client (`vllm
    serve`), with or without `_total` from Ray's export; two engines' series add up."""
    lines = []
    for counter, value in (("prefix_cache_queries", queries), ("prefix_cache_hits", hits)):
        lines.append(f"# TYPE {prefix}{counter} counter")
        for engine in (0, 1):
            lines.append(f'{prefix}{counter}{suffix}{{engine="{engine}"}} {value / 2}')
            lines.append(f'{prefix}{counter}_created{{engine="{engine}"}} 1764806400.0')
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize(
    ("prefix", "suffix"), [("vllm:", "_total"), ("ray_vllm_", "_total"), ("ray_vllm_", "")]
)
def test_a_cells_prefix_cache_hit_rate_from_vllms_counters(prefix, suffix):
    before = totals(exposition(prefix, {0.1: 10}) + prefix_cache(prefix, 1000, 100, suffix))
    after = totals(exposition(prefix, {0.1: 20}) + prefix_cache(prefix, 5000, 3100, suffix))
    assert cell_prefix_cache_hit_pct(before, after) == pytest.approx(75.0)  # 3000 of 4000 tokens
    assert cell_prefix_cache_hit_pct(after, after) is None  # nothing looked up
    assert finished(after) == 20  # the counters leave the histograms as they were
