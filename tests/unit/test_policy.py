"""The TTFT-headroom decision: table-driven cases built from small builders, time from a fake clock."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from pydantic import ValidationError

from autoscale.policy import (
    Decision,
    MetricsSnapshot,
    PolicyConfig,
    PolicyState,
    ReplicaMetrics,
    decide,
)

REPO = Path(__file__).resolve().parents[2]

# --------------------------------------------------------------------------------------------------------
# Builders
# --------------------------------------------------------------------------------------------------------

CAPACITY_RPS = 10.0  # planning capacity 8 rps per replica at target_utilization 0.8
CONCURRENCY = 80


def config(**overrides: object) -> PolicyConfig:
    base: dict[str, object] = {
        "ttft_target_ms": 500.0,
        "scale_up_headroom": 0.2,
        "scale_down_headroom": 0.5,
        "target_utilization": 0.8,
        "downscale_margin": 0.1,
        "downscale_sustain_s": 300.0,
        "upscale_cooldown_s": 60.0,
        "downscale_cooldown_s": 60.0,
        "stale_after_s": 30.0,
        "replica_startup_s": 90.0,
        "min_replicas": 1,
        "max_replicas": 20,
        "per_replica_capacity_rps": CAPACITY_RPS,
        "per_replica_max_concurrency": CONCURRENCY,
        "max_step_up": 4,
        "spare_replicas": 0,
        "trend_min_t_stat": 3.0,
    }
    base.update(overrides)
    return PolicyConfig(**base)  # type: ignore[arg-type]


def replica(
    i: int = 0,
    p95: float | None = 300.0,
    running: int = 30,
    waiting: int = 0,
    kv: float = 0.2,
    samples: int = 100,
) -> ReplicaMetrics:
    return ReplicaMetrics(
        replica_id=f"r{i}",
        ttft_p50_ms=None if p95 is None else p95 / 1.6,
        ttft_p95_ms=p95,
        ttft_samples=samples if p95 is not None else 0,
        num_requests_running=running,
        num_requests_waiting=waiting,
        kv_cache_usage=kv,
    )


def snapshot(
    now: float = 1000.0,
    *,
    p95: float | None = 300.0,
    rate: float | None = 20.0,
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
        replicas
        if replicas is not None
        else tuple(replica(i, p95=p95, running=running, kv=kv) for i in range(current))
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
    )


class FakeClock:
    def __init__(self, start_s: float = 1000.0) -> None:
        self.now_s = start_s

    def advance(self, s: float) -> float:
        self.now_s += s
        return self.now_s


def run_steady(
    cfg: PolicyConfig,
    *,
    seconds: float,
    every_s: float = 5.0,
    state: PolicyState | None = None,
    **snap_kw: object,
) -> list[tuple[float, Decision]]:
    """Feed the same fleet picture every ``every_s`` seconds; the fleet follows each decision at once."""
    clock = FakeClock()
    st = state or PolicyState()
    current = int(snap_kw.pop("current", 4))  # type: ignore[call-overload]
    out: list[tuple[float, Decision]] = []
    end = clock.now_s + seconds
    while clock.now_s <= end:
        d, st = decide(snapshot(clock.now_s, current=current, **snap_kw), st, cfg)  # type: ignore[arg-type]
        out.append((clock.now_s, d))
        current = d.desired_replicas
        clock.advance(every_s)
    return out


# --------------------------------------------------------------------------------------------------------
# One decision from a fresh state
# --------------------------------------------------------------------------------------------------------

CASES = [
    # name, snapshot kwargs, config overrides, expected action, check on desired, words in the reason
    ("low headroom scales up", dict(p95=460.0, rate=20.0), {}, "up", lambda d: d > 4, ["TTFT p95 460 ms"]),
    (
        "3x overload is sized to the need, not +1",
        dict(p95=2000.0, rate=96.0, current=4, running=200, queued=300),
        {},
        "up",
        lambda d: d >= 4 + 3,
        ["needs"],
    ),
    ("inside the band holds", dict(p95=320.0, rate=20.0), {}, "hold", lambda d: d == 4, ["band"]),
    (
        "demand above capacity scales up before TTFT suffers",
        dict(p95=300.0, rate=45.0),
        {},
        "up",
        lambda d: d == 6,
        ["demand 6"],
    ),
    ("stale metrics hold", dict(p95=2000.0, rate=90.0, age_s=45.0), {}, "hold", lambda d: d == 4, ["stale"]),
    (
        "missing metrics hold",
        dict(p95=2000.0, rate=90.0, replicas=()),
        {},
        "hold",
        lambda d: d == 4,
        ["missing"],
    ),
    (
        "no TTFT and no rate is missing",
        dict(p95=None, rate=None),
        {},
        "hold",
        lambda d: d == 4,
        ["missing"],
    ),
    (
        "never above max_replicas",
        dict(p95=3000.0, rate=500.0, current=6, running=250, queued=900),
        {"max_replicas": 7},
        "up",
        lambda d: d == 7,
        [],
    ),
    (
        "at max_replicas holds and says so",
        dict(p95=3000.0, rate=500.0, current=7, running=250),
        {"max_replicas": 7},
        "hold",
        lambda d: d == 7,
        ["max_replicas"],
    ),
    (
        "below min_replicas comes up to min",
        dict(p95=None, rate=None, current=1, target=1),
        {"min_replicas": 3},
        "up",
        lambda d: d == 3,
        ["min_replicas"],
    ),
    (
        "above max_replicas comes down to max",
        dict(p95=100.0, rate=1.0, current=9, target=9),
        {"max_replicas": 5},
        "down",
        lambda d: d == 5,
        ["max_replicas"],
    ),
    (
        "scale from zero when requests wait",
        dict(p95=None, rate=0.0, current=0, target=0, queued=3),
        {"min_replicas": 0},
        "up",
        lambda d: d >= 1,
        ["zero", "3 requests waiting"],
    ),
    (
        "scale from zero is sized by the arrival rate",
        dict(p95=None, rate=20.0, current=0, target=0, queued=40),
        {"min_replicas": 0},
        "up",
        lambda d: d == 3,
        ["zero"],
    ),
    (
        "zero stays zero with nothing arriving",
        dict(p95=None, rate=0.0, current=0, target=0, queued=0),
        {"min_replicas": 0},
        "hold",
        lambda d: d == 0,
        ["no request"],
    ),
    (
        "scale-up in progress holds despite high TTFT",
        dict(p95=900.0, rate=40.0, current=3, starting=3, running=80),
        {},
        "hold",
        lambda d: d == 6,
        ["in progress"],
    ),
    (
        "scale-up in progress goes further up when demand outgrew it",
        dict(p95=900.0, rate=70.0, current=3, starting=3, running=80),
        {},
        "up",
        lambda d: d == 9,
        ["further", "worse"],
    ),
    (
        "scale-up in progress is also target above current",
        dict(p95=900.0, rate=40.0, current=3, target=5, starting=0, running=80),
        {},
        "hold",
        lambda d: d == 5,
        ["in progress"],
    ),
    (
        "a full KV cache adds a replica",
        dict(p95=300.0, rate=20.0, kv=0.95),
        {},
        "up",
        lambda d: d == 5,
        ["KV cache"],
    ),
    (
        "max_step_up caps a large need",
        dict(p95=4000.0, rate=400.0, current=2, running=250, queued=2000),
        {"max_step_up": 2},
        "up",
        lambda d: d == 4,
        [],
    ),
]


@pytest.mark.parametrize(
    ("snap_kw", "cfg_kw", "action", "check", "words"),
    [pytest.param(*c[1:], id=c[0]) for c in CASES],
)
def test_single_decision(snap_kw, cfg_kw, action, check, words) -> None:
    decision, state = decide(snapshot(**snap_kw), PolicyState(), config(**cfg_kw))
    assert decision.action == action, decision.reason
    assert check(decision.desired_replicas), decision
    assert decision.reason.strip(), "every decision carries a reason"
    for w in words:
        assert w in decision.reason, decision.reason
    cfg = config(**cfg_kw)
    assert decision.desired_replicas <= cfg.max_replicas
    if action != "hold" or snap_kw.get("current", 4) >= cfg.min_replicas:
        assert decision.desired_replicas >= min(cfg.min_replicas, snap_kw.get("target", 99))
    assert isinstance(state, PolicyState)


def test_numbers_in_up_reason() -> None:
    d, _ = decide(snapshot(p95=2000.0, rate=96.0, running=200, queued=300), PolicyState(), config())
    assert d.action == "up"
    assert "2000 ms" in d.reason and "500 ms" in d.reason and "96.0 rps" in d.reason
    assert d.details["need_demand"] == 12
    assert d.details["headroom"] == pytest.approx(-3.0)


def test_ttft_only_sizing_when_capacity_figures_are_wrong() -> None:
    # Demand says 4 is plenty, but TTFT p95 is 1.5x the up threshold: +50%, not +1.
    d, _ = decide(snapshot(p95=600.0, rate=10.0, current=6), PolicyState(), config())
    assert d.action == "up"
    assert d.desired_replicas == 9
    assert "TTFT 9" in d.reason


# --------------------------------------------------------------------------------------------------------
# Sequences over time
# --------------------------------------------------------------------------------------------------------


def test_scale_down_only_after_sustained_headroom() -> None:
    cfg = config(downscale_sustain_s=300.0, downscale_cooldown_s=60.0)
    # 4 replicas, 10 rps: fits on 3 (3 * 8 * 0.9 = 21.6 rps) and on 2 (14.4 rps), TTFT p95 150 ms.
    seq = run_steady(cfg, seconds=900.0, p95=150.0, rate=10.0, running=10, current=4)
    start = seq[0][0]
    downs = [(t - start, d) for t, d in seq if d.action == "down"]
    assert downs, "sustained high headroom must eventually remove a replica"
    first_t, first = downs[0]
    assert first_t >= cfg.downscale_sustain_s
    assert first.desired_replicas == 3, "one step at a time"
    assert all(d.action != "down" for t, d in seq if t - start < cfg.downscale_sustain_s)
    # Later steps respect the cooldown and never go below what the load needs (2 replicas).
    times = [t for t, _ in downs]
    assert all(b - a >= cfg.downscale_cooldown_s for a, b in zip(times, times[1:], strict=False))
    assert min(d.desired_replicas for _, d in seq) == 2
    assert "low for" in first.reason


def test_interrupted_low_load_restarts_the_sustain_clock() -> None:
    cfg = config(downscale_sustain_s=300.0)
    clock = FakeClock()
    st = PolicyState()
    for _ in range(40):  # 200 s of low load
        _, st = decide(snapshot(clock.now_s, p95=150.0, rate=10.0, running=10), st, cfg)
        clock.advance(5)
    d, st = decide(snapshot(clock.now_s, p95=320.0, rate=10.0, running=10), st, cfg)  # a blip in the band
    assert d.action == "hold" and st.low_load_since_s is None
    clock.advance(5)
    for _ in range(50):  # 250 s more: still < 300 s since the blip
        d, st = decide(snapshot(clock.now_s, p95=150.0, rate=10.0, running=10), st, cfg)
        assert d.action == "hold", d.reason
        clock.advance(5)


def test_min_replicas_is_a_floor_for_scale_down() -> None:
    cfg = config(min_replicas=3, downscale_sustain_s=60.0, downscale_cooldown_s=10.0)
    seq = run_steady(cfg, seconds=1200.0, p95=50.0, rate=0.5, running=1, current=6)
    assert min(d.desired_replicas for _, d in seq) == 3
    assert seq[-1][1].action == "hold" and "min_replicas" in seq[-1][1].reason


def test_scale_to_zero_only_without_traffic() -> None:
    cfg = config(min_replicas=0, downscale_sustain_s=60.0, downscale_cooldown_s=10.0)
    busy = run_steady(cfg, seconds=600.0, p95=50.0, rate=0.5, running=1, current=1)
    assert all(d.desired_replicas == 1 for _, d in busy)
    idle = run_steady(cfg, seconds=600.0, p95=None, rate=0.0, running=0, current=1)
    assert idle[-1][1].desired_replicas == 0


def test_upscale_cooldown_blocks_ttft_only_but_not_demand() -> None:
    cfg = config(upscale_cooldown_s=60.0)
    clock = FakeClock()
    st = PolicyState()
    d, st = decide(snapshot(clock.now_s, p95=460.0, rate=20.0), st, cfg)
    assert d.action == "up"
    target = d.desired_replicas
    clock.advance(90)  # replicas ready: in-progress ends, cooldown starts
    d, st = decide(snapshot(clock.now_s, p95=460.0, rate=20.0, current=target), st, cfg)
    assert d.action == "hold" and "cooldown" in d.reason
    clock.advance(5)
    d, st = decide(snapshot(clock.now_s, p95=460.0, rate=20.0 * target, current=target), st, cfg)
    assert d.action == "up" and "demand" in d.reason
    target = d.desired_replicas
    clock.advance(90)  # ready again; the cooldown restarts from here
    d, st = decide(snapshot(clock.now_s, p95=300.0, rate=20.0, current=target), st, cfg)
    assert d.action == "hold"
    clock.advance(cfg.upscale_cooldown_s)
    d, st = decide(snapshot(clock.now_s, p95=470.0, rate=20.0, current=target), st, cfg)
    assert d.action == "up" and "TTFT" in d.reason


def test_rising_trend_scales_up_ahead_of_the_load() -> None:
    cfg = config(replica_startup_s=90.0, trend_window_s=60.0)
    clock = FakeClock()
    st = PolicyState()
    decisions = []
    rate = 20.0  # 4 replicas plan for 32 rps; the rate climbs 0.25 rps per second
    for _ in range(20):
        d, st = decide(snapshot(clock.now_s, p95=300.0, rate=rate), st, cfg)
        decisions.append((rate, d))
        if d.action == "up":
            break
        clock.advance(5)
        rate += 1.25
    rate_at_up, d = decisions[-1]
    assert d.action == "up", [x.reason for _, x in decisions]
    assert rate_at_up < 32.0, "the trend must trigger before the current rate exceeds capacity"
    assert "projected" in d.reason
    assert d.details["projected_rate_rps"] > rate_at_up


def test_noise_on_a_steady_rate_is_not_a_trend() -> None:
    cfg = config()
    clock = FakeClock()
    st = PolicyState()
    noise = [0.0, 1.2, -0.8, 0.5, -1.5, 0.9, 1.4, -0.3, -1.1, 0.6, 1.5, -0.2, 0.8, 1.3, -0.9, 1.6]
    for x in noise * 5:
        d, st = decide(snapshot(clock.now_s, p95=320.0, rate=28.0 + x), st, cfg)
        assert d.action == "hold", d.reason
        clock.advance(5)


def test_decide_is_pure() -> None:
    cfg = config()
    snap = snapshot(p95=460.0, rate=30.0)
    st = PolicyState(rate_history=((990.0, 25.0), (995.0, 27.0)))
    a = decide(snap, st, cfg)
    b = decide(snap, st, cfg)
    assert a == b
    assert st.rate_history == ((990.0, 25.0), (995.0, 27.0))
    with pytest.raises(dataclasses.FrozenInstanceError):
        st.last_action = "up"  # type: ignore[misc]


def test_state_round_trips_through_a_dict() -> None:
    cfg = config()
    _, st = decide(snapshot(p95=900.0, rate=60.0), PolicyState(), cfg)
    assert st.in_progress is not None
    again = PolicyState.from_dict(st.to_dict() | {"ray_internal_key": 3})
    assert again == st
    assert PolicyState.from_dict(None) == PolicyState()


def test_steady_load_does_not_flap() -> None:
    # A steady fleet picture every 5 s for an hour: no scaling at all once sized.
    cfg = config()
    seq = run_steady(cfg, seconds=3600.0, p95=330.0, rate=30.0, running=50, current=4)
    assert [d.action for _, d in seq].count("up") == 0
    assert [d.action for _, d in seq].count("down") == 0


# --------------------------------------------------------------------------------------------------------
# Config and output validation
# --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kw", "words"),
    [
        ({"min_replicas": 3, "max_replicas": 2}, ["max_replicas (2) must be >= min_replicas (3)"]),
        ({"scale_up_headroom": 0.5, "scale_down_headroom": 0.3}, ["scale_down_headroom (0.3)", "band"]),
        ({"per_replica_capacity_rps": None, "per_replica_max_concurrency": None}, ["at least one"]),
        ({"ttft_target_ms": 0.0}, ["ttft_target_ms"]),
        ({"bogus_knob": 1}, ["bogus_knob"]),
    ],
)
def test_config_errors_name_the_problem(kw, words) -> None:
    with pytest.raises(ValidationError) as err:
        config(**kw)
    for w in words:
        assert w in str(err.value)


def test_every_config_field_has_a_description() -> None:
    for name, f in PolicyConfig.model_fields.items():
        assert f.description and len(f.description) > 20, name


def test_decision_requires_a_reason() -> None:
    with pytest.raises(ValueError):
        Decision(3, "hold", "  ")
