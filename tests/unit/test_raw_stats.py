"""Exact statistics from the raw per-request file, and quantiles from Prometheus histogram buckets."""

from __future__ import annotations

import json
import math

import pytest

from loadtests.measure import percentile
from loadtests.raw_stats import (
    bucket_increase,
    group_records,
    histogram_quantile,
    load_records,
    main,
    summarize,
    summarize_by,
)


def record(i: int, **overrides: object) -> dict:
    """A successful request: TTFT (i+1) ms, TPOT 2 ms, 11 output tokens, sent i*0.1 s after t=1000."""
    ttft = (i + 1) / 1000
    r = {
        "run": "r1",
        "profile": "structured",
        "start_s": 1000.0 + i * 0.1,
        "ttft_s": ttft,
        "tpot_s": 0.002,
        "e2e_s": ttft + 0.002 * 10,
        "itl_mean_s": 0.002,
        "itl_max_s": 0.004,
        "output_tokens": 11,
        "status": 200,
        "error": None,
        "step": None,
        "step_index": None,
    }
    r.update(overrides)
    return r


# --------------------------------------------------------------------------------------------------------
# Summaries
# --------------------------------------------------------------------------------------------------------


def test_summary_on_known_data():
    records = [record(i) for i in range(100)]  # TTFT 1..100 ms
    records += [record(100, status=500, error="HTTP 500: boom", ttft_s=None, tpot_s=None, output_tokens=0)]
    records += [record(101, status=200, error="stream error: engine dead", ttft_s=9.0)]
    s = summarize(records)
    assert (s["requests"], s["ok"], s["errors"]) == (102, 100, 2)
    assert s["error_rate"] == pytest.approx(2 / 102)
    # exact percentiles of 1..100 ms, failures excluded (the 9 s TTFT of the broken stream is not in them)
    assert s["ttft_p50_ms"] == pytest.approx(50.5)
    assert s["ttft_p90_ms"] == pytest.approx(90.1)
    assert s["ttft_p95_ms"] == pytest.approx(95.05)
    assert s["ttft_p99_ms"] == pytest.approx(99.01)
    assert s["ttft_mean_ms"] == pytest.approx(50.5)
    assert s["tpot_p50_ms"] == pytest.approx(2.0)
    assert s["e2e_p50_ms"] == pytest.approx(70.5)
    assert s["itl_max_p99_ms"] == pytest.approx(4.0)
    # throughput: 100 x 11 tokens from the first send (t=1000) to the last byte (1009.9 + 0.12)
    span = 9.9 + 0.100 + 0.020
    assert s["duration_s"] == pytest.approx(span)
    assert s["output_tokens"] == 1100
    assert s["output_tokens_per_s"] == pytest.approx(1100 / span)
    assert s["request_rate_rps"] == pytest.approx(100 / span)
    assert math.isnan(s["send_lag_p99_ms"]) and math.isnan(s["late_fraction"])  # closed loop


def test_tpot_only_from_requests_that_have_one():
    records = [record(0, tpot_s=None, output_tokens=1), record(1, tpot_s=0.004), record(2, tpot_s=0.006)]
    assert summarize(records)["tpot_p50_ms"] == pytest.approx(5.0)


def test_empty_and_all_failed():
    assert summarize([])["requests"] == 0
    s = summarize([record(0, status=0, error="ConnectionError")])
    assert s["ok"] == 0 and s["error_rate"] == 1.0 and math.isnan(s["ttft_p50_ms"])


def test_warmup_drops_the_first_seconds():
    records = [record(i) for i in range(100)]  # starts 0.0 .. 9.9 s
    s = summarize(records, warmup_s=5.0)
    assert s["ok"] == 50
    assert s["ttft_p50_ms"] == pytest.approx(75.5)


def test_open_loop_lateness():
    records = [record(i, send_lag_s=0.001) for i in range(9)] + [record(9, send_lag_s=0.5)]
    s = summarize(records)
    assert s["late_fraction"] == pytest.approx(0.1)
    assert s["send_lag_p99_ms"] == pytest.approx(percentile([0.001] * 9 + [0.5], 99) * 1000)


