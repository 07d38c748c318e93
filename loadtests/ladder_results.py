"""What the tuning ladder measured, and what follows from it: typed results, noise bands, verdicts and the
recommendation. Pure: no Ray, no vLLM, no I/O; loadtests/ladder.py measures, loadtests/ladder_report.py
writes.

The rules, each a function below:
- Steps: the given concurrency steps, extended by doubling until a step passes the KV-estimated ceiling
  (the planner's KV tokens / tokens per request), at most `max_steps` in all (`extend_steps`). A run ends
  at its first SLO breach (the Locust shape stops it), so the extension costs time only while the SLO holds.
- Schedule: every setting `repeats` times, each on a fresh engine, interleaved (repeat r runs the settings
  rotated by r), so slow drift spreads over every setting instead of biasing one (`schedule`).
- Knee (production concurrency): per run, the last step before TTFT p95 first exceeds the SLO; with no
  breach it is "at least" the highest step measured, and why the run stopped is kept (`knee`). A setting's
  knee is its lowest over the repeats: the concurrency that held the SLO in every repeat.
- Noise: at the step a feature is judged at, each metric's relative spread over a setting's repeats,
  (max - min) / median; a comparison's band is the larger of the two settings' spreads, at least
  NOISE_FLOOR (three repeats can happen to agree).
- Verdict (`judge`): a feature is compared with the setting it was added to, at the highest concurrency
  every repeat of both measured, on output throughput, TTFT p95 and TPOT p50 (the seeds: watch TTFT and
  TPOT, not only throughput). A metric moved when the median ratio leaves the band. keep: something got
  better and nothing worse; switch off: something got worse (a trade, not a gain); no effect: nothing left
  the band; not judged: fewer than MIN_REPEATS repeats on either side, or no common step. Speculative
  decoding on random weights (the embedded models, model.dummy_weights) is "mechanics only": its
  acceptance says nothing about real text.
- Recommendation (`recommend`): settings are cumulative, so it walks baseline -> each feature in order
  and stops at the first feature that is switched off, not judged, or mechanics only: no later setting
  contains it. The recommended setting is the last one on that walk that added a kept feature; of the
  speculation methods (alternatives, each added to the last non-speculative setting), the kept one with
  the most throughput, when the walk reached them. max_num_seqs is that setting's knee.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from loadtests.measure import percentile
from loadtests.workloads import Step

MIN_REPEATS = 3
NOISE_FLOOR = 0.02

StopReason = Literal["breach", "ceiling", "max-steps", "incomplete"]
Status = Literal["keep", "no effect", "switch off", "not judged", "mechanics only"]
Effect = Literal["better", "worse", "within noise"]
BASELINE = "baseline"

# The three metrics a feature is judged on: (field of StepResult, label, whether higher is better).
JUDGED_METRICS: tuple[tuple[str, str, bool], ...] = (
    ("output_tokens_per_s", "output tok/s", True),
    ("ttft_p95_ms", "TTFT p95", False),
    ("tpot_p50_ms", "TPOT p50", False),
)


# ------------------------------------------------------------------------------------------ what was run


@dataclass(frozen=True)
class SettingSpec:
    """One rung: `feature` (None for the baseline) added to the setting named `parent`."""

    name: str
    feature: str | None
    parent: str | None
    speculative: bool = False
    engine: dict[str, object] = field(default_factory=dict)

    @property
    def key(self) -> str:
        return self.feature or BASELINE


@dataclass(frozen=True)
class Unit:
    """One fresh engine: a setting's repeat, measured on every profile."""

    setting: str
    repeat: int
    key: str

    @property
    def id(self) -> str:
        return f"{self.key}@{self.repeat}"


@dataclass(frozen=True)
class LadderPlan:
    """What the ladder was asked to measure; the same for every part of a run."""

    model: str
    random_weights: bool
    profiles: list[str]
    steps: dict[str, str]  # per profile, users:seconds as run (given steps plus the extension)
    ttft_slo_ms: float
    max_tokens: int
    seed: int
    repeats: int
    settings: list[SettingSpec]


# ------------------------------------------------------------------------------------------ what was measured


