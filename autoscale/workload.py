"""Request-level traces: when each request arrives, its prompt length and its output length.

Two sources:

* synthetic shapes (constant, step, diurnal, bursty): an arrival-rate curve, Poisson arrivals on it, and
  lognormal prompt and output lengths (:class:`LengthModel`), all drawn from a seed;
* a CSV with the columns ``TIMESTAMP,ContextTokens,GeneratedTokens``, the format of the public Azure LLM
  inference traces (TIMESTAMP as seconds or as a date-time), replayed as recorded or with ``rate_scale``
  to size the load to a fleet.

Pure: numpy and the standard library.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import numpy as np

__all__ = [
    "CSV_COLUMNS",
    "LengthModel",
    "RequestTrace",
    "bursty_rate",
    "constant_rate",
    "diurnal_rate",
    "read_trace_csv",
    "scale_rate",
    "step_rate",
    "synthesize",
    "write_trace_csv",
]

CSV_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")

RateCurve = Callable[[np.ndarray], np.ndarray]
"""Arrival rate (requests/s) at each of an array of times (s)."""


@dataclass(frozen=True, eq=False)
class RequestTrace:
    """Requests sorted by arrival: times in seconds from the trace's start, lengths in tokens."""

    name: str
    arrival_s: np.ndarray
    prompt_tokens: np.ndarray
    output_tokens: np.ndarray
    duration_s: float
    description: str = ""

    def __post_init__(self) -> None:
        n = len(self.arrival_s)
        if not len(self.prompt_tokens) == len(self.output_tokens) == n:
            raise ValueError(f"trace {self.name!r}: arrival, prompt and output arrays differ in length")
        if n and (np.any(np.diff(self.arrival_s) < 0) or self.arrival_s[0] < 0):
            raise ValueError(f"trace {self.name!r}: arrivals must be sorted and >= 0")
        if n and (self.prompt_tokens.min() < 1 or self.output_tokens.min() < 1):
            raise ValueError(f"trace {self.name!r}: every request needs >= 1 prompt and output token")

    @property
    def requests(self) -> int:
        return len(self.arrival_s)

    def rate_per_bin(self, bin_s: float = 60.0) -> np.ndarray:
        """Mean arrival rate (requests/s) in consecutive bins of ``bin_s``."""
        bins = max(1, math.ceil(self.duration_s / bin_s))
        counts = np.bincount(np.minimum((self.arrival_s // bin_s).astype(np.int64), bins - 1), minlength=bins)
        return counts / bin_s

    @property
    def mean_rps(self) -> float:
        return self.requests / self.duration_s if self.duration_s else 0.0

    def peak_rps(self, bin_s: float = 60.0) -> float:
        """Highest mean rate over ``bin_s`` (one minute by default)."""
        return float(self.rate_per_bin(bin_s).max()) if self.requests else 0.0

    def head(self, duration_s: float) -> RequestTrace:
        """The first ``duration_s`` seconds."""
        n = int(np.searchsorted(self.arrival_s, duration_s))
        return RequestTrace(
            self.name,
            self.arrival_s[:n],
            self.prompt_tokens[:n],
            self.output_tokens[:n],
            min(duration_s, self.duration_s),
            self.description,
        )


# --------------------------------------------------------------------------------------------------------
# Synthetic traces
# --------------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LengthModel:
    """Lognormal prompt and output lengths (medians and sigmas), clipped to the model's context.

    The default is an assumption shaped like chat traffic (conversation prompts around a thousand tokens
    with a long tail, answers of a few hundred), not a measurement of any deployment."""

    prompt_median: float = 1000.0
    prompt_sigma: float = 0.8
    output_median: float = 200.0
    output_sigma: float = 0.8
    max_model_len: int = 8192
    min_tokens: int = 1

    def draw(self, rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
        prompt = rng.lognormal(math.log(self.prompt_median), self.prompt_sigma, n)
        output = rng.lognormal(math.log(self.output_median), self.output_sigma, n)
        prompt = np.clip(np.rint(prompt), self.min_tokens, self.max_model_len - 1).astype(np.int64)
        output = np.clip(np.rint(output), 1, None).astype(np.int64)
        return prompt, np.minimum(output, self.max_model_len - prompt)


def constant_rate(rps: float) -> RateCurve:
    return lambda t: np.full(t.shape, float(rps))


def step_rate(low_rps: float, high_rps: float, up_at_s: float, down_at_s: float) -> RateCurve:
    return lambda t: np.where((t >= up_at_s) & (t < down_at_s), high_rps, low_rps).astype(float)


def diurnal_rate(mean_rps: float, amplitude_rps: float, period_s: float) -> RateCurve:
    """A compressed day: a sinusoid starting at its trough."""
    return lambda t: np.maximum(mean_rps - amplitude_rps * np.cos(2.0 * math.pi * t / period_s), 0.0)


def bursty_rate(
    base_rps: float,
    duration_s: float,
    seed: int,
    mean_gap_s: float = 900.0,
    amplitude: tuple[float, float] = (0.5, 1.2),
    ramp_s: float = 120.0,
    hold_s: tuple[float, float] = (180.0, 600.0),
) -> RateCurve:
    """A base load with seeded bursts: Poisson burst starts (mean gap ``mean_gap_s``), each adding
    ``uniform(*amplitude) * base_rps`` that ramps up over ``ramp_s``, holds ``uniform(*hold_s)`` and ramps
    down over ``ramp_s``. Bursts may overlap (they add)."""
    rng = np.random.default_rng([seed, 7])
    bursts: list[tuple[float, float, float]] = []
    start = float(rng.exponential(mean_gap_s))
    while start < duration_s:
        bursts.append((start, float(rng.uniform(*hold_s)), float(rng.uniform(*amplitude)) * base_rps))
        start += float(rng.exponential(mean_gap_s))

    def rate(t: np.ndarray) -> np.ndarray:
        out = np.full(t.shape, float(base_rps))
        for begin, hold, amp in bursts:
            up = np.clip((t - begin) / ramp_s, 0.0, 1.0)
            down = np.clip((begin + 2 * ramp_s + hold - t) / ramp_s, 0.0, 1.0)
            out += amp * up * down
        return out

    return rate


def synthesize(
    name: str,
    rate: RateCurve,
    duration_s: float,
    seed: int,
    lengths: LengthModel = LengthModel(),
    description: str = "",
) -> RequestTrace:
    """Poisson arrivals on ``rate`` (thinning a homogeneous process at the curve's peak) with lengths
    from ``lengths``; the same seed gives the same requests."""
    rng = np.random.default_rng([seed, 1])
    grid = np.arange(0.0, duration_s, 1.0)
    peak = float(np.max(rate(grid))) if len(grid) else 0.0
    if peak <= 0:
        empty = np.zeros(0, dtype=np.int64)
        return RequestTrace(name, np.zeros(0), empty, empty, duration_s, description)
    n = int(rng.poisson(peak * duration_s))
    times = np.sort(rng.uniform(0.0, duration_s, n))
    keep = rng.uniform(0.0, peak, n) < rate(times)
    arrival = times[keep]
    prompt, output = lengths.draw(rng, len(arrival))
    return RequestTrace(name, arrival, prompt, output, duration_s, description)


def scale_rate(trace: RequestTrace, rate_scale: float, seed: int = 0) -> RequestTrace:
    """The same load shape at ``rate_scale`` times the rate over the same duration: every request is
    kept ``floor(rate_scale)`` times plus once more with probability ``rate_scale % 1``; above 1x every
    copy moves by a uniform offset of up to one second, so copies do not arrive together."""
    if rate_scale <= 0:
        raise ValueError(f"rate_scale ({rate_scale}) must be > 0")
    rng = np.random.default_rng([seed, 2])
    copies = np.floor(rate_scale) + (rng.uniform(size=trace.requests) < rate_scale % 1.0)
    idx = np.repeat(np.arange(trace.requests), copies.astype(np.int64))
    arrival = trace.arrival_s[idx]
    if rate_scale > 1:
        arrival = np.minimum(arrival + rng.uniform(0.0, 1.0, len(idx)), np.nextafter(trace.duration_s, 0))
    order = np.argsort(arrival, kind="stable")
    return RequestTrace(
        trace.name,
        arrival[order],
        trace.prompt_tokens[idx][order],
        trace.output_tokens[idx][order],
        trace.duration_s,
        f"{trace.description} x{rate_scale:g} rate".strip(),
    )


# --------------------------------------------------------------------------------------------------------
# CSV: TIMESTAMP,ContextTokens,GeneratedTokens
# --------------------------------------------------------------------------------------------------------


def _seconds(stamp: str) -> float:
    try:
        return float(stamp)
    except ValueError:
        # Azure's traces write "2023-11-16 18:15:46.6805900": seven fractional digits, more than
        # datetime parses; keep microseconds.
        head, _, frac = stamp.strip().partition(".")
        return datetime.fromisoformat(f"{head}.{(frac + '000000')[:6]}" if frac else head).timestamp()


def read_trace_csv(path: str | Path, name: str | None = None, description: str = "") -> RequestTrace:
    """A trace from a CSV with the columns ``TIMESTAMP,ContextTokens,GeneratedTokens`` (header required;
    other columns ignored). Times start at the first request; the duration ends at the last."""
    rows: list[tuple[float, int, int]] = []
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        if reader.fieldnames is None or not set(CSV_COLUMNS) <= set(reader.fieldnames):
            raise ValueError(
                f"{path}: needs a header with columns {','.join(CSV_COLUMNS)}, got {reader.fieldnames}"
            )
        for i, row in enumerate(reader, start=2):
            try:
                rows.append(
                    (_seconds(row["TIMESTAMP"]), int(row["ContextTokens"]), int(row["GeneratedTokens"]))
                )
            except ValueError as e:
                raise ValueError(f"{path}:{i}: {e}") from None
    if not rows:
        raise ValueError(f"{path}: no requests")
    rows.sort()
    t0 = rows[0][0]
    arrival = np.array([r[0] - t0 for r in rows])
    prompt = np.maximum(np.array([r[1] for r in rows], dtype=np.int64), 1)
    output = np.maximum(np.array([r[2] for r in rows], dtype=np.int64), 1)
    duration = float(math.ceil(arrival[-1] + 1e-9)) or 1.0
    return RequestTrace(name or Path(path).stem, arrival, prompt, output, duration, description)


def write_trace_csv(trace: RequestTrace, path: str | Path) -> Path:
    """Writes ``trace`` as ``TIMESTAMP,ContextTokens,GeneratedTokens`` (TIMESTAMP in seconds)."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(CSV_COLUMNS)
        for t, p, g in zip(trace.arrival_s, trace.prompt_tokens, trace.output_tokens, strict=True):
            w.writerow((f"{t:.3f}", int(p), int(g)))
    return out
