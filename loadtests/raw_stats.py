"""Exact statistics from the locustfile's raw per-request JSONL file (Locust rounds its own percentiles).

One JSON object per line, one line per request (see loadtests/locustfile.py for every field); the ones
used here: start_s (wall clock at send), ttft_s, tpot_s, e2e_s, itl_mean_s, itl_max_s, output_tokens,
status, error, step and step_index (a concurrency-ladder or arrival-rate step, when the run had one),
send_lag_s (open loop: how late the request left against its scheduled arrival) and run.

Percentiles are loadtests/measure.py's (linear between order statistics, numpy's default), over
successful requests only: status 200 and no error. TPOT exists
only for requests with at least two output tokens, ITL for those with at least two streamed chunks.
Throughput is output tokens of successful requests divided by the group's span, first send to last
byte; at a ladder step boundary a request belongs to the step it started in.

`histogram_quantile` estimates a quantile from Prometheus cumulative buckets, as PromQL's
histogram_quantile does, so a run can be checked against the server's own histograms.

    python -m loadtests.raw_stats RAW.jsonl [--by step|profile|none] [--warmup-s 5] [--json]
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loadtests.measure import after_warmup, percentile

QUANTILES = (50, 90, 95, 99)
LATENCIES = ("ttft", "tpot", "e2e", "itl_mean", "itl_max")


def load_records(path: str | Path) -> list[dict[str, Any]]:
    """The raw file's records in file order (a .gz file is read through gzip); blank lines skipped, a
    malformed line named by number."""
    records = []
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{number}: not a JSON object ({e.msg})") from None
            if not isinstance(record, dict):
                raise ValueError(f"{path}:{number}: expected a JSON object, got {type(record).__name__}")
            records.append(record)
    return records


def is_success(record: Mapping[str, Any]) -> bool:
    return record.get("status") == 200 and not record.get("error")


def _values(records: Iterable[Mapping[str, Any]], key: str) -> list[float]:
    return [float(r[key]) for r in records if r.get(key) is not None]


def summarize(records: Sequence[Mapping[str, Any]], warmup_s: float = 0.0) -> dict[str, Any]:
    """Counts, error rate, exact latency percentiles (ms), throughput; `warmup_s` drops the first seconds.

    Keys: requests, ok, errors, error_rate, duration_s, request_rate_rps, output_tokens,
    output_tokens_per_s, mean_output_tokens, {ttft,tpot,e2e,itl_mean,itl_max}_{p50,p90,p95,p99,mean}_ms,
    send_lag_p99_ms and late_fraction (share of open-loop requests sent > 10 ms after their slot).
    """
    keep = after_warmup([float(r["start_s"]) for r in records], warmup_s)
    records = [r for r, counted in zip(records, keep, strict=True) if counted]
    ok = [r for r in records if is_success(r)]
    out: dict[str, Any] = {
        "requests": len(records),
        "ok": len(ok),
        "errors": len(records) - len(ok),
        "error_rate": (len(records) - len(ok)) / len(records) if records else math.nan,
    }
    if ok:
        start = min(float(r["start_s"]) for r in ok)
        end = max(float(r["start_s"]) + float(r["e2e_s"]) for r in ok)
        duration = end - start
    else:
        duration = math.nan
    tokens = sum(int(r.get("output_tokens") or 0) for r in ok)
    out["duration_s"] = duration
    out["request_rate_rps"] = len(ok) / duration if duration and duration > 0 else math.nan
    out["output_tokens"] = tokens
    out["output_tokens_per_s"] = tokens / duration if duration and duration > 0 else math.nan
    out["mean_output_tokens"] = tokens / len(ok) if ok else math.nan
    for name in LATENCIES:
        values = _values(ok, f"{name}_s")
        for q in QUANTILES:
            out[f"{name}_p{q}_ms"] = percentile(values, q) * 1000
        out[f"{name}_mean_ms"] = sum(values) / len(values) * 1000 if values else math.nan
    lags = _values(records, "send_lag_s")
    out["send_lag_p99_ms"] = percentile(lags, 99) * 1000 if lags else math.nan
    out["late_fraction"] = sum(lag > 0.010 for lag in lags) / len(lags) if lags else math.nan
    return out


def group_records(records: Sequence[Mapping[str, Any]], by: str) -> list[tuple[str, list[Mapping[str, Any]]]]:
    """Records grouped by `by` ('step', 'profile', 'run', ...), groups in order of step_index or first
    appearance; records without the key form the group 'all'. by='none' gives one group 'all'."""
    if by == "none":
        return [("all", list(records))]
    groups: dict[str, list[Mapping[str, Any]]] = {}
    order: dict[str, tuple[float, int]] = {}
    for i, r in enumerate(records):
        label = r.get(by)
        key = "all" if label is None else str(label)
        groups.setdefault(key, []).append(r)
        if key not in order:
            index = r.get("step_index") if by == "step" else None
            order[key] = (float(index) if index is not None else math.inf, i)
    return [(key, groups[key]) for key in sorted(groups, key=lambda k: order[k])]


def summarize_by(records: Sequence[Mapping[str, Any]], by: str = "step", warmup_s: float = 0.0) -> list[dict]:
    """One summary per group (see group_records), each with a leading 'group' key."""
    return [{"group": key, **summarize(rs, warmup_s)} for key, rs in group_records(records, by)]


# --------------------------------------------------------------------------------------------------------
# Prometheus histograms
# --------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class HistogramQuantile:
    value: float  # linear interpolation within the bucket, as PromQL's histogram_quantile
    lower: float  # the bucket's bounds: the true quantile lies in [lower, upper]
    upper: float
    count: float


def histogram_quantile(cumulative: Mapping[float, float], q: float) -> HistogramQuantile:
    """Quantile q (0..1) from Prometheus cumulative bucket counts {le upper bound: count}.

    The first bucket's lower bound is 0. A quantile that falls in the +Inf bucket returns the largest
    finite bound (PromQL does the same) with upper = inf. An empty histogram gives NaN.
    """
    if not 0 <= q <= 1:
        raise ValueError(f"q must be in [0, 1], got {q}")
    bounds = sorted(cumulative)
    total = cumulative[bounds[-1]] if bounds else 0.0
    if not bounds or total <= 0:
        return HistogramQuantile(math.nan, math.nan, math.nan, 0.0)
    rank = q * total
    lower, below = 0.0, 0.0
    for upper in bounds:
        count = cumulative[upper]
        if count >= rank and count > below:
            if math.isinf(upper):
                return HistogramQuantile(lower, lower, upper, total)
            value = lower + (upper - lower) * (rank - below) / (count - below)
            return HistogramQuantile(value, lower, upper, total)
        lower, below = upper, count
    return HistogramQuantile(lower, lower, math.inf, total)  # unreachable with a +Inf bucket


def bucket_increase(before: Mapping[float, float], after: Mapping[float, float]) -> dict[float, float]:
    """Per-bucket increase of a cumulative histogram between two scrapes (counters only grow)."""
    return {le: after[le] - before.get(le, 0.0) for le in after}


# --------------------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------------------

_COLUMNS = (
    ("group", "group", "{}"),
    ("ok", "ok", "{}"),
    ("err%", "error_rate", "{:.1%}"),
    ("TTFT p50", "ttft_p50_ms", "{:.1f}"),
    ("p90", "ttft_p90_ms", "{:.1f}"),
    ("p95", "ttft_p95_ms", "{:.1f}"),
    ("p99", "ttft_p99_ms", "{:.1f}"),
    ("TPOT p50", "tpot_p50_ms", "{:.2f}"),
    ("p95", "tpot_p95_ms", "{:.2f}"),
    ("p99", "tpot_p99_ms", "{:.2f}"),
    ("E2E p50", "e2e_p50_ms", "{:.0f}"),
    ("p99", "e2e_p99_ms", "{:.0f}"),
    ("ITL max p99", "itl_max_p99_ms", "{:.1f}"),
    ("out tok/s", "output_tokens_per_s", "{:.1f}"),
    ("req/s", "request_rate_rps", "{:.2f}"),
)


def format_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """A Markdown table of summaries (latencies in ms)."""
    header = "| " + " | ".join(title for title, _, _ in _COLUMNS) + " |"
    rule = "|" + "|".join("---" for _ in _COLUMNS) + "|"
    lines = [header, rule]
    for row in rows:
        cells = []
        for _, key, fmt in _COLUMNS:
            v = row.get(key)
            cells.append("-" if v is None or (isinstance(v, float) and math.isnan(v)) else fmt.format(v))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Exact TTFT/TPOT/E2E percentiles from a raw JSONL file.")
    parser.add_argument("raw", type=Path, help="the locustfile's --raw-file")
    parser.add_argument(
        "--by", default="step", help="group by a record field: step (default), profile, run, none"
    )
    parser.add_argument("--run", default=None, help="only this run id (the raw file is appended to by runs)")
    parser.add_argument("--warmup-s", type=float, default=0.0, help="drop each group's first seconds")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)
    records = load_records(args.raw)
    if args.run is not None:
        records = [r for r in records if r.get("run") == args.run]
    rows = summarize_by(records, args.by, args.warmup_s)
    if args.json:
        json.dump(rows, sys.stdout, indent=2)
        print()
    else:
        print(format_table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