@dataclass(frozen=True)
class StepResult:
    """One concurrency step of one run (exact statistics of the raw file, warm-up excluded)."""

    concurrency: int
    requests: int
    ok: int
    error_rate: float
    output_tokens_per_s: float
    ttft_p50_ms: float
    ttft_p95_ms: float
    tpot_p50_ms: float
    e2e_p50_ms: float


@dataclass(frozen=True)
class SpecDecodeCounts:
    """vLLM's speculative-decoding counters over a run (vllm:spec_decode_num_*)."""

    drafts: float = 0.0
    draft_tokens: float = 0.0
    accepted_tokens: float = 0.0

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens / proposed draft tokens (vLLM's draft acceptance rate)."""
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else math.nan

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per verification step: 1 + accepted / drafts (vLLM's mean acceptance length)."""
        return 1 + self.accepted_tokens / self.drafts if self.drafts else math.nan

    def __add__(self, other: SpecDecodeCounts) -> SpecDecodeCounts:
        return SpecDecodeCounts(
            self.drafts + other.drafts,
            self.draft_tokens + other.draft_tokens,
            self.accepted_tokens + other.accepted_tokens,
        )

    def __sub__(self, other: SpecDecodeCounts) -> SpecDecodeCounts:
        return SpecDecodeCounts(
            self.drafts - other.drafts,
            self.draft_tokens - other.draft_tokens,
            self.accepted_tokens - other.accepted_tokens,
        )


SPEC_DECODE_COUNTERS = {
    "vllm_spec_decode_num_drafts": "drafts",
    "vllm_spec_decode_num_draft_tokens": "draft_tokens",
    "vllm_spec_decode_num_accepted_tokens": "accepted_tokens",
}


def spec_decode_counts(
    samples: Iterable[tuple[str, dict[str, str], float]], replica_ids: set[str] | None
) -> SpecDecodeCounts:
    """vLLM's speculation counters summed over Prometheus samples (name, labels, value): the engine's own
    (`vllm:spec_decode_num_drafts_total`) or Ray's export of them (`ray_vllm_spec_decode_num_drafts_total`,
    labelled with the Serve ReplicaId); with `replica_ids`, only those replicas' series."""
    totals = dict.fromkeys(SPEC_DECODE_COUNTERS.values(), 0.0)
    for name, labels, value in samples:
        key = SPEC_DECODE_COUNTERS.get(name.removeprefix("ray_").replace(":", "_").removesuffix("_total"))
        if key is not None and (replica_ids is None or labels.get("ReplicaId") in replica_ids):
            totals[key] += value
    return SpecDecodeCounts(**totals)


@dataclass(frozen=True)
class RunResult:
    """One setting, one repeat, one profile: one Locust ladder against one engine."""

    setting: str
    repeat: int
    profile: str
    steps: list[StepResult]
    steps_planned: list[int]
    peak_memory_gib: float
    tokens_per_request: float
    kv_cache_tokens: int
    kv_ceiling: int  # requests of this run's mean size the planner's KV cache holds
    raw_file: str
    engine_start_s: float | None = None
    spec_decode: SpecDecodeCounts | None = None


@dataclass(frozen=True)
class LadderResults:
    """Everything a ladder (or the merge of its parts) measured, with how it was run."""

    plan: LadderPlan
    runs: list[RunResult]
    machine: str
    versions: dict[str, str]
    commands: list[str]
    units_planned: list[str]


# ---------------------------------------------------------------------------- steps and schedule


def extend_steps(steps: Sequence[Step], kv_ceiling: int, max_steps: int) -> list[Step]:
    """The given steps, then doubling concurrency (at the last step's duration) until a step passes
    `kv_ceiling`, at most `max_steps` steps in all."""
    out = list(steps)
    while len(out) < max_steps and out[-1].value <= kv_ceiling:
        out.append(Step(max(1.0, out[-1].value * 2), out[-1].duration_s))
    return out


def schedule(settings: Sequence[SettingSpec], repeats: int) -> list[Unit]:
    """Every setting `repeats` times, interleaved: repeat r runs the settings rotated left by r."""
    n = len(settings)
    return [Unit(s.name, r, s.key) for r in range(repeats) for s in (settings[(r + i) % n] for i in range(n))]


def select_units(units: Sequence[Unit], part: tuple[int, int] | None, only: Sequence[str]) -> list[Unit]:
    """`part` (k, m): the k-th of m contiguous slices of the schedule (1-based); `only`: these unit ids."""
    chosen = list(units)
    if part is not None:
        k, m = part
        size = math.ceil(len(chosen) / m)
        chosen = chosen[(k - 1) * size : k * size]
    if only:
        chosen = [u for u in chosen if u.id in only]
    return chosen


# ------------------------------------------------------------------------------------------ knee


@dataclass(frozen=True)
class Knee:
    """The production concurrency a run found: the last step within the SLO (None: even the first step
    breached). `at_least`: no step breached, so the true knee is at or above it."""

    concurrency: int | None
    at_least: bool
    stopped_by: StopReason

    def text(self) -> str:
        if self.concurrency is None:
            return "none (the first step breached)"
        return f"at least {self.concurrency}" if self.at_least else str(self.concurrency)


def knee(steps: Sequence[StepResult], steps_planned: Sequence[int], ttft_slo_ms: float, ceiling: int) -> Knee:
    """The last step before TTFT p95 first exceeds the SLO (NaN, no successful request, is a breach)."""
    last_ok: int | None = None
    for step in sorted(steps, key=lambda s: s.concurrency):
        if not step.ttft_p95_ms <= ttft_slo_ms:
            return Knee(last_ok, False, "breach")
        last_ok = step.concurrency
    if last_ok is not None and last_ok > ceiling:
        return Knee(last_ok, True, "ceiling")
    measured = {s.concurrency for s in steps}
    return Knee(last_ok, True, "max-steps" if set(steps_planned) <= measured else "incomplete")


def combined_knee(knees: Sequence[Knee]) -> Knee:
    """The knee that held in every repeat: the lowest (a breach before an "at least" at the same step)."""
    if any(k.concurrency is None for k in knees):
        return next(k for k in knees if k.concurrency is None)
    return min(knees, key=lambda k: (k.concurrency or 0, k.at_least))


def stop_note(k: Knee, slo_ms: float) -> str:
    """Why a run ended where it did, in words."""
    return {
        "breach": f"TTFT p95 exceeded {slo_ms:g} ms at the next step",
        "ceiling": "the steps passed the KV-estimated ceiling without a breach: KV memory, not TTFT, limits",
        "max-steps": "no breach within --max-steps: rerun with more steps to find the knee",
        "incomplete": "the run ended before its last step: rerun it",
    }[k.stopped_by]


# ------------------------------------------------------------------------------------------ spread


@dataclass(frozen=True)
class Spread:
    """One metric over a setting's repeats at one step: median and range."""

    median: float
    low: float
    high: float
    n: int

    @property
    def relative(self) -> float:
        """(max - min) / median: the measured noise."""
        return (self.high - self.low) / abs(self.median) if self.median else math.nan

    def text(self, fmt: str = ".1f") -> str:
        if self.n == 0 or math.isnan(self.median):
            return "-"
        if self.n == 1:
            return f"{self.median:{fmt}}"
        return f"{self.median:{fmt}} ({self.low:{fmt}}-{self.high:{fmt}})"


def spread(values: Iterable[float]) -> Spread:
    data = [v for v in values if not math.isnan(v)]
    if not data:
        return Spread(math.nan, math.nan, math.nan, 0)
    return Spread(percentile(data, 50), min(data), max(data), len(data))


@dataclass(frozen=True)
class StepSummary:
    """One concurrency step of one setting over its repeats."""

    concurrency: int
    repeats: int
    metrics: dict[str, Spread]  # StepResult field -> spread
    error_rate_max: float


def step_summaries(runs: Sequence[RunResult]) -> list[StepSummary]:
    by_c: dict[int, list[StepResult]] = {}
    for run in runs:
        for step in run.steps:
            by_c.setdefault(step.concurrency, []).append(step)
    fields = ("output_tokens_per_s", "ttft_p50_ms", "ttft_p95_ms", "tpot_p50_ms", "e2e_p50_ms")
    return [
        StepSummary(
            c,
            len(steps),
            {f: spread(float(getattr(s, f)) for s in steps) for f in fields},
            max(s.error_rate for s in steps),
        )
        for c, steps in sorted(by_c.items())
    ]


@dataclass(frozen=True)
class SettingSummary:
    """A setting on one profile, over its repeats."""

    setting: SettingSpec
    repeats: int
    steps: list[StepSummary]
    knees: list[Knee]
    knee: Knee | None
    kv_ceiling: int | None
    peak_memory_gib: Spread
    spec_decode: SpecDecodeCounts | None

    @property
    def knee_to_ceiling(self) -> float:
        if self.knee is None or not self.knee.concurrency or not self.kv_ceiling:
            return math.nan
        return self.knee.concurrency / self.kv_ceiling


def summarize_setting(setting: SettingSpec, runs: Sequence[RunResult], ttft_slo_ms: float) -> SettingSummary:
    knees = [knee(r.steps, r.steps_planned, ttft_slo_ms, r.kv_ceiling) for r in runs]
    spec = [r.spec_decode for r in runs if r.spec_decode is not None]
    return SettingSummary(
        setting=setting,
        repeats=len(runs),
        steps=step_summaries(runs),
        knees=knees,
        knee=combined_knee(knees) if knees else None,
        kv_ceiling=min(r.kv_ceiling for r in runs) if runs else None,
        peak_memory_gib=spread(r.peak_memory_gib for r in runs),
        spec_decode=sum(spec[1:], spec[0]) if spec else None,
    )


# ------------------------------------------------------------------------------------------ verdicts


@dataclass(frozen=True)
class MetricEffect:
    metric: str
    ratio: float  # after / before, medians over the repeats
    noise: float  # the band: the larger relative spread of the two settings, >= NOISE_FLOOR
    effect: Effect

    def text(self) -> str:
        return f"{self.metric} x{self.ratio:.2f} (noise ±{self.noise:.0%}, {self.effect})"


@dataclass(frozen=True)
class Verdict:
    feature: str
    setting: str
    against: str
    status: Status
    concurrency: int | None
    effects: list[MetricEffect]
    reason: str


def metric_effect(label: str, higher_is_better: bool, before: Spread, after: Spread) -> MetricEffect:
    ratio = after.median / before.median if before.median else math.nan
    noise = max(before.relative, after.relative, NOISE_FLOOR)
    gain = ratio - 1 if higher_is_better else 1 - ratio
    effect: Effect = "better" if gain > noise else "worse" if gain < -noise else "within noise"
    return MetricEffect(label, ratio, noise, effect)


def judged_step(before: SettingSummary, after: SettingSummary) -> int | None:
    """The highest concurrency every repeat of both settings measured, with all three metrics."""

    def complete(summary: SettingSummary) -> set[int]:
        return {
            s.concurrency
            for s in summary.steps
            if s.repeats == summary.repeats and all(s.metrics[f].n == s.repeats for f, _, _ in JUDGED_METRICS)
        }

    common = complete(before) & complete(after)
    return max(common) if common else None


def judge(before: SettingSummary, after: SettingSummary, random_weights: bool, rerun: str) -> Verdict:
    """`after`'s feature against `before` (see the module docstring); `rerun` says what to run when the
    verdict cannot be reached."""
    feature = after.setting.feature or BASELINE

    def verdict(status: Status, c: int | None, effects: list[MetricEffect], reason: str) -> Verdict:
        return Verdict(feature, after.setting.name, before.setting.name, status, c, effects, reason)

    short = [s for s in (before, after) if s.repeats < MIN_REPEATS]
    if short:
        counts = ", ".join(f"{s.setting.name} {s.repeats}" for s in short)
        return verdict(
            "not judged",
            None,
            [],
            f"not judged: repeats measured {counts}, {MIN_REPEATS} needed; run {rerun}",
        )
    c = judged_step(before, after)
    if c is None:
        return verdict(
            "not judged",
            None,
            [],
            f"not judged: no concurrency step measured by every repeat of both settings; run {rerun}",
        )
    b = next(s for s in before.steps if s.concurrency == c)
    a = next(s for s in after.steps if s.concurrency == c)
    effects = [metric_effect(label, up, b.metrics[f], a.metrics[f]) for f, label, up in JUDGED_METRICS]
    worse = [e for e in effects if e.effect == "worse"]
    better = [e for e in effects if e.effect == "better"]
    where = f"at concurrency {c} against {before.setting.name}: " + "; ".join(e.text() for e in effects)
    if after.setting.speculative and random_weights:
        return verdict(
            "mechanics only",
            c,
            effects,
            "mechanics only, not a recommendation: the weights are random, so draft acceptance says "
            f"nothing about real text; {where}",
        )
    if worse:
        trade = " (a trade, not a gain)" if better else ""
        return verdict("switch off", c, effects, f"switch off: worse beyond the noise{trade}, {where}")
    if better:
        return verdict("keep", c, effects, f"keep: better beyond the noise, nothing worse, {where}")
    return verdict("no effect", c, effects, f"no effect: every change within the noise, {where}")


# ------------------------------------------------------------------------------------------ recommendation


@dataclass(frozen=True)
class Recommendation:
    setting: str
    features: list[str]  # kept features in the recommended setting
    max_num_seqs: Knee | None
    notes: list[str]  # features in the setting without a measured gain, and why the walk stopped


def recommend(summaries: Sequence[SettingSummary], verdicts: Sequence[Verdict]) -> Recommendation:
    """The setting to run (see the module docstring); never one that contains a feature that is switched
    off, not judged, or mechanics only. `summaries` start with the baseline."""
    by_setting = {v.setting: v for v in verdicts}
    chain = [s for s in summaries if not s.setting.speculative]
    chosen, chosen_on, on = chain[0], [], []
    notes: list[str] = []
    for summary in chain[1:]:
        v = by_setting[summary.setting.name]
        if v.status not in ("keep", "no effect"):
            notes.append(
                f"the walk stops at {v.feature} ({v.status}): every setting from "
                f"{summary.setting.name} on contains it"
            )
            break
        on.append(v)
        if v.status == "keep":
            chosen, chosen_on = summary, list(on)
    else:  # every non-speculative feature is kept or harmless: the speculation methods build on them all
        spec = [(by_setting[s.setting.name], s) for s in summaries if s.setting.speculative]
        kept = [(v, s) for v, s in spec if v.status == "keep"]
        if kept:
            best, chosen = max(kept, key=lambda vs: vs[0].effects[0].ratio)
            chosen_on = [*on, best]
    notes = [
        f"{v.feature}: on in {chosen.setting.name} (settings are cumulative), no effect measured"
        for v in chosen_on
        if v.status == "no effect"
    ] + notes
    features = [v.feature for v in chosen_on if v.status == "keep"]
    return Recommendation(chosen.setting.name, features, chosen.knee, notes)


# ------------------------------------------------------------------------------------------ per profile


@dataclass(frozen=True)
class ProfileAnalysis:
    profile: str
    summaries: list[SettingSummary]
    verdicts: list[Verdict]
    recommendation: Recommendation


def missing_units(results: LadderResults, settings: Sequence[SettingSpec], profile: str) -> list[str]:
    """Unit ids (key@repeat) a verdict on these settings still needs, up to MIN_REPEATS repeats."""
    measured = {(r.setting, r.repeat) for r in results.runs if r.profile == profile}
    repeats = max(results.plan.repeats, MIN_REPEATS)
    return [f"{s.key}@{r}" for s in settings for r in range(repeats) if (s.name, r) not in measured]


def analyze(results: LadderResults, rerun_command: str) -> list[ProfileAnalysis]:
    """Summaries, verdicts and the recommendation for each profile. `rerun_command` is the ladder's own
    command line, to say what to run for a verdict that could not be reached."""
    plan = results.plan
    out = []
    for profile in plan.profiles:
        summaries = [
            summarize_setting(
                s, [r for r in results.runs if r.profile == profile and r.setting == s.name], plan.ttft_slo_ms
            )
            for s in plan.settings
        ]
        by_name = {s.setting.name: s for s in summaries}
        verdicts = []
        for after in summaries[1:]:
            before = by_name[after.setting.parent or BASELINE]
            ids = missing_units(results, [before.setting, after.setting], profile) or [
                f"{s.key}@{r}" for s in (before.setting, after.setting) for r in range(plan.repeats)
            ]
            rerun = f"`{rerun_command} --only {','.join(ids)} --out NEW_DIR` and merge it (--merge)"
            verdicts.append(judge(before, after, plan.random_weights, rerun))
        out.append(ProfileAnalysis(profile, summaries, verdicts, recommend(summaries, verdicts)))
    return out
