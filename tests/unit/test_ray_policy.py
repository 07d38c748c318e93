"""What replicas report, the Ray adapter (a plain object stands in for Ray's context), the Serve options
that wire it in, and the simulator's model of Ray's default policy pinned to Ray's own code."""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from autoscale import replica_stats as keys
from autoscale.capacity import seed_from_ladder
from autoscale.ray_default import RayKnobs, RayState, ray_default_decide
from autoscale.ray_policy import TTFTHeadroomPolicy, snapshot_from_context
from autoscale.replica_stats import EngineStats, ReplicaStatsWindow
from autoscale.settings import AutoscalingSettings
from serve_app.config import ConfigError
from serve_app.config.loading import load_env_config
from serve_app.planning.from_config import cluster_spec, plan_config
from serve_app.serving.serve_options import autoscaling_config

REPO = Path(__file__).resolve().parents[2]
LADDER = REPO / "results/gpu/ladder-structured/results.json"

# --------------------------------------------------------------------------------------------------------
# The replica's report
# --------------------------------------------------------------------------------------------------------


def test_window_reports_percentiles_and_rate_and_forgets_old_samples() -> None:
    w = ReplicaStatsWindow(window_s=10)
    for i in range(20):
        w.request_arrived(100 + i * 0.5)
        w.first_token(100 + i * 0.5, ttft_ms=10 * (i + 1))
    report = w.report(now_s=110)
    assert report[keys.TTFT_SAMPLES] == 20
    # numpy's linear interpolation over 10, 20, ..., 200
    assert report[keys.TTFT_P50_MS] == 105 and report[keys.TTFT_P95_MS] == pytest.approx(190.5)
    assert report[keys.ARRIVAL_RATE_RPS] == 2.0
    later = w.report(now_s=125)  # everything is older than the window
    assert later[keys.TTFT_SAMPLES] == 0 and later[keys.TTFT_P95_MS] == -1
    assert later[keys.ARRIVAL_RATE_RPS] == 0


def test_window_reports_refused_attempts_beside_the_arrivals() -> None:
    w = ReplicaStatsWindow(window_s=10)
    for i in range(10):
        w.request_arrived(100 + i)
        if i % 2:
            w.request_refused(100 + i)
    assert (w.report(now_s=110)[keys.ARRIVAL_RATE_RPS], w.report(now_s=110)[keys.REFUSED_RATE_RPS]) == (
        1.0,
        0.5,
    )
    assert w.report(now_s=125)[keys.REFUSED_RATE_RPS] == 0


def test_young_replica_rate_counts_the_whole_window() -> None:
    """The fleet's rate is the sum of the replicas' rates: a replica that started mid-window must not
    count its arrivals as if they came over a shorter time (the others saw fewer meanwhile)."""
    w = ReplicaStatsWindow(window_s=10)
    for i in range(5):
        w.request_arrived(1005 + i)
    assert w.report(now_s=1010)[keys.ARRIVAL_RATE_RPS] == 5 / 10


def step(e: EngineStats, t: float, running: int, prompt: int, generated: int, finished: int = 0) -> None:
    """What the engine's stat logger does for one engine step: the step, then the scheduler's state."""
    e.record_step(t, prompt_tokens=prompt, generation_tokens=generated, finished=finished)
    e.record_scheduler(num_running=running, num_waiting=1, kv_cache_usage=0.25)


def test_engine_steps_become_rates_over_the_window() -> None:
    w = ReplicaStatsWindow(window_s=10)
    assert w.report(now_s=0.0)[keys.FINISHED_RPS] == -1  # no earlier counters: unknown
    t = 0.0
    for i in range(1000):  # 10 ms steps: a prefill step every tenth, light decode steps otherwise
        t += 0.01
        step(w.engine, t, running=3, prompt=500 if i % 10 == 0 else 0, generated=3, finished=int(i % 5 == 0))
    report = w.report(now_s=t)
    assert report[keys.ENGINE_STEPS_PER_S] == pytest.approx(100.0, rel=0.01)
    assert report[keys.ENGINE_BUSY_FRACTION] == pytest.approx(1.0, rel=0.01)
    assert report[keys.FINISHED_RPS] == pytest.approx(20.0, rel=0.01)
    assert report[keys.GENERATION_TOKENS_PER_S] == pytest.approx(300.0, rel=0.01)
    assert report[keys.DECODE_STEP_FLOOR_MS] == pytest.approx(10.0)
    assert (report[keys.NUM_REQUESTS_RUNNING], report[keys.NUM_REQUESTS_WAITING]) == (3, 1)


