"""The thin adapter that runs the TTFT-headroom policy inside Ray Serve's controller.

Ray Serve (2.60) calls a custom policy with an `AutoscalingContext` every control-loop tick; a class policy
is built once with `policy_kwargs`. This adapter maps the context (the replicas' latest
`record_autoscaling_stats` reports, replica counts, time, stored policy state) into `decide()`'s inputs and
its decision back. It reads the context by attribute only, so it imports nothing from Ray and stays
testable with a plain object; the decision logic lives in autoscale/policy.py.

Plug it in (serve_app/serving/serve_options.py does this from the config's `deployment.autoscaling`):

    autoscaling_config:
      policy:
        policy_function: autoscale.ray_policy:TTFTHeadroomPolicy
        policy_kwargs: {ttft_target_ms: 1000, replica_startup_s: 90, ...}
"""

from __future__ import annotations

import logging
from typing import Any

from autoscale import replica_stats as keys
from autoscale.policy import MetricsSnapshot, PolicyConfig, PolicyState, ReplicaMetrics, decide

POLICY_IMPORT_PATH = "autoscale.ray_policy:TTFTHeadroomPolicy"

logger = logging.getLogger("ray.serve.headroom.autoscale")


def _latest(
    raw_metrics: dict[str, dict[Any, list[Any]]], name: str, replica: Any
) -> tuple[float, float] | None:
    """(timestamp, value) of a replica's newest report of `name`, or None."""
    series = raw_metrics.get(name, {}).get(replica)
    if not series:
        return None
    point = series[-1]
    return point.timestamp, point.value


def replica_metrics(raw_metrics: dict[str, dict[Any, list[Any]]], replica: Any) -> ReplicaMetrics | None:
    """One replica's report, or None when it has not reported yet (it is then not counted as serving)."""
    taken = _latest(raw_metrics, keys.TAKEN_AT_S, replica)
    if taken is None:
        return None

    def value(name: str) -> float:
        point = _latest(raw_metrics, name, replica)
        return point[1] if point is not None else 0.0

    p50, p95 = value(keys.TTFT_P50_MS), value(keys.TTFT_P95_MS)
    return ReplicaMetrics(
        replica_id=str(getattr(replica, "unique_id", replica)),
        ttft_p50_ms=p50 if p50 >= 0 else None,
        ttft_p95_ms=p95 if p95 >= 0 else None,
        ttft_samples=int(value(keys.TTFT_SAMPLES)),
        num_requests_running=int(value(keys.NUM_REQUESTS_RUNNING)),
        num_requests_waiting=int(value(keys.NUM_REQUESTS_WAITING)),
        kv_cache_usage=value(keys.KV_CACHE_USAGE),
    )


def snapshot_from_context(ctx: Any, window_s: float) -> MetricsSnapshot:
    """A MetricsSnapshot of what Ray's controller knows now."""
    raw = ctx.raw_metrics or {}
    reports = [m for r in ctx.running_replicas if (m := replica_metrics(raw, r)) is not None]
    taken = [t[1] for r in ctx.running_replicas if (t := _latest(raw, keys.TAKEN_AT_S, r)) is not None]
    rates = [p[1] for r in ctx.running_replicas if (p := _latest(raw, keys.ARRIVAL_RATE_RPS, r)) is not None]
    now_s = ctx.current_time if ctx.current_time is not None else max(taken, default=0.0)
    return MetricsSnapshot(
        now_s=now_s,
        # The oldest replica report bounds how fresh the whole picture is.
        taken_at_s=min(taken) if taken else float("-inf"),
        replicas=tuple(reports),
        arrival_rate_rps=sum(rates) if rates else None,
        current_replicas=ctx.current_num_replicas,
        target_replicas=ctx.target_num_replicas,
        replicas_starting=max(0, ctx.target_num_replicas - ctx.current_num_replicas),
        queued_at_router=int(ctx.total_queued_requests or 0),
        window_s=window_s,
        rate_window_s=window_s,
    )


class TTFTHeadroomPolicy:
    """Ray Serve class policy: `policy_kwargs` are PolicyConfig fields plus `window_s` (the replicas'
    reporting window)."""

    def __init__(self, window_s: float = 30.0, **policy_kwargs: Any):
        self.window_s = window_s
        self.config = PolicyConfig(**policy_kwargs)

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        # Ray adjusts the bounds to the cluster's capacity; the policy must respect those.
        config = self.config.model_copy(
            update={
                "min_replicas": ctx.capacity_adjusted_min_replicas,
                "max_replicas": max(ctx.capacity_adjusted_max_replicas, ctx.capacity_adjusted_min_replicas),
            }
        )
        snapshot = snapshot_from_context(ctx, self.window_s)
        decision, state = decide(snapshot, PolicyState.from_dict(ctx.policy_state or {}), config)
        if decision.action != "hold":
            logger.info(
                "headroom autoscaler: %s -> %d: %s",
                decision.action,
                decision.desired_replicas,
                decision.reason,
            )
        return decision.desired_replicas, state.to_dict()
