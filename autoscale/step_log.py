"""Step costs fitted to an engine's own step log, not to closed-loop latency percentiles.

A replica logs each engine step as vLLM's stat logger reports it (serve_app/serving/metrics.py
``EngineStep``: when its outputs arrived, its prompt and generated tokens, and the scheduler's running,
waiting and KV-cache state it started from). While the engine is busy, the time between two reports is a
step's duration, so :class:`~autoscale.calibration.EngineCost`'s linear step model is a least-squares problem:

    duration = step_ms + prefill_ms_per_token * P + decode_ms_per_seq * D + attention_ms_per_kv_token * K

with P the step's prompt tokens, D its generated tokens (one per decoding sequence, plus the first tokens
of the prompts it completed) and K the KV cache's tokens in use. One step's own gap is a noisy measure
of it: outputs reach the replica through a queue, so a slow step's report can come late and the next one
early. Sums over windows of consecutive busy steps cancel that, and so they are what is fitted
(non-negative: each cost is a cost). The fit is linear with one minimum; the coordinate search over
percentiles (autoscale/calibrate.py) stops wherever its start leads it (results/autoscale/experiments/
replay_cross_fit.txt). What the step log cannot give, the way in and out of a request
(``request_overhead_ms``), is still fitted to the closed loops' TTFT. How it predicts H100 replays:
results/autoscale/experiments/step_log_fit.txt.

Pure: numpy.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

__all__ = ["STEP_WINDOW", "StepCosts", "fit_step_costs", "step_windows"]

STEP_WINDOW = 30
"""Consecutive busy steps summed into one observation."""

StepCosts = dict[str, float]
"""``step_ms``, ``prefill_ms_per_token``, ``decode_ms_per_seq``, ``attention_ms_per_kv_token``."""

COLUMNS = ("step_ms", "prefill_ms_per_token", "decode_ms_per_seq", "attention_ms_per_kv_token")


def step_windows(
    steps: Sequence[Mapping[str, Any]], kv_cache_tokens: int, window: int = STEP_WINDOW
) -> tuple[np.ndarray, np.ndarray]:
    """One row per ``window`` consecutive busy steps of one log: their summed duration (ms) and the sums of
    (steps, P, D, K). A step is busy when the state it started from had a request running or waiting; an
    idle gap ends the run of busy steps, and a run's last steps (fewer than ``window``) make a row of their
    own: the row counts its steps, and a lone request's run is shorter than a window."""
    durations: list[float] = []
    rows: list[list[float]] = []
    run: list[list[float]] = []
    run_ms = 0.0

    def close_window() -> None:
        nonlocal run, run_ms
        if run:
            durations.append(run_ms)
            rows.append(np.sum(run, axis=0).tolist())
        run, run_ms = [], 0.0

    for before, step in itertools.pairwise(steps):
        if step["num_running"] + step["num_waiting"] == 0:
            close_window()
            continue
        run_ms += (step["at_s"] - before["at_s"]) * 1000.0
        kv = step["kv_cache_usage"] * kv_cache_tokens
        run.append([1.0, step["prompt_tokens"], step["generation_tokens"], kv])
        if len(run) == window:
            close_window()
    close_window()
    return np.asarray(durations, dtype=float), np.asarray(rows, dtype=float).reshape(-1, len(COLUMNS))


def _nonnegative_least_squares(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Exact for a few columns: the best least-squares solution over every set of columns left free whose
    solution is non-negative (the others held at zero); the step cost is always free."""
    best, best_sse = np.zeros(x.shape[1]), np.inf
    others = range(1, x.shape[1])
    for k in range(len(others) + 1):
        for free in itertools.combinations(others, k):
            cols = [0, *free]
            sol, *_ = np.linalg.lstsq(x[:, cols], y, rcond=None)
            if (sol < 0).any():
                continue
            coef = np.zeros(x.shape[1])
            coef[cols] = sol
            sse = float(np.sum((x @ coef - y) ** 2))
            if sse < best_sse:
                best, best_sse = coef, sse
    return best


def fit_step_costs(logs: Iterable[Mapping[str, Any]], window: int = STEP_WINDOW) -> StepCosts:
    """The linear step model's costs (ms) fitted to the busy windows of every log (see the module doc). A
    log is a replica's ``engine_steps``: ``{"kv_cache_tokens", "steps"}``; each log's KV term is counted in
    its own engine's cache, which differs by a few blocks between replicas and restarts of one config."""
    parts = [step_windows(log["steps"], log["kv_cache_tokens"], window) for log in logs]
    y = np.concatenate([d for d, _ in parts]) if parts else np.empty(0)
    if len(y) < len(COLUMNS):
        raise ValueError(f"the step logs hold {len(y)} windows of busy steps; the fit needs {len(COLUMNS)}")
    x = np.vstack([rows for _, rows in parts])
    coef = _nonnegative_least_squares(x, y)
    if coef[0] <= 0:
        raise ValueError("the step logs give no positive cost per step (are they from a busy engine?)")
    return dict(zip(COLUMNS, (float(c) for c in coef), strict=True))