def test_idle_gaps_are_not_busy_time_and_idle_is_reported() -> None:
    e = EngineStats()
    step(e, 1.0, running=1, prompt=10, generated=1)
    step(e, 1.01, running=1, prompt=0, generated=1, finished=1)
    e.record_scheduler(num_running=0, num_waiting=0, kv_cache_usage=0.0)  # vLLM's update without a step
    step(e, 5.0, running=1, prompt=10, generated=1)
    assert e.busy_s == pytest.approx(0.01)
    assert e.steps == 3


# --------------------------------------------------------------------------------------------------------
# The adapter
# --------------------------------------------------------------------------------------------------------


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
    now: float, ttft_p95_ms: float, replicas: int = 1, taken_at: float | None = None, **kw: Any
) -> FakeContext:
    names = [f"r{i}" for i in range(replicas)]
    report = {
        keys.TTFT_P50_MS: ttft_p95_ms / 2,
        keys.TTFT_P95_MS: ttft_p95_ms,
        keys.TTFT_SAMPLES: 50,
        keys.ARRIVAL_RATE_RPS: 5,
        keys.REFUSED_RATE_RPS: 1.5,
        keys.NUM_REQUESTS_RUNNING: 4,
        keys.NUM_REQUESTS_WAITING: 0,
        keys.KV_CACHE_USAGE: 0.5,
        keys.FINISHED_RPS: -1,
        keys.TAKEN_AT_S: taken_at if taken_at is not None else now,
    }
    raw = {k: {n: [Point(now - 1, v)] for n in names} for k, v in report.items()}
    return FakeContext(now, replicas, replicas, names, raw, **kw)


def policy(**settings: Any) -> TTFTHeadroomPolicy:
    base = {"min_replicas": 1, "max_replicas": 16, "window_s": 10.0, **settings}
    return TTFTHeadroomPolicy(
        settings=AutoscalingSettings(**base).model_dump(mode="json"), ttft_target_ms=100, max_num_seqs=8
    )


def test_snapshot_maps_reports_per_replica() -> None:
    snap = snapshot_from_context(context(1000, 400, replicas=2), window_s=10)
    assert len(snap.replicas) == 2
    assert snap.replicas[0].ttft_p95_ms == 400 and snap.replicas[0].num_requests_running == 4
    assert snap.replicas[0].finished_rps is None  # -1: unknown
    assert snap.arrival_rate_rps == 10 and snap.refused_rate_rps == 3
    assert snap.current_replicas == snap.target_replicas == 2


def test_a_replica_without_a_report_is_not_counted() -> None:
    ctx = context(1000, 400, replicas=2)
    ctx.running_replicas.append("new")
    ctx.current_num_replicas = 3
    snap = snapshot_from_context(ctx, window_s=10)
    assert (len(snap.replicas), snap.current_replicas) == (2, 3)


def test_policy_scales_up_on_a_ttft_breach_and_keeps_state() -> None:
    p = policy()
    desired, state = p(context(1000, ttft_p95_ms=400))
    assert desired == 2  # TTFT 400 ms over the 80 ms threshold: at most double
    # The scale-up is in flight (target 2, 1 serving): no new decision from the same breach.
    ctx = context(1010, ttft_p95_ms=400)
    ctx.target_num_replicas, ctx.policy_state = desired, state
    assert p(ctx)[0] == 2


def test_policy_holds_on_stale_reports() -> None:
    assert policy()(context(1000, ttft_p95_ms=400, taken_at=900))[0] == 1


