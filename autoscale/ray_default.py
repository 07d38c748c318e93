"""Ray Serve's default autoscaling policy, re-implemented without Ray for the simulator.

What Ray 2.60's controller runs for a deployment without a custom policy (``ray/serve/
autoscaling_policy.py``): ``replica_queue_length_autoscaling_policy`` wrapped by
``_apply_autoscaling_config`` -- the cold-start fast path (``_get_cold_start_scale_up_replicas``), the core
(desired = total ongoing requests / target_ongoing_requests), ``_apply_scaling_factors`` (the factor
scales the change, and a stuck downscale still drops one), ``_apply_delay_logic`` (a direction must
persist ``upscale_delay_s`` / ``downscale_delay_s`` of wall-clock time, counted from its first tick) --
then the bounds (``_private/autoscaling_state.py``: ``apply_bounds``). ``total_num_requests`` is the
mean over ``look_back_period_s`` of the requests running at replicas plus those queued at handles.
tests/unit/test_ray_policy.py pins this model to Ray's own functions on a table of contexts.

Pure: no Ray import.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

__all__ = ["RayKnobs", "RayState", "ray_default_decide"]

_DELAY_ELAPSED_EPS_S = 1e-6  # Ray's tolerance for elapsed-time comparisons


@dataclass(frozen=True, slots=True)
class RayKnobs:
    """The fields of Ray's ``AutoscalingConfig`` the default policy reads (defaults: Ray 2.60's)."""

    target_ongoing_requests: float = 2.0
    min_replicas: int = 1
    max_replicas: int = 100
    upscale_delay_s: float = 30.0
    downscale_delay_s: float = 600.0
    downscale_to_zero_delay_s: float | None = None
    upscaling_factor: float = 1.0
    downscaling_factor: float = 1.0
    look_back_period_s: float = 30.0

    def label(self) -> str:
        return (
            f"target {self.target_ongoing_requests:g}, up delay {self.upscale_delay_s:g} s, down delay "
            f"{self.downscale_delay_s:g} s, down factor {self.downscaling_factor:g}"
        )


@dataclass(frozen=True, slots=True)
class RayState:
    """Ray's internal policy state: the direction counter and when the current direction began."""

    decision_counter: int = 0
    decision_timestamp: float | None = None


def _scaled(desired: float, current: int, knobs: RayKnobs) -> int:
    """``_apply_scaling_factors``."""
    if current == 0:
        return math.ceil(desired)
    delta = desired - current
    factor = knobs.upscaling_factor if delta > 0 else knobs.downscaling_factor
    scaled = math.ceil(current + factor * delta)
    if math.ceil(float(desired)) < current and scaled == current:
        scaled -= 1
    return scaled


def _delayed(
    desired: int, target: int, now_s: float, state: RayState, knobs: RayKnobs
) -> tuple[int, RayState]:
    """``_apply_delay_logic``."""
    counter, since = state.decision_counter, state.decision_timestamp
    decision = target
    if desired > target:
        if counter < 0:
            counter, since = 0, None
        counter += 1
        since = now_s if since is None else since
        if now_s - since + _DELAY_ELAPSED_EPS_S >= knobs.upscale_delay_s:
            counter, since, decision = 0, None, desired
    elif desired < target:
        if counter > 0:
            counter, since = 0, None
        counter -= 1
        if target == 1:
            to_zero = knobs.downscale_to_zero_delay_s
            delay_s = knobs.downscale_delay_s if to_zero is None else to_zero
        else:
            delay_s = knobs.downscale_delay_s
            desired = max(1, desired)
        since = now_s if since is None else since
        if now_s - since + _DELAY_ELAPSED_EPS_S >= delay_s:
            counter, since, decision = 0, None, desired
    else:
        counter, since = 0, None
    return decision, replace(state, decision_counter=counter, decision_timestamp=since)


def ray_default_decide(
    current: int, target: int, total_requests: float, now_s: float, state: RayState, knobs: RayKnobs
) -> tuple[int, RayState]:
    """Replica target from Ray's default policy for one control-loop tick, bounds applied."""

    def bounded(n: int) -> int:
        return max(knobs.min_replicas, min(knobs.max_replicas, n))

    if current == 0 and total_requests > 0:
        return bounded(max(math.ceil(1 * knobs.upscaling_factor), target)), state
    desired: float = (
        target if current == 0 else current * (total_requests / (knobs.target_ongoing_requests * current))
    )
    scaled = _scaled(desired, current, knobs)
    if current == 0 and scaled > 0:
        return bounded(scaled), state
    decision, new_state = _delayed(max(0, scaled), target, now_s, state, knobs)
    return bounded(decision), new_state
