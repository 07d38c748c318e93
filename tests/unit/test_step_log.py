"""Step costs fitted to an engine's step log (autoscale/step_log.py): a log written by a known linear engine
gives its costs back, also when each report is late by a random part of the next step, as vLLM's output
queue makes them."""

from __future__ import annotations

import numpy as np
import pytest

from autoscale.step_log import STEP_WINDOW, fit_step_costs, step_windows

KV_TOKENS = 400_000
TRUE = {
    "step_ms": 6.6,
    "prefill_ms_per_token": 0.022,
    "decode_ms_per_seq": 0.01,
    "attention_ms_per_kv_token": 5.6e-5,
}


def engine_log(
    n: int,
    seed: int,
    late_fraction: float = 0.0,
    idle_every: int = 0,
    prompts: tuple[int, ...] = (0, 0, 1024, 2048, 8192),
    kv_tokens: int = KV_TOKENS,
) -> list[dict]:
    """Steps of an engine whose step time is TRUE's linear model; each report arrives up to
    ``late_fraction`` of the next step late (the next report is not: the delay moves time between the
    two gaps), and every ``idle_every`` steps the engine idles for a second."""
    rng = np.random.default_rng(seed)
    at, steps = 1_000.0, []
    for i in range(n):
        idle = bool(idle_every) and i % idle_every == 0
        running = 0 if idle else int(rng.integers(1, 256))
        prompt = int(rng.choice(prompts)) if running else 0
        generated = running
        usage = running * float(rng.uniform(1024, 1152)) / kv_tokens
        ms = (
            TRUE["step_ms"]
            + TRUE["prefill_ms_per_token"] * prompt
            + TRUE["decode_ms_per_seq"] * generated
            + TRUE["attention_ms_per_kv_token"] * usage * kv_tokens
        )
        at += 1.0 if idle else ms / 1000.0
        late_s = float(rng.uniform(0, late_fraction)) * ms / 1000.0
        steps.append(
            {
                "at_s": at + late_s,
                "prompt_tokens": prompt,
                "generation_tokens": generated,
                "num_running": running,
                "num_waiting": 0,
                "kv_cache_usage": usage,
            }
        )
    return steps


def replica_log(steps: list[dict], kv_tokens: int = KV_TOKENS) -> dict:
    """A replica's ``engine_steps``."""
    return {"kv_cache_tokens": kv_tokens, "block_size": 16, "steps": steps}


def test_an_exact_log_gives_its_engine_back():
    costs = fit_step_costs([replica_log(engine_log(400, seed=1))], window=1)
    assert costs == pytest.approx(TRUE, rel=1e-6)


def test_logs_of_engines_with_different_kv_caches_are_fitted_together():
    """Replicas (and restarts) of one config get KV caches a few blocks apart; each log's KV term is counted
    in its own cache, so the pooled fit is still exact (counted in one of them, it is not)."""
    small = 396_720
    logs = [
        replica_log(engine_log(300, seed=10)),
        replica_log(engine_log(300, seed=11, kv_tokens=small), small),
    ]
    assert fit_step_costs(logs, window=1) == pytest.approx(TRUE, rel=1e-6)
    mislabelled = [logs[0], replica_log(logs[1]["steps"])]
    assert fit_step_costs(mislabelled, window=1) != pytest.approx(TRUE, rel=1e-3)


def test_windows_cancel_late_reports_that_single_steps_do_not():
    """A late report shifts time from one step's gap to the next one's; the log's decode and KV columns move
    together (as on a GPU), so what is checked is the prefill cost and the time the fit gives a fresh log."""
    logs = [replica_log(engine_log(10_000, seed=2, late_fraction=0.3))]
    windowed = fit_step_costs(logs)
    single = fit_step_costs(logs, window=1)
    assert windowed["prefill_ms_per_token"] == pytest.approx(TRUE["prefill_ms_per_token"], rel=0.03)
    assert single["prefill_ms_per_token"] > 1.1 * TRUE["prefill_ms_per_token"]
    # A log of another mix, decode steps alone: the single steps' fit put part of their time on prompts.
    durations, rows = step_windows(engine_log(2_000, seed=6, prompts=(0,)), KV_TOKENS, window=1)
    assert busy_ms(windowed, rows) == pytest.approx(durations.sum(), rel=0.03)
    assert busy_ms(single, rows) < 0.9 * durations.sum()


def busy_ms(costs: dict[str, float], rows: np.ndarray) -> float:
    return float((rows @ np.array([costs[n] for n in TRUE])).sum())


def test_idle_gaps_are_left_out_and_a_short_run_kept_as_a_shorter_window():
    log = engine_log(101, seed=3, idle_every=25)
    durations, rows = step_windows(log, KV_TOKENS, window=10)
    # Four busy runs of 24 steps (the first step's gap has no step before it): 10, 10 and 4 steps each.
    assert rows[:, 0].tolist() == [10, 10, 4] * 4
    assert durations.max() < 1000.0  # no idle second inside a window
    assert fit_step_costs([replica_log(log)], window=10) == pytest.approx(TRUE, rel=1e-6)


def test_a_cost_the_log_would_make_negative_is_held_at_zero():
    log = engine_log(500, seed=4)
    for step in log:  # a step costs less the more sequences decode: no engine does that
        step["generation_tokens"] = 300 - step["num_running"]
    costs = fit_step_costs([replica_log(log)], window=1)
    assert costs["decode_ms_per_seq"] == 0.0 and min(costs.values()) >= 0.0


def test_too_short_a_log_is_refused():
    with pytest.raises(ValueError, match="windows of busy steps"):
        fit_step_costs([replica_log(engine_log(STEP_WINDOW * 3, seed=5)[: STEP_WINDOW * 3 // 2])])