def test_policy_respects_capacity_adjusted_bounds() -> None:
    desired, _ = policy()(context(1000, ttft_p95_ms=5000, replicas=2, capacity_adjusted_max_replicas=3))
    assert desired == 3


# --------------------------------------------------------------------------------------------------------
# Serve options: what the config hands the adapter
# --------------------------------------------------------------------------------------------------------


def prod_autoscaling(**settings: Any) -> dict[str, Any]:
    cfg = load_env_config("prod")
    assert cfg.deployment.autoscaling is not None
    if settings:
        auto = cfg.deployment.autoscaling.model_copy(update=settings)
        cfg = cfg.model_copy(update={"deployment": cfg.deployment.model_copy(update={"autoscaling": auto})})
    return autoscaling_config(cfg, plan_config(cfg, cluster_spec(cfg, nodes=2, gpus_per_node=8)))


def test_prod_policy_kwargs_build_the_policy() -> None:
    auto = prod_autoscaling()
    kwargs = auto["policy"]["policy_kwargs"]
    assert (
        kwargs["ttft_target_ms"] == 1000 and kwargs["max_num_seqs"] == 256 and kwargs["capacity_seed"] is None
    )
    p = TTFTHeadroomPolicy(**json.loads(json.dumps(kwargs)))  # as Ray stores them
    assert p.config.settings.min_replicas == auto["min_replicas"]
    assert p.config.settings == load_env_config("prod").deployment.autoscaling


def test_capacity_seed_is_read_where_the_app_is_built() -> None:
    kwargs = prod_autoscaling(capacity_seed_file=str(LADDER))["policy"]["policy_kwargs"]
    seed = TTFTHeadroomPolicy(**kwargs).config.capacity_seed
    assert seed is not None and seed.source == "seed"
    assert seed.step_ms == pytest.approx(5.13, abs=0.01)  # the ladder's TPOT at concurrency 1


def test_a_missing_seed_file_names_the_field() -> None:
    with pytest.raises(ConfigError, match=r"deployment\.autoscaling\.capacity_seed_file: cannot read"):
        prod_autoscaling(capacity_seed_file="no/such/ladder.json")


def test_seed_from_the_committed_h200_ladder() -> None:
    seed = seed_from_ladder(json.loads(LADDER.read_text()), 1000.0, "ladder")
    # +chunked prefill at concurrency 64: 64 / 1.023 s = 62.6 rps, TPOT 6.68 ms against 5.13 ms at c=1.
    assert seed.work_ms_per_request == pytest.approx((1 - 5.13 / 6.68) / 62.6 * 1000, rel=0.01)
    with pytest.raises(ValueError, match="needs one at <= 4"):
        data = json.loads(LADDER.read_text())
        for run in data["runs"]:
            run["steps"] = [s for s in run["steps"] if s["concurrency"] > 1]
        seed_from_ladder(data, 1000.0, "ladder")


# --------------------------------------------------------------------------------------------------------
# The simulator's Ray default, pinned to Ray's own functions
# --------------------------------------------------------------------------------------------------------