def test_groups_by_step_in_step_order():
    records = [
        record(0, step="c=16", step_index=2),
        record(1, step="c=1", step_index=0),
        record(2, step="c=4", step_index=1),
        record(3, step="c=1", step_index=0),
        record(4),  # no step
    ]
    groups = group_records(records, "step")
    assert [(k, len(v)) for k, v in groups] == [("c=1", 2), ("c=4", 1), ("c=16", 1), ("all", 1)]
    assert [row["group"] for row in summarize_by(records, "profile")] == ["structured"]
    assert [row["group"] for row in summarize_by(records, "none")] == ["all"]


# --------------------------------------------------------------------------------------------------------
# The file and the CLI
# --------------------------------------------------------------------------------------------------------


def test_load_records_reads_gzip(tmp_path):
    import gzip

    path = tmp_path / "raw.jsonl.gz"
    with gzip.open(path, "wt") as f:
        f.write(json.dumps(record(0)) + "\n")
    assert load_records(path) == [record(0)]


def test_load_records_and_cli(tmp_path, capsys):
    path = tmp_path / "raw.jsonl"
    lines = [json.dumps(record(i, step="c=2", step_index=0)) for i in range(10)]
    path.write_text("\n".join(lines[:5]) + "\n\n" + "\n".join(lines[5:]) + "\n")
    assert len(load_records(path)) == 10
    assert main([str(path)]) == 0
    table = capsys.readouterr().out
    assert "| c=2 | 10 | 0.0% | 5.5 |" in table
    assert main([str(path), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows[0]["group"] == "c=2" and rows[0]["ttft_p50_ms"] == pytest.approx(5.5)
    assert main([str(path), "--run", "other", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == []  # an unknown run selects nothing


def test_malformed_line_is_named(tmp_path):
    path = tmp_path / "raw.jsonl"
    path.write_text(json.dumps(record(0)) + "\n{not json\n")
    with pytest.raises(ValueError, match=r"raw.jsonl:2: not a JSON object"):
        load_records(path)


# --------------------------------------------------------------------------------------------------------
# Prometheus histogram quantiles
# --------------------------------------------------------------------------------------------------------


def test_histogram_quantile_interpolates_within_the_bucket():
    cumulative = {0.1: 10.0, 0.2: 30.0, 0.5: 40.0, math.inf: 40.0}
    h = histogram_quantile(cumulative, 0.5)  # rank 20: halfway through the (0.1, 0.2] bucket
    assert (h.value, h.lower, h.upper, h.count) == (pytest.approx(0.15), 0.1, 0.2, 40.0)
    assert histogram_quantile(cumulative, 0.25).value == pytest.approx(0.1)  # rank 10: the bucket's top
    assert histogram_quantile(cumulative, 0.1).value == pytest.approx(0.04)  # first bucket starts at 0
    assert histogram_quantile(cumulative, 1.0).value == pytest.approx(0.5)


def test_histogram_quantile_in_the_inf_bucket_and_empty():
    h = histogram_quantile({0.1: 1.0, math.inf: 10.0}, 0.5)
    assert (h.value, h.lower, h.upper) == (0.1, 0.1, math.inf)
    assert math.isnan(histogram_quantile({0.1: 0.0, math.inf: 0.0}, 0.5).value)
    assert math.isnan(histogram_quantile({}, 0.5).value)
    with pytest.raises(ValueError, match=r"q must be in \[0, 1\]"):
        histogram_quantile({1.0: 1.0}, 50)


def test_histogram_quantile_brackets_the_exact_median():
    from serve_app.serving.metrics import LATENCY_BUCKETS_S

    samples = [0.012 + 0.0007 * ((i * 37) % 101) for i in range(101)]  # 12 .. 82 ms
    bounds = [*LATENCY_BUCKETS_S, math.inf]
    cumulative = {b: float(sum(s <= b for s in samples)) for b in bounds}
    h = histogram_quantile(cumulative, 0.5)
    exact = percentile(samples, 50)
    assert h.lower <= exact <= h.upper
    assert abs(h.value - exact) <= h.upper - h.lower


def test_bucket_increase():
    before = {0.1: 5.0, 0.2: 7.0, math.inf: 8.0}
    after = {0.1: 9.0, 0.2: 12.0, math.inf: 14.0}
    assert bucket_increase(before, after) == {0.1: 4.0, 0.2: 5.0, math.inf: 6.0}
    assert bucket_increase({}, after) == after
