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
        policy_kwargs: {settings: {...}, ttft_target_ms: 1000, max_num_seqs: 96, capacity_seed: null}
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from autoscale import replica_stats as keys
from autoscale.capacity import ServiceEstimate
from autoscale.inputs import MetricsSnapshot, PolicyConfig, ReplicaMetrics
from autoscale.policy import PolicyState, decide
from autoscale.settings import AutoscalingSettings

POLICY_IMPORT_PATH = "autoscale.ray_policy:TTFTHeadroomPolicy"

logger = logging.getLogger("ray.serve.headroom.autoscale")


def latest_report(
    raw_metrics: Mapping[str, Mapping[Any, list[Any]]], replica: Any
) -> dict[str, float] | None:
    """A replica's newest value of every report key, or None when it has not reported yet."""
    report: dict[str, float] = {}
    for name, by_replica in raw_metrics.items():
        series = by_replica.get(replica)
        if series:
            report[name] = float(series[-1].value)
    return report if keys.TAKEN_AT_S in report else None


def snapshot_from_context(ctx: Any, window_s: float) -> MetricsSnapshot:
    """A MetricsSnapshot of what Ray's controller knows now. A replica that has not reported yet is not
    counted as reporting."""
    raw = ctx.raw_metrics or {}
    reports = [(r, rep) for r in ctx.running_replicas if (rep := latest_report(raw, r)) is not None]
    taken = [rep[keys.TAKEN_AT_S] for _, rep in reports]
    rates = [rep[keys.ARRIVAL_RATE_RPS] for _, rep in reports if keys.ARRIVAL_RATE_RPS in rep]
    refused = [rep.get(keys.REFUSED_RATE_RPS, 0.0) for _, rep in reports]
    now_s = ctx.current_time if ctx.current_time is not None else max(taken, default=0.0)
    return MetricsSnapshot(
        now_s=now_s,
        # The oldest replica report bounds how fresh the whole picture is.
        taken_at_s=min(taken) if taken else float("-inf"),
        replicas=tuple(
            ReplicaMetrics.from_report(str(getattr(r, "unique_id", r)), rep) for r, rep in reports
        ),
        arrival_rate_rps=sum(rates) if rates else None,
        refused_rate_rps=sum(refused),
        current_replicas=ctx.current_num_replicas,
        target_replicas=ctx.target_num_replicas,
        replicas_starting=max(0, ctx.target_num_replicas - ctx.current_num_replicas),
        queued_at_router=int(ctx.total_queued_requests or 0),
        window_s=window_s,
    )


class TTFTHeadroomPolicy:
    """Ray Serve class policy. `policy_kwargs`: the config's autoscaling settings (a dict), the TTFT
    target, the plan's max_num_seqs and an optional capacity seed (a ServiceEstimate dict)."""

    def __init__(
        self,
        settings: Mapping[str, Any],
        ttft_target_ms: float,
        max_num_seqs: int,
        capacity_seed: Mapping[str, Any] | None = None,
    ):
        seed = None if capacity_seed is None else ServiceEstimate.from_dict(capacity_seed)
        self.config = PolicyConfig(AutoscalingSettings(**settings), ttft_target_ms, max_num_seqs, seed)

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        # Ray adjusts the bounds to the cluster's capacity; the policy must respect those.
        config = self.config.with_bounds(
            ctx.capacity_adjusted_min_replicas, ctx.capacity_adjusted_max_replicas
        )
        snapshot = snapshot_from_context(ctx, config.settings.window_s)
        decision, state = decide(snapshot, PolicyState.from_dict(ctx.policy_state or {}), config)
        if decision.action != "hold":
            logger.info(
                "headroom autoscaler: %s -> %d [%s]: %s",
                decision.action,
                decision.desired_replicas,
                decision.code,
                decision.reason,
            )
        return decision.desired_replicas, state.to_dict()
