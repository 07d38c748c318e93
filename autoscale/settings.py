"""The autoscaler's settings as a user writes them (``deployment.autoscaling`` in a headroom config).

Defined once, here: the config schema embeds this model, the Serve options (serve_app/serving/
serve_options.py) pass it to the Ray adapter, and the policy (autoscale/policy.py) reads its knobs from it
beside the two numbers the deployment supplies (the TTFT target from ``slo.ttft_p95_ms``, the engine's
``max_num_seqs`` from the plan). Every default below is the value the simulator benchmark judges
(``python -m autoscale.bench``; how they were chosen: autoscale/tune.py). Pure: pydantic only.
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

    # -- bounds and which policy ------------------------------------------------------------------------
    min_replicas: int = Field(
        default=1,
        ge=0,
        le=1024,
        description=(
            "Replicas kept with no traffic. 0 allows scale to zero, and the next request then waits a "
            "full start-up (66-217 s for Qwen3-8B on an H200, results/gpu)."
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
            "ttft_headroom: headroom's policy (autoscale/policy.py), sized from the replicas' learned "
            "capacity, TTFT against the SLO, queueing, arrival trend and KV use. ray_queue_length: Ray "
            "Serve's default, which scales on ongoing requests per replica and knows nothing of latency."
        ),
    )
    # -- timing -----------------------------------------------------------------------------------------
    replica_startup_s: float = Field(
        default=120,
        ge=1,
        le=3600,
        description=(
            "Seconds from asking for a replica to it serving: the lead time demand is projected over. "
            "Measure it: a Qwen3-8B replica on an H200 served 66-74 s after it was asked for with warm "
            "compile caches, 217 s cold, 140 s at TP=2 (results/gpu)."
        ),
    )
    window_s: float = Field(
        default=10,
        ge=2,
        le=600,
        description=(
            "Seconds of requests each replica's TTFT percentiles, arrival and engine rates cover. Ray Serve "
            "pushes the reports every 10 s; a longer window smooths more but lets a removed replica's "
            "share of arrivals vanish from the fleet's rate for longer."
        ),
    )
    stale_after_s: float = Field(
        default=30,
        gt=0,
        le=3600,
        description=(
            "Replica reports older than this are stale and the policy holds. Ray Serve pushes them every "
            "10 s, so keep it above that."
        ),
    )
    min_replicas_reporting: float = Field(
        default=0.5,
        gt=0,
        le=1,
        description=(
            "Fraction of serving replicas that must report; with fewer the metrics count as missing and "
            "the policy holds."
        ),
    )
    upscale_cooldown_s: float = Field(
        default=60,
        ge=0,
        le=3600,
        description=(
            "Seconds after a scale-up completes during which TTFT and queue length (still draining the "
            "backlog) cannot trigger another one; demand growth still can."
        ),
    )
    downscale_sustain_s: float = Field(
        default=600,
        ge=0,
        le=86400,
        description=(
            "A replica is removed only if the peak arrival rate of the last downscale_sustain_s fits on "
            "one replica fewer: how long load must stay low. Keep it long: a removed replica takes "
            "replica_startup_s to bring back."
        ),
    )
    downscale_cooldown_s: float = Field(
        default=60, ge=0, le=86400, description="Least seconds between two scale-downs."
    )
    # -- sizing -----------------------------------------------------------------------------------------
    scale_up_headroom: float = Field(
        default=0.2,
        ge=0,
        lt=1,
        description=(
            "Scale up when TTFT headroom (1 - TTFT p95 / target) falls below this, i.e. when p95 exceeds "
            "(1 - scale_up_headroom) x the target: 800 ms for a 1000 ms target at 0.2."
        ),
    )
    scale_down_headroom: float = Field(
        default=0.3,
        gt=0,
        lt=1,
        description=(
            "Consider removing a replica only while headroom exceeds this. Must be > scale_up_headroom "
            "(the band between them is where the fleet holds). A batching engine's TTFT stays flat until "
            "near saturation, so the capacity check on one replica fewer does the real sizing."
        ),
    )
    target_engine_utilization: float = Field(
        default=0.8,
        gt=0,
        lt=1,
        description=(
            "Share of each engine step the replicas may spend on request work (prefill and decode tokens) "
            "beyond the step's fixed cost; the rest absorbs bursts. Near 1 the step time, and TTFT, grow "
            "without bound."
        ),
    )
    target_slot_utilization: float = Field(
        default=0.85,
        gt=0,
        le=1,
        description=(
            "Share of the engine's max_num_seqs sequence slots the fleet is planned to fill; past all of "
            "them requests wait in the engine queue and TTFT jumps."
        ),
    )
    downscale_margin: float = Field(
        default=0.1,
        ge=0,
        lt=1,
        description=(
            "A replica is removed only if the peak load of the last downscale_sustain_s fits on one "
            "replica fewer at (1 - downscale_margin) of the planned capacity: the hysteresis that keeps "
            "a steady load from flapping."
        ),
    )
    spare_replicas: int = Field(
        default=1,
        ge=0,
        le=64,
        description=(
            "Replicas added above the demand-based need while arrivals rise along a significant trend: "
            "they absorb the rest of a surge, which no scale-up can serve before replica_startup_s."
        ),
    )
    max_step_up: int = Field(
        default=4,
        ge=1,
        le=1024,
        description="Most replicas added by one decision; bounds the damage of a wrong measurement.",
    )
    trend_window_s: float = Field(
        default=60,
        gt=0,
        le=3600,
        description="Seconds of arrival-rate history the trend (rps per second) is fitted over.",
    )
    trend_min_t_stat: float = Field(
        default=4.0,
        ge=0,
        le=100,
        description=(
            "A rising trend is projected replica_startup_s ahead only if its slope is at least this many "
            "standard errors above zero, so Poisson noise on a steady load is not extrapolated."
        ),
    )
    surge_lookback_s: float = Field(
        default=1800,
        ge=0,
        le=86400,
        description=(
            "Seconds of arrival history in which the policy looks for the largest rise of the request "
            "rate over one replica_startup_s (the mean rate of a start-up's length against the one "
            "before, less its Poisson noise); it keeps that many requests/s in hand above the demand, "
            "because a surge like it would arrive before new replicas serve. Steady load rises by noise "
            "only and keeps nothing; bursty load keeps a lot. 0 turns it off."
        ),
    )
    max_surge_headroom: float = Field(
        default=1.0,
        ge=0,
        le=10,
        description=(
            "Most capacity kept in hand for surges, as a share of the demand (1: up to twice the demand)."
        ),
    )
    client_retries: int = Field(
        default=2,
        ge=0,
        le=10,
        description=(
            "How often the deployment's clients send a request again after a 503/429 with Retry-After "
            "(security.overload); the official openai client does twice by default. The policy counts a "
            "refused request once, however many attempts it made, when it sizes demand: counting every "
            "attempt would make an overload look up to (1 + client_retries) x larger than it is. No "
            "effect without overload refusal."
        ),
    )
    kv_cache_high_usage: float = Field(
        default=0.9,
        gt=0,
        le=1,
        description=(
            "KV cache usage (0-1) of the fullest replica above which the policy adds a replica (vLLM "
            "preempts requests when the cache fills) and never removes one."
        ),
    )
    capacity_seed_file: str | None = Field(
        default=None,
        min_length=1,
        description=(
            "A `headroom ladder` results.json to seed each replica's capacity from until the replicas' "
            "own engine stats replace it (the first window with finished requests). Null: no seed; the "
            "policy sizes from queueing and TTFT until then. Read where the Serve app is built."
        ),
    )
    # -- ray_queue_length only --------------------------------------------------------------------------
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
        up, down = self.scale_up_headroom, self.scale_down_headroom
        if down <= up:
            msg = (
                f"scale_down_headroom ({down}) must be > scale_up_headroom ({up}), or the hold band "
                "between them is empty and the fleet flaps"
            )
            problems.append(("scale_down_headroom", msg))
        if problems:
            raise SettingsProblems(problems)
        return self
