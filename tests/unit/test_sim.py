"""The simulator: latency calibration, traces, fleet mechanics, the Ray model, and the benchmark targets."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from autoscale import bench
from autoscale.policy import MetricsSnapshot
from autoscale.sim import (
    HeadroomPolicy,
    LadderPoint,
    LatencyModel,
    RayDefaultPolicy,
    ScaleEvent,
    StaticPolicy,
    Trace,
    _direction_stats,
    bursty_trace,
    constant_trace,
    diurnal_trace,
    plot,
    simulate,
    step_trace,
    to_table,
    trace_from_csv,
)

# --------------------------------------------------------------------------------------------------------
# Latency model
# --------------------------------------------------------------------------------------------------------


def test_default_ladder_hits_the_lab_anchors() -> None:
    lat = LatencyModel()
    assert lat.ttft_p50_ms(32) == pytest.approx(193.0)
    assert lat.ttft_p50_ms(64) == pytest.approx(209.0)
    assert [p.concurrency for p in lat.ladder if p.measured] == [32, 64]
    assert lat.kv_cache_tokens == 794_704


def test_curves_interpolate_and_grow_with_batch() -> None:
    lat = LatencyModel()
    assert lat.ttft_p50_ms(48) == pytest.approx((193.0 + 209.0) / 2)
    c = np.array([1, 16, 64, 128, 256])
    assert np.all(np.diff(lat.ttft_p95_ms(c)) > 0)
    assert np.all(np.diff(lat.tpot_ms(c)) > 0)
    # the lognormal puts p95 where the ladder says
    sigma = lat.ttft_sigma(64)
    assert lat.ttft_p50_ms(64) * math.exp(1.6448536 * sigma) == pytest.approx(lat.ttft_p95_ms(64), rel=1e-6)


def test_slo_capacity_is_consistent() -> None:
    lat = LatencyModel()
    c500 = lat.slo_concurrency(500.0)
    assert lat.ttft_p95_ms(c500) <= 500.0 < lat.ttft_p95_ms(c500 + 1)
    assert lat.capacity_rps(1000.0) > lat.capacity_rps(500.0) > 0
    assert lat.capacity_rps(500.0) == pytest.approx(c500 / lat.mean_service_s(c500))


def test_prompt_length_scales_prefill() -> None:
    assert LatencyModel(prompt_tokens=1024).ttft_p50_ms(64) == pytest.approx(209.0 / 2)


def test_prefix_cached_preset_applies_the_lab_ratios() -> None:
    cached = LatencyModel.qwen3_8b_h200(prefix_cached=True)
    assert cached.ttft_p50_ms(32) == pytest.approx(84.0)
    assert cached.tpot_ms(64) == pytest.approx(22.0 / 2.5)


@pytest.mark.parametrize("wrap", ["list", "points", "ladder"])
def test_ladder_loads_from_json(tmp_path: Path, wrap: str) -> None:
    points = [
        {"concurrency": 64, "ttft_p50_ms": 150, "ttft_p95_ms": 260, "tpot_p50_ms": 18, "extra": "ignored"},
        {"concurrency": 1, "ttft_p50_ms": 40, "ttft_p95_ms": 55, "tpot_p50_ms": 6},
    ]
    data = points if wrap == "list" else {wrap: points, "prompt_tokens": 1024, "unknown": 1}
    path = tmp_path / "ladder.json"
    path.write_text(json.dumps(data))
    lat = LatencyModel.from_json(path, output_tokens_mean=128.0)
    assert [p.concurrency for p in lat.ladder] == [1, 64]
    assert all(p.measured for p in lat.ladder)
    assert lat.output_tokens_mean == 128.0
    assert lat.prompt_tokens == (2048 if wrap == "list" else 1024)
    assert str(path) in lat.source


@pytest.mark.parametrize(
    ("points", "words"),
    [
        ([{"concurrency": 1, "ttft_p50_ms": 40, "tpot_p50_ms": 6}], "ttft_p95_ms"),
        (
            [
                {"concurrency": 8, "ttft_p50_ms": 40, "ttft_p95_ms": 30, "tpot_p50_ms": 6},
            ],
            "must be >= ttft_p50_ms",
        ),
    ],
)
def test_bad_ladders_say_what_is_wrong(points, words) -> None:
    with pytest.raises(ValueError, match=words):
        LatencyModel.from_json(points)


def test_ladder_concurrencies_must_increase() -> None:
    with pytest.raises(ValueError, match="strictly increasing"):
        LatencyModel(ladder=(LadderPoint(8, 1, 2, 3), LadderPoint(8, 1, 2, 3)))


# --------------------------------------------------------------------------------------------------------
# Traces
# --------------------------------------------------------------------------------------------------------


def test_trace_shapes() -> None:
    c = constant_trace(30.0, 600.0)
    assert len(c.rate_rps) == 600 and c.peak_rps == c.mean_rps == 30.0
    s = step_trace(10.0, 50.0, up_at_s=100.0, down_at_s=200.0, duration_s=300.0)
    assert s.rate_rps[99] == 10.0 and s.rate_rps[100] == 50.0 and s.rate_rps[200] == 10.0
    d = diurnal_trace(40.0, 20.0, period_s=1000.0, duration_s=1000.0)
    assert d.rate_rps[0] == pytest.approx(20.0) and d.rate_rps[500] == pytest.approx(60.0)


def test_bursty_trace_is_seeded() -> None:
    a, b, c = bursty_trace(seed=3), bursty_trace(seed=3), bursty_trace(seed=4)
    assert np.array_equal(a.rate_rps, b.rate_rps)
    assert not np.array_equal(a.rate_rps, c.rate_rps)
    assert a.rate_rps.min() >= 25.0 and a.peak_rps > 1.5 * 25.0


def test_trace_from_csv(tmp_path: Path) -> None:
    p = tmp_path / "t.csv"
    p.write_text("time_s,rps\n0,10\n10,20\n20,20\n")
    tr = trace_from_csv(p)
    assert tr.name == "t" and len(tr.rate_rps) == 21
    assert tr.rate_rps[5] == pytest.approx(15.0) and tr.rate_rps[20] == 20.0
    bad = tmp_path / "bad.csv"
    bad.write_text("t,r\n0,1\n")
    with pytest.raises(ValueError, match="time_s,rps"):
        trace_from_csv(bad)


# --------------------------------------------------------------------------------------------------------
# Fleet mechanics
# --------------------------------------------------------------------------------------------------------


@dataclass
class _AskOnce:
    """Asks for ``replicas`` at the first control tick, then holds."""

    replicas: int
    name: str = "ask-once"
    control_interval_s: float = 5.0

    def reset(self) -> None:
        pass

    def __call__(self, view) -> tuple[int, str]:
        return self.replicas, "test"


def test_new_replicas_serve_only_after_startup() -> None:
    tr = constant_trace(5.0, 400.0)
    r = simulate(tr, _AskOnce(3), initial_replicas=1, replica_startup_s=120.0, seed=2)
    tl = r.timeline
    assert tl is not None
    assert tl.ready[4] == 1 and tl.provisioned[5] == 3  # asked at t=5, paid from then
    assert tl.ready[124] == 1 and tl.ready[125] == 3  # serving from t=5+120
    assert r.scale_events == 1 and r.events[0] == ScaleEvent(5.0, 1, 3, "test")


def test_static_fleet_costs_exactly_its_size() -> None:
    tr = constant_trace(20.0, 1800.0)
    r = simulate(tr, StaticPolicy(4), initial_replicas=4, seed=1)
    assert r.replica_hours == pytest.approx(4 * 0.5)
    assert r.direction_changes == 0 and r.scale_events == 0
    assert r.served == r.requests and r.requests == pytest.approx(20 * 1800, rel=0.05)


def test_simulation_is_deterministic() -> None:
    tr = bursty_trace(duration_s=1800.0, seed=5)
    cfg = bench.tuned_policy_config(LatencyModel())
    a = simulate(tr, HeadroomPolicy(cfg), initial_replicas=2, seed=9)
    b = simulate(tr, HeadroomPolicy(cfg), initial_replicas=2, seed=9)
    assert a.to_dict(events=True) == b.to_dict(events=True)
    assert np.array_equal(a.timeline.provisioned, b.timeline.provisioned)  # type: ignore[union-attr]


def test_overload_misses_the_target_and_capacity_meets_it() -> None:
    lat = LatencyModel()
    rate = 2.0 * lat.capacity_rps(500.0)
    tr = constant_trace(rate, 600.0)
    short = simulate(tr, StaticPolicy(1), lat, initial_replicas=1, seed=1)
    ample = simulate(tr, StaticPolicy(4), lat, initial_replicas=4, seed=1)
    assert short.attainment < 0.5 and short.ttft_p95_ms > 5000
    assert ample.attainment > 0.99 and ample.ttft_p95_ms < 500


def test_scale_from_zero_serves_the_waiting_requests() -> None:
    lat = LatencyModel()
    cfg = bench.tuned_policy_config(lat, min_replicas=0, replica_startup_s=60.0)
    tr = constant_trace(2.0, 600.0)
    r = simulate(tr, HeadroomPolicy(cfg), lat, initial_replicas=0, replica_startup_s=60.0, seed=4)
    assert r.events[0].from_replicas == 0 and r.events[0].to_replicas >= 1 and r.events[0].t_s == 5.0
    assert "zero" in r.events[0].reason
    assert r.served == r.requests  # the ones that queued during the cold start were served too
    assert r.ttft_p99_ms > 50_000  # ... after waiting for the start-up
    assert r.timeline is not None and r.timeline.ready[64] == 0 and r.timeline.ready[65] >= 1


def test_snapshot_reflects_the_fleet() -> None:
    seen: list[MetricsSnapshot] = []

    @dataclass
    class Spy:
        name: str = "spy"
        control_interval_s: float = 60.0

        def reset(self) -> None:
            pass

        def __call__(self, view) -> tuple[int, str]:
            seen.append(view.snapshot(30.0, 15.0))
            return 3, "spy"

    simulate(constant_trace(20.0, 200.0), Spy(), initial_replicas=2, replica_startup_s=90.0, seed=1)
    first, second = seen[0], seen[1]
    assert first.current_replicas == 2 and len(first.replicas) == 2 and first.target_replicas == 2
    assert first.arrival_rate_rps == pytest.approx(20.0, rel=0.35)
    assert all(r.ttft_p95_ms is not None and r.ttft_samples > 0 for r in first.replicas)
    assert second.target_replicas == 3 and second.replicas_starting == 1 and second.current_replicas == 2


# --------------------------------------------------------------------------------------------------------
# Ray's default policy, modelled
# --------------------------------------------------------------------------------------------------------


@dataclass
class _View:
    now_s: float
    current_replicas: int
    target_replicas: int
    ongoing: float
    replicas_starting: int = 0

    def mean_ongoing_requests(self, look_back_s: float) -> float:
        return self.ongoing

    def snapshot(self, window_s: float, rate_window_s: float):  # pragma: no cover - unused
        raise NotImplementedError


def test_ray_model_waits_upscale_delay_then_jumps_to_ceil() -> None:
    ray = RayDefaultPolicy(target_ongoing_requests=10.0, upscale_delay_s=30.0)
    for t in range(0, 30, 5):
        n, _ = ray(_View(float(t), 2, 2, ongoing=55.0))
        assert n == 2
    n, why = ray(_View(30.0, 2, 2, ongoing=55.0))
    assert n == 6 and "55.0 ongoing" in why


def test_ray_model_downscale_waits_600s_and_a_break_resets_it() -> None:
    ray = RayDefaultPolicy(target_ongoing_requests=10.0)
    assert ray(_View(0.0, 6, 6, ongoing=12.0))[0] == 6
    assert ray(_View(590.0, 6, 6, ongoing=12.0))[0] == 6
    assert ray(_View(595.0, 6, 6, ongoing=60.0))[0] == 6  # back to balance: the timer resets
    assert ray(_View(600.0, 6, 6, ongoing=12.0))[0] == 6
    assert ray(_View(1200.0, 6, 6, ongoing=12.0))[0] == 2


def test_ray_model_cold_start_and_bounds() -> None:
    ray = RayDefaultPolicy(target_ongoing_requests=10.0, min_replicas=0, max_replicas=5)
    assert ray(_View(0.0, 0, 0, ongoing=3.0))[0] == 1
    ray.reset()
    for t in (0.0, 30.0):
        n, _ = ray(_View(t, 2, 2, ongoing=500.0))
    assert n == 5


# --------------------------------------------------------------------------------------------------------
# Reporting
# --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("moves", "changes", "worst"),
    [
        ([(0, 1, 2), (10, 2, 3)], 0, 0),
        ([(0, 1, 2), (10, 2, 1), (20, 1, 2)], 2, 2),
        ([(0, 1, 2), (10, 2, 1), (700, 1, 2), (1400, 2, 1)], 3, 1),
    ],
)
def test_direction_changes(moves, changes, worst) -> None:
    events = [ScaleEvent(float(t), a, b, "x") for t, a, b in moves]
    assert _direction_stats(events) == (changes, worst)


def test_table_and_plot(tmp_path: Path) -> None:
    tr = Trace("tiny", np.full(300, 10.0))
    rs = [
        simulate(tr, StaticPolicy(2), initial_replicas=2, seed=1),
        simulate(tr, _AskOnce(1), initial_replicas=2, seed=1),
    ]
    table = to_table(rs)
    assert table.count("\n") == 3 and "| tiny | static |" in table and "1.00x" in table
    png = plot(rs, tmp_path / "tiny.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# --------------------------------------------------------------------------------------------------------
# Behaviour over whole traces (the benchmark's targets)
# --------------------------------------------------------------------------------------------------------


def test_constant_load_for_an_hour_does_not_oscillate() -> None:
    lat = LatencyModel()
    cfg = bench.tuned_policy_config(lat)
    tr = constant_trace(40.0, 3600.0)
    r = simulate(
        tr, HeadroomPolicy(cfg), lat, initial_replicas=bench.initial_replicas(tr, lat, 500.0), seed=3
    )
    assert r.max_direction_changes_per_10min <= 1
    assert r.direction_changes <= 1
    assert r.attainment >= 0.99


def test_bursty_targets() -> None:
    lat = LatencyModel()
    cfg = bench.tuned_policy_config(lat)
    results = []
    for tr in (bursty_trace(), constant_trace()):
        results += bench.run_trace(tr, lat, cfg, keep_timeline=False)
    checks = bench.check_targets(results)
    failed = [f"{c.name}: {c.detail}" for c in checks if not c.passed]
    assert not failed, failed
