"""The replica's autoscaling report and the Ray adapter, with a plain object standing in for Ray's context."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from autoscale import replica_stats as keys
from autoscale.ray_policy import TTFTHeadroomPolicy, snapshot_from_context
from autoscale.replica_stats import ReplicaStatsWindow


def test_window_reports_percentiles_rate_and_forgets_old_samples():
    w = ReplicaStatsWindow(window_s=10)
    for i in range(20):
        w.request_arrived(100 + i * 0.5)
        w.first_token(100 + i * 0.5, ttft_ms=10 * (i + 1))
    report = w.report(now_s=110)
    assert report[keys.TTFT_SAMPLES] == 20
    assert report[keys.TTFT_P50_MS] == 100 and report[keys.TTFT_P95_MS] == 190
    assert report[keys.ARRIVAL_RATE_RPS] == 2.0
    later = w.report(now_s=125)  # everything is older than the window
    assert later[keys.TTFT_SAMPLES] == 0 and later[keys.TTFT_P95_MS] == -1
    assert later[keys.ARRIVAL_RATE_RPS] == 0


def test_young_replica_rate_is_over_its_age():
    w = ReplicaStatsWindow(window_s=30)
    for i in range(10):
        w.request_arrived(1000 + i)
    assert w.report(now_s=1005)[keys.ARRIVAL_RATE_RPS] == 10 / 5


@dataclass
class Point:
    timestamp: float
    value: float


@dataclass
class FakeContext:
    """The attributes of ray.serve.config.AutoscalingContext the adapter reads."""

    current_time: float
    current_num_replicas: int
    target_num_replicas: int
    running_replicas: list[str]
    raw_metrics: dict[str, dict[str, list[Point]]]
    capacity_adjusted_min_replicas: int = 1
    capacity_adjusted_max_replicas: int = 4
    total_queued_requests: float = 0
    policy_state: dict[str, Any] = field(default_factory=dict)


def context(
    now: float, ttft_p95_ms: float, replicas: int = 1, taken_at: float | None = None, **kw
) -> FakeContext:
    names = [f"r{i}" for i in range(replicas)]
    report = {
        keys.TTFT_P50_MS: ttft_p95_ms / 2,
        keys.TTFT_P95_MS: ttft_p95_ms,
        keys.TTFT_SAMPLES: 50,
        keys.ARRIVAL_RATE_RPS: 5,
        keys.NUM_REQUESTS_RUNNING: 8,
        keys.NUM_REQUESTS_WAITING: 20,
        keys.KV_CACHE_USAGE: 0.5,
        keys.TAKEN_AT_S: taken_at if taken_at is not None else now,
    }
    raw = {k: {n: [Point(now - 1, v)] for n in names} for k, v in report.items()}
    return FakeContext(now, replicas, replicas, names, raw, **kw)


def test_snapshot_maps_reports_per_replica():
    snap = snapshot_from_context(context(1000, 400, replicas=2), window_s=30)
    assert len(snap.replicas) == 2
    assert snap.replicas[0].ttft_p95_ms == 400 and snap.replicas[0].num_requests_waiting == 20
    assert snap.arrival_rate_rps == 10
    assert snap.current_replicas == snap.target_replicas == 2


def test_policy_scales_up_on_a_ttft_breach_and_keeps_state():
    policy = TTFTHeadroomPolicy(window_s=30, ttft_target_ms=100, per_replica_max_concurrency=8)
    desired, state = policy(context(1000, ttft_p95_ms=400))
    assert desired > 1
    assert state  # stored by Ray and handed back next tick
    # The scale-up is in flight (target 2, 1 serving): no new decision from the same breach.
    ctx = context(1010, ttft_p95_ms=400)
    ctx.target_num_replicas, ctx.policy_state = desired, state
    again, _ = policy(ctx)
    assert again == desired


def test_policy_holds_on_stale_reports():
    policy = TTFTHeadroomPolicy(window_s=30, ttft_target_ms=100, per_replica_max_concurrency=8)
    desired, _ = policy(context(1000, ttft_p95_ms=400, taken_at=900))
    assert desired == 1


def test_policy_respects_capacity_adjusted_bounds():
    policy = TTFTHeadroomPolicy(
        window_s=30, ttft_target_ms=100, per_replica_max_concurrency=1, max_replicas=16
    )
    desired, _ = policy(context(1000, ttft_p95_ms=5000, capacity_adjusted_max_replicas=2))
    assert desired == 2
