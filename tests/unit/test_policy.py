"""The TTFT-headroom decision: table-driven cases from small builders, time from a fake clock. Every case
asserts the reason code and the exact replica count."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from pydantic import ValidationError

from autoscale.capacity import ServiceEstimate
from autoscale.inputs import MetricsSnapshot, PolicyConfig, ReplicaMetrics
from autoscale.policy import Decision, PolicyState, decide
from autoscale.settings import AutoscalingSettings, SettingsProblems

# --------------------------------------------------------------------------------------------------------
# Builders
# --------------------------------------------------------------------------------------------------------

SLOTS = 100
# 10 ms of work per request, 4 ms per step, 100 output tokens: at the targets below one replica is planned
# for max(0.010 / 0.8, 0.010 + 100 * 0.004 / (100 * 0.8)) = 0.015 s per request, 66.7 requests/s.
SEED = ServiceEstimate(step_ms=4.0, work_ms_per_request=10.0, output_tokens_per_request=100.0, source="seed")
CAPACITY_RPS = 1 / 0.015


def config(seed: ServiceEstimate | None = SEED, **overrides: Any) -> PolicyConfig:
    base: dict[str, Any] = {
        "min_replicas": 1,
        "max_replicas": 20,
        "replica_startup_s": 90.0,
        "window_s": 10.0,
        "upscale_cooldown_s": 60.0,
        "downscale_sustain_s": 300.0,
        "downscale_cooldown_s": 60.0,
        "scale_up_headroom": 0.2,
        "scale_down_headroom": 0.5,
        "target_engine_utilization": 0.8,
        "target_slot_utilization": 0.8,
        "downscale_margin": 0.1,
        "spare_replicas": 0,
        "max_step_up": 4,
        "trend_window_s": 60.0,
        "trend_min_t_stat": 3.0,
    }
    base.update(overrides)
    return PolicyConfig(
        AutoscalingSettings(**base), ttft_target_ms=500.0, max_num_seqs=SLOTS, capacity_seed=seed
    )


def replica(
    i: int = 0,
    p95: float | None = 200.0,
    running: int = 30,
    waiting: int = 0,
    kv: float = 0.2,
    **engine: float,
) -> ReplicaMetrics:
    return ReplicaMetrics(
        replica_id=f"r{i}",
        ttft_p50_ms=None if p95 is None else p95 / 1.6,
        ttft_p95_ms=p95,
        ttft_samples=100 if p95 is not None else 0,
        num_requests_running=running,
        num_requests_waiting=waiting,
        kv_cache_usage=kv,
        **engine,
    )


def snapshot(
    now: float = 1000.0,
    *,
    p95: float | None = 200.0,
    rate: float | None = 100.0,
    current: int = 4,
    target: int | None = None,
    starting: int = 0,
    queued: int = 0,
    age_s: float = 0.0,
    running: int = 30,
    kv: float = 0.2,
    replicas: tuple[ReplicaMetrics, ...] | None = None,
) -> MetricsSnapshot:
    reps = (
        replicas if replicas is not None else tuple(replica(i, p95, running, kv=kv) for i in range(current))
    )
    return MetricsSnapshot(
        now_s=now,
        taken_at_s=now - age_s,
        replicas=reps,
        arrival_rate_rps=rate,
        current_replicas=current,
        target_replicas=current + starting if target is None else target,
        replicas_starting=starting,
        queued_at_router=queued,
        window_s=10.0,
    )


class FakeClock:
    def __init__(self, start_s: float = 1000.0) -> None:
        self.now_s = start_s

    def tick(self, s: float) -> float:
        self.now_s += s
        return self.now_s


def steady_history(
    rate: float, until_s: float = 1000.0, span_s: float = 900.0
) -> tuple[tuple[float, float], ...]:
    """A flat rate history every 10 s (as if the policy had watched the fleet for span_s)."""
    start = until_s - span_s
    return tuple((start + 10.0 * i, rate) for i in range(int(span_s // 10)))


def run(
    cfg: PolicyConfig, seconds: float, every_s: float = 10.0, state: PolicyState | None = None, **kw: Any
) -> list[Decision]:
    """Feeds the same fleet picture every ``every_s``; the fleet follows each decision at once."""
    clock, st = FakeClock(), state or PolicyState()
    current = int(kw.pop("current", 4))
    out = []
    while clock.now_s <= 1000.0 + seconds:
        d, st = decide(snapshot(clock.now_s, current=current, **kw), st, cfg)
        out.append(d)
        current = d.desired_replicas
        clock.tick(every_s)
    return out


# --------------------------------------------------------------------------------------------------------
# One decision: reason code and replica count
# --------------------------------------------------------------------------------------------------------

WATCHED = PolicyState(rate_history=steady_history(100.0))

CASES: list[tuple[str, dict[str, Any], dict[str, Any], PolicyState, str, int]] = [
    # name, snapshot kw, config kw, state, code, replicas
    ("below min", {"current": 1}, {"min_replicas": 3}, PolicyState(), "below_min_replicas", 3),
    ("above max", {"current": 6}, {"max_replicas": 5}, PolicyState(), "above_max_replicas", 5),
    ("stale metrics", {"age_s": 31.0, "p95": 5000.0}, {}, PolicyState(), "metrics_stale", 4),
    ("one of four reports", {"replicas": (replica(0),)}, {}, PolicyState(), "metrics_missing", 4),
    ("no TTFT and no rate", {"p95": None, "rate": None}, {}, PolicyState(), "metrics_missing", 4),
    (
        "requests wait, no replica",
        {"current": 0, "rate": 0.0, "queued": 3, "replicas": ()},
        {"min_replicas": 0},
        PolicyState(),
        "scale_from_zero",
        1,
    ),
    (
        "nothing at zero",
        {"current": 0, "rate": 0.0, "replicas": ()},
        {"min_replicas": 0},
        PolicyState(),
        "idle_at_zero",
        0,
    ),
    # 190 rps at 66.7 rps per replica: 2.85 replicas; on 3 with 10% margin only 2.7 fit: hold at 4.
    (
        "demand within the fleet",
        {"rate": 190.0},
        {},
        PolicyState(rate_history=steady_history(190.0)),
        "load_in_band",
        4,
    ),
    # 400 rps: ceil(400 * 0.015) = 6.
    ("demand", {"rate": 400.0}, {}, PolicyState(), "scale_up_demand", 6),
    ("demand capped by max_step_up", {"rate": 900.0}, {}, PolicyState(), "scale_up_demand", 8),
    (
        "demand capped by max_replicas",
        {"rate": 900.0},
        {"max_replicas": 6},
        PolicyState(),
        "scale_up_demand",
        6,
    ),
    ("at max", {"rate": 900.0, "current": 6}, {"max_replicas": 6}, PolicyState(), "at_max_replicas", 6),
    # 4 x 90 in flight over 80 planned per replica: 5.
    ("queueing", {"running": 90}, {}, PolicyState(), "scale_up_queueing", 5),
    (
        "queueing without a capacity",
        {"running": 90, "rate": 10.0},
        {"seed": None},
        PolicyState(),
        "scale_up_queueing",
        5,
    ),
    # p95 600 over the 400 ms threshold: 4 x 1.5 = 6.
    ("TTFT", {"p95": 600.0, "rate": 10.0}, {"seed": None}, PolicyState(), "scale_up_ttft", 6),
    (
        "TTFT at most doubles",
        {"p95": 5000.0, "rate": 10.0, "current": 2},
        {"seed": None},
        PolicyState(),
        "scale_up_ttft",
        4,
    ),
    ("KV cache full", {"kv": 0.95}, {}, WATCHED, "scale_up_kv_cache", 5),
    ("starting replicas", {"starting": 2, "p95": 900.0}, {}, PolicyState(), "scale_up_in_progress", 6),
    ("demand outgrew the scale-up", {"starting": 2, "rate": 600.0}, {}, PolicyState(), "scale_up_further", 9),
    (
        # 20 rps x 0.015 s needs 0.3 replicas: straight down to one, not one replica per cooldown
        "low load, watched long enough",
        {"rate": 20.0, "running": 5},
        {},
        PolicyState(rate_history=steady_history(20.0)),
        "scale_down",
        1,
    ),
    (
        # 150 rps x 0.015 s / (1 - 0.1 margin) = 2.5: three fit, so one fewer only
        "load fits on one fewer",
        {"rate": 150.0, "running": 5},
        {},
        PolicyState(rate_history=steady_history(150.0)),
        "scale_down",
        3,
    ),
    (
        "low load, not watched long enough",
        {"rate": 20.0, "running": 5},
        {},
        PolicyState(rate_history=steady_history(20.0, span_s=100.0)),
        "downscale_sustaining",
        4,
    ),
    (
        "low load, just scaled down",
        {"rate": 20.0, "running": 5},
        {},
        dataclasses.replace(WATCHED, rate_history=steady_history(20.0), last_scale_down_s=980.0),
        "downscale_cooldown",
        4,
    ),
    (
        "low load at min",
        {"rate": 20.0, "running": 5, "current": 1},
        {},
        PolicyState(rate_history=steady_history(20.0)),
        "at_min_replicas",
        1,
    ),
    (
        "TTFT high right after a scale-up",
        {"p95": 600.0, "rate": 10.0},
        {"seed": None},
        PolicyState(last_scale_up_ready_s=990.0),
        "upscale_cooldown",
        4,
    ),
    (
        "peak of the sustain period keeps replicas",
        {"rate": 20.0, "running": 5},
        {},
        PolicyState(
            rate_history=(*steady_history(20.0, 700.0, 100.0), *steady_history(250.0, 1000.0, 300.0))
        ),
        "load_in_band",
        4,
    ),
]


@pytest.mark.parametrize(
    ("name", "snap_kw", "cfg_kw", "state", "code", "replicas"), CASES, ids=[c[0] for c in CASES]
)
def test_decision(
    name: str, snap_kw: dict[str, Any], cfg_kw: dict[str, Any], state: PolicyState, code: str, replicas: int
) -> None:
    cfg_kw = dict(cfg_kw)
    cfg = config(seed=cfg_kw.pop("seed"), **cfg_kw) if "seed" in cfg_kw else config(**cfg_kw)
    decision, _ = decide(snapshot(**snap_kw), state, cfg)
    assert (decision.code, decision.desired_replicas) == (code, replicas), decision.reason
    assert decision.action == (
        "up"
        if replicas > snapshot(**snap_kw).target_replicas
        else "down"
        if replicas < snapshot(**snap_kw).target_replicas
        else "hold"
    )


def test_reason_carries_the_numbers() -> None:
    decision, _ = decide(snapshot(rate=400.0), PolicyState(), config())
    assert decision.reason.startswith("scale up 4 -> 6: needs demand 6")
    assert "400.0 rps" in decision.reason and "66.7 rps each" in decision.reason
    assert decision.details["need_demand"] == 6 and decision.details["capacity_source"] == "seed"


# --------------------------------------------------------------------------------------------------------
# Capacity learned from the replicas' engine counters
# --------------------------------------------------------------------------------------------------------


def counting_replica(i: int) -> ReplicaMetrics:
    """50 requests/s finished, 100 steps/s at 4 ms floor, busy 0.9: work = (0.9 - 100 * 0.004) / 50 s."""
    return replica(
        i,
        finished_rps=50.0,
        engine_steps_per_s=100.0,
        engine_busy_fraction=0.9,
        generation_tokens_per_s=5000.0,
        decode_step_floor_ms=4.0,
    )


def test_capacity_is_learned_from_engine_counters_and_replaces_the_seed() -> None:
    snap = snapshot(rate=200.0, replicas=tuple(counting_replica(i) for i in range(4)))
    wrong_seed = SEED.scaled(0.5)
    decision, state = decide(snap, PolicyState(), config(seed=wrong_seed))
    assert state.service is not None and state.service.source == "observed"
    assert state.service.work_ms_per_request == pytest.approx(10.0)
    assert state.service.output_tokens_per_request == pytest.approx(100.0)
    # 200 rps x 0.015 s = 3 replicas: the learned capacity, not the seed's half.
    assert decision.details["capacity_rps"] == pytest.approx(round(CAPACITY_RPS, 2))
    assert decision.details["need_demand"] == 3


def test_windows_that_fill_up_or_drain_are_not_measured() -> None:
    """Right after a start the replicas are busy with requests that have not finished yet."""
    filling = snapshot(rate=400.0, replicas=tuple(counting_replica(i) for i in range(4)))  # 200 finish
    _, state = decide(filling, PolicyState(), config())
    assert state.service is None


def test_without_seed_or_counters_demand_is_unknown() -> None:
    decision, state = decide(snapshot(rate=400.0), PolicyState(), config(seed=None))
    assert state.service is None
    assert (decision.code, decision.desired_replicas) == ("downscale_sustaining", 4)
    assert decision.details["need_demand"] == 0 and decision.details["capacity_rps"] is None


def test_windows_with_few_finished_requests_keep_the_previous_estimate() -> None:
    quiet = replica(
        0, finished_rps=1.0, engine_steps_per_s=10.0, engine_busy_fraction=0.1, generation_tokens_per_s=100.0
    )
    _, state = decide(snapshot(current=1, rate=1.0, replicas=(quiet,)), PolicyState(), config())
    assert state.service is None  # fewer than 20 finished in the 10 s window: the seed stands


# --------------------------------------------------------------------------------------------------------
# Over time
# --------------------------------------------------------------------------------------------------------


def test_rising_trend_scales_up_ahead_of_the_load() -> None:
    cfg, clock, st = config(), FakeClock(), PolicyState()
    current = 4
    decisions = []
    for i in range(12):  # +2 rps/s for two minutes, a report every 10 s
        rate = 100.0 + 20.0 * i
        d, st = decide(snapshot(clock.now_s, rate=rate, current=current), st, cfg)
        decisions.append(d)
        clock.tick(10.0)
    up = [d for d in decisions if d.action == "up"]
    assert up and up[0].code == "scale_up_demand"
    # Projected 90 s ahead: more than the current rate alone needs.
    assert up[0].details["projected_rate_rps"] > up[0].details["arrival_rate_rps"]


def history(rates: list[float], until_s: float = 1000.0) -> tuple[tuple[float, float], ...]:
    """One rate per 10 s, the last at until_s."""
    n = len(rates)
    return tuple((until_s - 10.0 * (n - 1 - i), r) for i, r in enumerate(rates))


@pytest.mark.parametrize(
    ("rates", "surge_rps"),
    [
        ([100.0] * 60, 0.0),  # steady
        # a rise of 50 rps from one 90 s start-up to the next, less 3 Poisson standard errors (5 rps)
        ([100.0] * 30 + [150.0] * 30, 50.0 - 3 * (250 / 90) ** 0.5),
        ([100.0] * 30 + [400.0] * 30, 300.0 - 3 * (500 / 90) ** 0.5),  # capped only where it is used
        ([100.0] * 30 + [50.0] * 30, 0.0),  # falls are not surges
    ],
)
def test_surge_headroom_is_the_largest_rise_over_a_startup(rates: list[float], surge_rps: float) -> None:
    _, state = decide(
        snapshot(rate=rates[-1]), PolicyState(rate_history=history(rates[:-1], 990.0)), config()
    )
    assert state.surge_rps == pytest.approx(surge_rps)


def test_surge_headroom_sizes_demand_and_is_off_at_zero_lookback() -> None:
    surged = PolicyState(rate_history=history([100.0] * 30 + [200.0] * 29, 990.0))
    decision, _ = decide(snapshot(rate=200.0), surged, config())
    # (200 - 2 x sqrt(200 / 10) noise + 94.5 kept) rps x 0.015 s = 4.3: 5 replicas
    assert decision.details["surge_rps"] == pytest.approx(100.0 - 3 * (300 / 90) ** 0.5, abs=0.01)
    assert decision.details["need_demand"] == 5
    decision, _ = decide(snapshot(rate=200.0), surged, config(surge_lookback_s=0.0))
    # 191 rps x 0.015 s = 2.9: 3 replicas
    assert (decision.details["surge_rps"], decision.details["need_demand"]) == (0.0, 3)
    capped = config(max_surge_headroom=0.1)  # at most 10% of the demand kept: 210 rps x 0.015 = 3.2
    assert decide(snapshot(rate=200.0), surged, capped)[0].details["need_demand"] == 4


@pytest.mark.parametrize(
    ("retries", "requests_rps"),
    [
        (2, 175.0 / (1 + 3 / 7 + (3 / 7) ** 2)),  # 3 in 7 attempts refused, each request tries <= 3 times
        (0, 175.0),  # clients that never retry: every attempt is a request
    ],
)
def test_refused_attempts_count_once_per_request(retries: int, requests_rps: float) -> None:
    snap = dataclasses.replace(snapshot(rate=175.0), refused_rate_rps=75.0)
    assert snap.offered_rate_rps(retries) == pytest.approx(requests_rps)
    decision, state = decide(snap, PolicyState(), config(client_retries=retries))
    assert decision.details["arrival_rate_rps"] == pytest.approx(requests_rps, abs=0.01)
    assert state.rate_history[-1][1] == pytest.approx(requests_rps)


def test_a_trend_counts_only_once_two_reports_in_a_row_show_it() -> None:
    # 100 rps, then two reports at 160: the fit over the 60 s trend window has a significant slope
    # (1.07 rps/s at t >= 2), the report before it did not; with a third report at 160 both do.
    cfg = config(trend_min_t_stat=2.0)
    two = PolicyState(rate_history=history([100.0] * 10 + [160.0], 990.0))
    assert decide(snapshot(rate=160.0), two, cfg)[0].details["trend_rps_per_s"] == 0
    three = PolicyState(rate_history=history([100.0] * 9 + [160.0] * 2, 990.0))
    assert decide(snapshot(rate=160.0), three, cfg)[0].details["trend_rps_per_s"] == pytest.approx(
        1.07, abs=0.01
    )


def test_noise_on_a_steady_rate_is_not_a_trend() -> None:
    cfg, clock, st = config(), FakeClock(), PolicyState(rate_history=steady_history(100.0))
    for i in range(30):
        d, st = decide(snapshot(clock.now_s, rate=100.0 + (6.0 if i % 2 else -6.0)), st, cfg)
        assert d.details["trend_rps_per_s"] == 0
        clock.tick(10.0)


def test_steady_load_does_not_flap() -> None:
    decisions = run(config(), seconds=3600, rate=180.0, running=40)
    moves = [d for d in decisions if d.action != "hold"]
    assert [d.desired_replicas for d in moves] == [3]  # 180 rps x 0.015 s = 2.7: down to 3, once


def test_scale_down_steps_one_replica_per_cooldown() -> None:
    decisions = run(
        config(),
        seconds=900,
        current=8,
        state=PolicyState(rate_history=steady_history(20.0)),
        rate=20.0,
        running=5,
    )
    downs = [d for d in decisions if d.code == "scale_down"]
    assert [d.desired_replicas for d in downs][:3] == [7, 6, 5]
    assert all(d.code in ("scale_down", "downscale_cooldown", "at_min_replicas") for d in decisions)


def test_decide_is_pure() -> None:
    snap, st, cfg = snapshot(rate=400.0), PolicyState(), config()
    assert decide(snap, st, cfg) == decide(snap, st, cfg)


def test_state_round_trips_through_a_dict() -> None:
    _, st = decide(
        snapshot(
            rate=200.0,
            replicas=tuple(dataclasses.replace(counting_replica(i), ttft_p95_ms=450.0) for i in range(4)),
        ),
        PolicyState(),
        config(),
    )
    assert st.in_progress is not None and st.service is not None and st.rate_history
    assert PolicyState.from_dict(st.to_dict()) == st
    assert PolicyState.from_dict({"ray_internal": 1}) == PolicyState()


# --------------------------------------------------------------------------------------------------------
# Settings and config
# --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kw", "field", "words"),
    [
        (
            {"min_replicas": 3, "max_replicas": 2},
            "max_replicas",
            "max_replicas (2) must be >= min_replicas (3)",
        ),
        ({"scale_up_headroom": 0.3, "scale_down_headroom": 0.3}, "scale_down_headroom", "hold band"),
        (
            {"max_replicas": 4, "initial_replicas": 6},
            "initial_replicas",
            "between min_replicas (1) and max_replicas (4)",
        ),
    ],
)
def test_settings_errors_name_the_field(kw: dict[str, Any], field: str, words: str) -> None:
    with pytest.raises(ValidationError) as err:
        AutoscalingSettings(**kw)
    problems = err.value.errors()[0]["ctx"]["error"]
    assert isinstance(problems, SettingsProblems)
    assert problems.problems[0][0] == field and words in problems.problems[0][1]


def test_settings_reject_unknown_keys_and_out_of_range_values() -> None:
    with pytest.raises(ValidationError, match="per_replica_capacity_rps"):
        AutoscalingSettings(per_replica_capacity_rps=10.0)  # type: ignore[call-arg]
    with pytest.raises(ValidationError, match="target_slot_utilization"):
        AutoscalingSettings(target_slot_utilization=1.5)


def test_every_setting_has_a_description_and_a_default() -> None:
    for name, f in AutoscalingSettings.model_fields.items():
        assert f.description and len(f.description) > 20, name
        assert not f.is_required(), name


def test_policy_config_checks_what_the_deployment_supplies() -> None:
    with pytest.raises(ValueError, match=r"ttft_target_ms \(0"):
        PolicyConfig(AutoscalingSettings(), ttft_target_ms=0.0, max_num_seqs=8)
    with pytest.raises(ValueError, match=r"max_num_seqs \(0\)"):
        PolicyConfig(AutoscalingSettings(), ttft_target_ms=500.0, max_num_seqs=0)
    cfg = config().with_bounds(2, 1)
    assert (cfg.settings.min_replicas, cfg.settings.max_replicas) == (2, 2)


def test_decision_requires_a_reason() -> None:
    with pytest.raises(ValueError, match="reason"):
        Decision(1, "hold", "load_in_band", "  ")