def ray_own_decision(
    knobs: RayKnobs,
    cur: int,
    tgt: int,
    total: float,
    now: float,
    state: dict[str, Any],
    monkeypatch: pytest.MonkeyPatch,
) -> tuple[int, dict[str, Any]]:
    """Ray 2.60's controller path: the wrapped default policy, a float rounded up, then the bounds."""
    from ray.serve._private.common import DeploymentID
    from ray.serve.autoscaling_policy import (
        _apply_autoscaling_config,
        replica_queue_length_autoscaling_policy,
    )
    from ray.serve.config import AutoscalingConfig, AutoscalingContext

    monkeypatch.setattr("ray.serve.autoscaling_policy.time.time", lambda: now)
    config = AutoscalingConfig(
        min_replicas=knobs.min_replicas,
        max_replicas=knobs.max_replicas,
        target_ongoing_requests=knobs.target_ongoing_requests,
        upscale_delay_s=knobs.upscale_delay_s,
        downscale_delay_s=knobs.downscale_delay_s,
        downscale_to_zero_delay_s=knobs.downscale_to_zero_delay_s,
        upscaling_factor=knobs.upscaling_factor,
        downscaling_factor=knobs.downscaling_factor,
        look_back_period_s=knobs.look_back_period_s,
    )
    ctx = AutoscalingContext(
        deployment_id=DeploymentID(name="llm", app_name="app"),
        deployment_name="llm",
        app_name="app",
        current_num_replicas=cur,
        target_num_replicas=tgt,
        running_replicas=[],
        total_num_requests=total,
        total_queued_requests=0.0,
        aggregated_metrics={},
        raw_metrics={},
        capacity_adjusted_min_replicas=knobs.min_replicas,
        capacity_adjusted_max_replicas=knobs.max_replicas,
        policy_state=dict(state),
        last_scale_up_time=None,
        last_scale_down_time=None,
        current_time=now,
        config=config,
    )
    n, new_state = _apply_autoscaling_config(replica_queue_length_autoscaling_policy)(ctx)
    n = math.ceil(n) if isinstance(n, float) else n
    return max(knobs.min_replicas, min(knobs.max_replicas, n)), new_state


from ray.serve._private.constants import (  # noqa: E402  (after the helper that documents them)
    SERVE_AUTOSCALING_DECISION_COUNTERS_KEY as COUNTER_KEY,
)
from ray.serve._private.constants import SERVE_AUTOSCALING_DECISION_TIMESTAMP_KEY as TIMESTAMP_KEY  # noqa: E402

KNOBS = [
    RayKnobs(),
    RayKnobs(
        target_ongoing_requests=60,
        min_replicas=2,
        max_replicas=16,
        upscale_delay_s=0,
        downscale_delay_s=120,
        downscaling_factor=0.3,
    ),
    RayKnobs(
        target_ongoing_requests=10,
        min_replicas=0,
        max_replicas=8,
        downscale_delay_s=30,
        downscale_to_zero_delay_s=90,
        upscaling_factor=2.0,
    ),
    RayKnobs(
        target_ongoing_requests=45,
        min_replicas=1,
        max_replicas=12,
        upscale_delay_s=30,
        downscale_delay_s=300,
        downscaling_factor=0.6,
        upscaling_factor=0.5,
    ),
]


@pytest.mark.parametrize("knobs", KNOBS, ids=[k.label() for k in KNOBS])
def test_ray_default_model_matches_rays_own_policy(knobs: RayKnobs, monkeypatch: pytest.MonkeyPatch) -> None:
    """Random walks of load, replicas that start after a lag, one tick a second: the same decision from
    the model and from Ray at every tick."""
    rng = random.Random(hash(knobs.label()) & 0xFFFF)
    for _walk in range(6):
        cur = tgt = max(knobs.min_replicas, 1)
        ours, theirs = RayState(), {}
        load = rng.uniform(0, 4 * knobs.target_ongoing_requests)
        starting: list[tuple[float, int]] = []
        for tick in range(400):
            now = 1_000_000.0 + tick
            load = max(0.0, load * rng.uniform(0.9, 1.1) + rng.choice((0, 0, 0, 20, -20)))
            cur = max(0, min(tgt, cur + sum(n for t, n in starting if t == tick)))
            mine, ours = ray_default_decide(cur, tgt, load, now, ours, knobs)
            ray_n, theirs = ray_own_decision(knobs, cur, tgt, load, now, theirs, monkeypatch)
            assert mine == ray_n, f"tick {tick}: current {cur}, target {tgt}, {load:.1f} requests"
            assert (ours.decision_counter, ours.decision_timestamp) == (
                theirs.get(COUNTER_KEY, 0),
                theirs.get(TIMESTAMP_KEY),
            )
            if mine > tgt:
                starting.append((tick + rng.randint(1, 30), mine - tgt))
            elif mine < tgt:
                cur = min(cur, mine)
            tgt = mine
