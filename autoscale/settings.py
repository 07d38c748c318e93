"""The autoscaler's settings as a user writes them (``deployment.autoscaling`` in a headroom config).

Defined once, here, and used by the config schema (which embeds this model), the Serve options that wire
the policy into Ray (serve_app/serving/serve_options.py) and the policy itself. Pure: pydantic only.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

PolicyName = Literal["ttft_headroom", "ray_queue_length"]


class SettingsProblems(ValueError):
    """Several problems, each ``(field name, message)``: the config reports each at its own field path."""

    def __init__(self, problems: list[tuple[str, str]]) -> None:
        self.problems = problems
        super().__init__("; ".join(f"{path}: {msg}" for path, msg in problems))


class AutoscalingSettings(BaseModel):
    """Bounds and knobs of the replica autoscaler (the TTFT-headroom policy, or Ray's default)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    min_replicas: int = Field(
        default=1,
        ge=0,
        le=1024,
        description=(
            "Replicas kept with no traffic. 0 allows scale to zero, and the next request then waits a "
            "full cold start (64-255 s in the lab)."
        ),
    )
    max_replicas: int = Field(
        default=1,
        ge=1,
        le=1024,
        description="Most replicas the autoscaler may run; caps cost and GPU use. Must be >= min_replicas.",
    )
    initial_replicas: int | None = Field(
        default=None,
        ge=0,
        le=1024,
        description=(
            "Replicas started at deploy time, within [min_replicas, max_replicas]; null starts "
            "min_replicas. Set it to pre-warm capacity for a known traffic peak."
        ),
    )
    policy: PolicyName = Field(
        default="ttft_headroom",
        description=(
            "ttft_headroom: headroom's policy (autoscale/policy.py), sized from TTFT against the SLO, "
            "queueing, arrival trend and KV use. ray_queue_length: Ray Serve's default, which scales on "
            "ongoing requests per replica and knows nothing of latency."
        ),
    )
    replica_startup_s: float = Field(
        default=90,
        ge=1,
        le=3600,
        description=(
            "Seconds from asking for a replica to it serving: the lead time the policy plans for. Measure "
            "it: a Qwen3-8B replica on an H200 served 66-74 s after it was asked for with warm compile "
            "caches, 217 s cold, 140 s at TP=2 (results/gpu)."
        ),
    )
    window_s: float = Field(
        default=30,
        ge=2,
        le=600,
        description="Seconds of requests each replica's TTFT percentiles and arrival rate cover.",
    )
    upscale_cooldown_s: float = Field(
        default=60,
        ge=0,
        le=3600,
        description=(
            "Seconds after a scale-up completes during which TTFT and queue length (still draining the "
            "backlog) cannot trigger another one; arrival-rate growth still can."
        ),
    )
    downscale_sustain_s: float = Field(
        default=180,
        ge=0,
        le=86400,
        description=(
            "Seconds load must stay low enough for one replica fewer before one is removed. Keep it long: "
            "a removed replica takes replica_startup_s to bring back."
        ),
    )
    downscale_cooldown_s: float = Field(
        default=30, ge=0, le=86400, description="Least seconds between two scale-downs."
    )
    per_replica_capacity_rps: float | None = Field(
        default=None,
        gt=0,
        le=1_000_000,
        description=(
            "Requests per second one replica serves within the SLO, from the tuning ladder; null leaves "
            "sizing to TTFT and queueing alone."
        ),
    )
    target_ongoing_requests: float | None = Field(
        default=None,
        gt=0,
        le=100_000,
        description=(
            "ray_queue_length only: ongoing requests per replica Ray aims for; null uses 80% of the "
            "planned max_num_seqs (Ray's own default of 2 starves a batching engine)."
        ),
    )

    @model_validator(mode="after")
    def _check_bounds(self) -> AutoscalingSettings:
        problems: list[tuple[str, str]] = []
        lo, hi, initial = self.min_replicas, self.max_replicas, self.initial_replicas
        if hi < lo:
            problems.append(("max_replicas", f"max_replicas ({hi}) must be >= min_replicas ({lo})"))
        elif initial is not None and not lo <= initial <= hi:
            msg = f"initial_replicas ({initial}) must be between min_replicas ({lo}) and max_replicas ({hi})"
            problems.append(("initial_replicas", msg))
        if problems:
            raise SettingsProblems(problems)
        return self
