"""The ladder's rules on recorded results: steps, schedule, knee, noise, verdicts, recommendation, the
report files and the merge of parts; and which settings it deploys."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
from typer.testing import CliRunner

from loadtests import ladder_report
from loadtests.ladder import apply, check_features, check_only, default_features, settings_for
from loadtests.ladder_results import (
    MIN_REPEATS,
    LadderPlan,
    LadderResults,
    RunResult,
    SettingSpec,
    SpecDecodeCounts,
    StepResult,
    combined_knee,
    extend_steps,
    knee,
    schedule,
    select_units,
    spec_decode_counts,
)
from loadtests.workloads import Step
from serve_app.cli.commands import app
from serve_app.config import deep_merge, load_env_config, parse_config

REPO = Path(__file__).resolve().parents[2]
SLO_MS = 100.0
BASE = SettingSpec("baseline", None, None)
PREFIX = SettingSpec("+prefix caching", "prefix-caching", "baseline")
CHUNKED = SettingSpec("+chunked prefill", "chunked-prefill", "+prefix caching")
NGRAM = SettingSpec("+ngram speculation", "ngram", "+chunked prefill", speculative=True)
SETTINGS = [BASE, PREFIX, CHUNKED, NGRAM]


def step(c: int, ttft_p95_ms: float = 50.0, tput: float = 1000.0, tpot_ms: float = 2.0) -> StepResult:
    return StepResult(c, 100, 100, 0.0, tput, ttft_p95_ms / 2, ttft_p95_ms, tpot_ms, 200.0)


def run(setting: SettingSpec, repeat: int, steps: list[StepResult], ceiling: int = 1000, **kw) -> RunResult:
    return RunResult(
        setting=setting.name,
        repeat=repeat,
        profile=kw.pop("profile", "structured"),
        steps=steps,
        steps_planned=kw.pop("planned", [s.concurrency for s in steps]),
        peak_memory_gib=3.0,
        tokens_per_request=400.0,
        kv_cache_tokens=ceiling * 400,
        kv_ceiling=ceiling,
        raw_file=f"raw_{setting.key}_r{repeat}_structured.jsonl.gz",
        **kw,
    )


def repeats(setting: SettingSpec, tput=(1000, 1000, 1000), ttft=(50, 50, 50), tpot=(2, 2, 2), cs=(1, 4, 16)):
    """One run per repeat; the given metric values at the top step, the lower steps comfortably in the SLO."""
    return [
        run(setting, r, [*(step(c) for c in cs[:-1]), step(cs[-1], ttft[r], tput[r], tpot[r])])
        for r in range(len(tput))
    ]


def results(runs: list[RunResult], settings=SETTINGS, random_weights=False, n=3) -> LadderResults:
    plan = LadderPlan(
        model="m",
        random_weights=random_weights,
        profiles=["structured"],
        steps={"structured": "1:10,4:10,16:10"},
        ttft_slo_ms=SLO_MS,
        max_tokens=64,
        seed=0,
        repeats=n,
        settings=list(settings),
    )
    units = [u.id for u in schedule(settings, n)]
    return LadderResults(
        plan, runs, "test machine", {"vllm": "x"}, ["headroom ladder c.yaml --part 1/2"], units
    )


def analysis(runs: list[RunResult], **kw):
    [found] = ladder_report.analyses(results(runs, **kw))
    return found, {v.feature: v for v in found.verdicts}


def clear_gains() -> list[RunResult]:
    """Prefix caching and chunked prefill each clearly better; ngram clearly better again."""
    return [
        *repeats(BASE, tput=(1000, 1030, 990), ttft=(90, 95, 92)),
        *repeats(PREFIX, tput=(1500, 1480, 1530), ttft=(60, 62, 58)),
        *repeats(CHUNKED, tput=(1800, 1820, 1790), ttft=(50, 52, 49)),
        *repeats(NGRAM, tput=(2600, 2650, 2580), ttft=(45, 44, 47), tpot=(1, 1.1, 1)),
    ]


# ------------------------------------------------------------------------------------------ verdicts


def test_clear_gains_are_kept_and_the_last_setting_recommended():
    found, v = analysis(clear_gains())
    assert [v[f].status for f in ("prefix-caching", "chunked-prefill", "ngram")] == ["keep"] * 3
    rec = found.recommendation
    assert rec.setting == "+ngram speculation"
    assert rec.features == ["prefix-caching", "chunked-prefill", "ngram"]
    assert rec.max_num_seqs is not None and rec.max_num_seqs.text() == "at least 16"


def test_a_gain_inside_the_noise_band_is_no_effect():
    # chunked prefill: +4% throughput, but its own repeats spread over 10%
    runs = clear_gains()[:6] + repeats(CHUNKED, tput=(1520, 1600, 1450), ttft=(59, 61, 60))
    found, v = analysis(runs, settings=SETTINGS[:3])
    assert v["chunked-prefill"].status == "no effect"
    tput = v["chunked-prefill"].effects[0]
    assert tput.effect == "within noise" and tput.ratio == pytest.approx(1520 / 1500)
    assert tput.noise == pytest.approx((1600 - 1450) / 1520)
    assert "no effect" in v["chunked-prefill"].reason
    # Not counted as a gain: the recommendation stays at the last kept feature.
    assert found.recommendation.setting == "+prefix caching"
    assert found.recommendation.features == ["prefix-caching"]


def test_a_no_effect_feature_inside_a_recommended_setting_is_named():
    runs = [
        *repeats(BASE, tput=(1000, 1030, 990)),
        *repeats(PREFIX, tput=(1010, 1000, 1020)),  # no effect
        *repeats(CHUNKED, tput=(1600, 1580, 1620)),  # keep, measured on top of prefix caching
    ]
    found, v = analysis(runs, settings=SETTINGS[:3])
    assert v["prefix-caching"].status == "no effect" and v["chunked-prefill"].status == "keep"
    rec = found.recommendation
    assert rec.setting == "+chunked prefill" and rec.features == ["chunked-prefill"]
    assert any("prefix-caching: on in +chunked prefill" in n and "no effect" in n for n in rec.notes)


def test_a_setting_that_contains_a_rejected_feature_is_never_recommended():
    runs = [
        *repeats(BASE, tput=(1000, 1030, 990), ttft=(50, 52, 49)),
        *repeats(PREFIX, tput=(800, 790, 810), ttft=(70, 72, 69)),  # worse: switch off
        *repeats(CHUNKED, tput=(1600, 1580, 1620), ttft=(40, 41, 40)),  # a big gain, but on top of it
        *repeats(NGRAM, tput=(2600, 2650, 2580), ttft=(35, 36, 35)),
    ]
    found, v = analysis(runs)
    assert v["prefix-caching"].status == "switch off"
    assert v["chunked-prefill"].status == "keep" and v["ngram"].status == "keep"
    rec = found.recommendation
    assert rec.setting == "baseline" and rec.features == []
    assert any("prefix-caching (switch off)" in n for n in rec.notes)


def test_an_unjudged_feature_is_never_recommended():
    # prefix caching has two repeats: not judged, though its two look like a large gain
    runs = [
        *repeats(BASE),
        *repeats(PREFIX, tput=(2000, 2050), ttft=(30, 31), tpot=(2, 2)),
        *repeats(CHUNKED, tput=(3000, 3010, 2990)),
    ]
    found, v = analysis(runs, settings=SETTINGS[:3])
    assert v["prefix-caching"].status == "not judged"
    reason = v["prefix-caching"].reason
    assert f"+prefix caching 2, {MIN_REPEATS} needed" in reason
    # says what to run: the missing unit, with the ladder's own command (its --part dropped)
    assert "`headroom ladder c.yaml --repeats 3 --only prefix-caching@2 --out NEW_DIR`" in reason
    rec = found.recommendation
    assert rec.setting == "baseline" and rec.features == []
    assert all(s not in rec.setting for s in ("prefix", "chunked"))


def test_a_trade_is_switched_off_and_the_seeds_warning_holds():
    # ngram: TPOT x0.5 and more throughput, but TTFT p95 x3 at the top step
    runs = clear_gains()[:9] + repeats(NGRAM, tput=(2100, 2150, 2080), ttft=(150, 155, 148), tpot=(1, 1, 1))
    found, v = analysis(runs)
    assert v["ngram"].status == "switch off"
    assert "a trade, not a gain" in v["ngram"].reason
    assert {e.metric: e.effect for e in v["ngram"].effects} == {
        "output tok/s": "better",
        "TTFT p95": "worse",
        "TPOT p50": "better",
    }
    assert found.recommendation.setting == "+chunked prefill"


def test_speculation_on_random_weights_is_mechanics_not_a_recommendation():
    found, v = analysis(clear_gains(), random_weights=True)
    assert v["ngram"].status == "mechanics only"
    assert "not a recommendation" in v["ngram"].reason and "random" in v["ngram"].reason
    assert found.recommendation.setting == "+chunked prefill"
    assert "ngram" not in found.recommendation.features


def test_judged_at_the_highest_step_every_repeat_of_both_measured():
    runs = clear_gains()[:3] + [  # prefix caching: one repeat stopped at 4 (a breach)
        run(PREFIX, 0, [step(1), step(4, 150)]),
        run(PREFIX, 1, [step(1), step(4, 60), step(16, 80)]),
        run(PREFIX, 2, [step(1), step(4, 60), step(16, 80)]),
    ]
    _, v = analysis(runs, settings=SETTINGS[:2])
    assert v["prefix-caching"].concurrency == 4


# ------------------------------------------------------------------------------------------ knee


def test_no_breach_gives_at_least_n_and_says_why():
    within = [step(1), step(4), step(16)]
    k = knee(within, [1, 4, 16], SLO_MS, ceiling=1000)
    assert (k.concurrency, k.at_least, k.stopped_by) == (16, True, "max-steps")
    assert k.text() == "at least 16"
    assert knee(within, [1, 4, 16, 32], SLO_MS, ceiling=1000).stopped_by == "incomplete"
    assert knee(within, [1, 4, 16], SLO_MS, ceiling=10).stopped_by == "ceiling"


def test_knee_is_the_last_step_before_the_first_breach():
    rows = [step(1, 50), step(4, 90), step(16, 150), step(32, 80)]
    k = knee(rows, [1, 4, 16, 32], SLO_MS, ceiling=1000)
    assert (k.concurrency, k.at_least, k.stopped_by, k.text()) == (4, False, "breach", "4")
    assert knee([step(1, math.nan)], [1], SLO_MS, 1000).concurrency is None  # nothing succeeded: a breach
    assert knee([step(1, 500)], [1], SLO_MS, 1000).text() == "none (the first step breached)"


def test_a_settings_knee_holds_in_every_repeat():
    at_least_16 = knee([step(1), step(16)], [1, 16], SLO_MS, 1000)
    breach_at_16 = knee([step(1), step(16, 500)], [1, 16], SLO_MS, 1000)
    assert combined_knee([at_least_16, breach_at_16]).text() == "1"
    assert combined_knee([at_least_16, at_least_16]).text() == "at least 16"


def test_knee_and_ceiling_side_by_side():
    runs = [run(BASE, r, [step(1), step(4), step(16, 150)], ceiling=64) for r in range(3)]
    found, _ = analysis(runs, settings=[BASE])
    [summary] = found.summaries
    assert summary.knee is not None and summary.knee.text() == "4"
    assert summary.kv_ceiling == 64 and summary.knee_to_ceiling == pytest.approx(4 / 64)


# ------------------------------------------------------------------------------------------ steps, schedule


def test_steps_extend_by_doubling_until_past_the_ceiling():
    given = [Step(1, 10), Step(16, 10), Step(64, 10)]
    assert [s.value for s in extend_steps(given, 300, max_steps=10)] == [1, 16, 64, 128, 256, 512]
    assert [s.value for s in extend_steps(given, 300, max_steps=4)] == [1, 16, 64, 128]
    assert [s.value for s in extend_steps(given, 10, max_steps=10)] == [1, 16, 64]  # already past it
    assert {s.duration_s for s in extend_steps(given, 300, 10)} == {10}


def test_schedule_interleaves_fresh_engines():
    units = schedule(SETTINGS, 3)
    assert len(units) == 12 and len({u.id for u in units}) == 12
    assert [u.key for u in units[:4]] == ["baseline", "prefix-caching", "chunked-prefill", "ngram"]
    assert [u.key for u in units[4:8]] == ["prefix-caching", "chunked-prefill", "ngram", "baseline"]
    assert all(a.setting != b.setting for a, b in zip(units, units[1:], strict=False))
    # two calls of two GPUs each: four slices, every unit exactly once
    parts = [select_units(units, (k, 4), []) for k in range(1, 5)]
    assert [len(p) for p in parts] == [3, 3, 3, 3]
    assert sorted(u.id for p in parts for u in p) == sorted(u.id for u in units)
    assert [u.id for u in select_units(units, None, ["ngram@2", "baseline@0"])] == ["baseline@0", "ngram@2"]


# -------------------------------------------------------------------------------- speculation counters


def test_spec_decode_counts_from_vllms_metrics():
    samples = [
        ("ray_vllm_spec_decode_num_drafts_total", {"ReplicaId": "a"}, 100.0),
        ("ray_vllm_spec_decode_num_draft_tokens_total", {"ReplicaId": "a"}, 300.0),
        ("ray_vllm_spec_decode_num_accepted_tokens_total", {"ReplicaId": "a"}, 150.0),
        ("ray_vllm_spec_decode_num_drafts_total", {"ReplicaId": "other-app"}, 999.0),
        ("ray_vllm_spec_decode_num_drafts_created", {"ReplicaId": "a"}, 1.7e9),
    ]
    counts = spec_decode_counts(samples, {"a"})
    assert counts == SpecDecodeCounts(100, 300, 150)
    assert counts.acceptance_rate == pytest.approx(0.5)
    assert counts.mean_accepted_length == pytest.approx(2.5)  # 1 + accepted / drafts
    engine_own = [("vllm:spec_decode_num_drafts_total", {}, 4.0)]
    assert spec_decode_counts(engine_own, None).drafts == 4
    assert math.isnan(SpecDecodeCounts().acceptance_rate)
    assert counts - SpecDecodeCounts(10, 30, 15) == SpecDecodeCounts(90, 270, 135)


def test_speculation_counters_reach_the_report(tmp_path):
    runs = clear_gains()
    runs[-1] = RunResult(**{**runs[-1].__dict__, "spec_decode": SpecDecodeCounts(10, 30, 12)})
    ladder_report.write(results(runs, random_weights=True), tmp_path)
    report = (tmp_path / "report.md").read_text()
    assert "| +ngram speculation | 10 | 30 | 12 | 40.0% | 2.20 |" in report
    assert "mechanics, not whether it pays" in report


# ------------------------------------------------------------------------------------------ files and merge


def test_results_round_trip_and_report(tmp_path):
    original = results(clear_gains())
    ladder_report.write(original, tmp_path)
    assert ladder_report.read(tmp_path) == original
    report = (tmp_path / "report.md").read_text()
    assert "setting: **+ngram speculation**" in report and "max_num_seqs: **at least 16**" in report
    assert (tmp_path / "ladder-structured.png").stat().st_size > 10_000


def test_parts_merge_into_one_report(tmp_path):
    runs = clear_gains()
    first, second = tmp_path / "part1", tmp_path / "part2"
    ladder_report.write(results(runs[:6]), first)
    ladder_report.write(results(runs[6:]), second)
    merged = ladder_report.merge([first, second], tmp_path / "all")
    assert len(merged.runs) == 12
    assert merged.runs[0].raw_file == "../part1/raw_baseline_r0_structured.jsonl.gz"
    [found] = ladder_report.analyses(merged)
    assert found.recommendation.setting == "+ngram speculation"
    with pytest.raises(ValueError, match="is in two parts"):
        ladder_report.merge([first, first], tmp_path / "all")
    # a part run later with more repeats merges (the repeat count is raised); another ladder does not
    ladder_report.write(results(runs[6:], n=4), second)
    assert ladder_report.merge([first, second], tmp_path / "all").plan.repeats == 4
    other = results(runs[6:])
    ladder_report.write(dataclasses.replace(other, plan=dataclasses.replace(other.plan, seed=1)), second)
    with pytest.raises(ValueError, match="a different ladder"):
        ladder_report.merge([first, second], tmp_path / "all")


def test_base_command_drops_part_options():
    cmd = "headroom ladder a.yaml --profile random --part 1/2 --out x --only=ngram@0 --steps 1:5 --repeats 1"
    assert ladder_report.base_command(cmd) == "headroom ladder a.yaml --profile random --steps 1:5"


def test_committed_cpu_ladder_recommends_only_judged_settings():
    found = ladder_report.analyses(ladder_report.read(REPO / "results" / "ladder-cpu"))
    for profile in found:
        by_setting = {v.setting: v for v in profile.verdicts}
        chosen = next(s for s in profile.summaries if s.setting.name == profile.recommendation.setting)
        setting, contained = chosen.setting, []
        while setting.parent is not None:
            contained.append(by_setting[setting.name])
            setting = next(s.setting for s in profile.summaries if s.setting.name == setting.parent)
        assert all(v.status in ("keep", "no effect") for v in contained), contained


# ------------------------------------------------------------------------------------------ settings


def local(**overlay):
    return parse_config(deep_merge(load_env_config("local").model_dump(mode="json"), overlay))


DRAFT = {"method": "draft_model", "draft_model": "embedded:tiny-qwen3-draft", "num_speculative_tokens": 3}


def test_settings_switch_features_on_one_at_a_time():
    cfg = local(engine={"speculative": DRAFT})
    settings = settings_for(cfg, default_features(cfg))
    assert [s.name for s in settings] == [
        "baseline",
        "+prefix caching",
        "+chunked prefill",
        "+ngram speculation",
        "+draft_model speculation",
    ]
    assert [s.parent for s in settings] == [
        None,
        "baseline",
        "+prefix caching",
        "+chunked prefill",
        "+chunked prefill",
    ]
    engines = [apply(cfg, s, "ladder").engine for s in settings]
    assert [e.enable_prefix_caching for e in engines] == [False, True, True, True, True]
    assert [e.enable_chunked_prefill for e in engines] == [False, False, True, True, True]
    assert [e.speculative.method if e.speculative else None for e in engines] == [
        None,
        None,
        None,
        "ngram",
        "draft_model",
    ]
    # With chunked prefill off, a whole prompt must fit one step.
    assert engines[0].max_num_batched_tokens >= cfg.model.max_model_len


def test_features_choose_the_rungs():
    cfg = local()
    assert default_features(cfg) == ["prefix-caching", "chunked-prefill", "ngram"]
    names = [s.name for s in settings_for(cfg, ["chunked-prefill", "ngram"])]
    assert names == ["baseline", "+chunked prefill", "+ngram speculation"]
    with pytest.raises(ValueError, match="'turbo' is not one of prefix-caching, chunked-prefill, ngram"):
        check_features(cfg, ["turbo"])
    with pytest.raises(ValueError, match="needs the config's engine.speculative to use method 'draft_model'"):
        check_features(cfg, ["draft_model"])
    with pytest.raises(ValueError, match="listed twice"):
        check_features(cfg, ["ngram", "ngram"])
    with pytest.raises(ValueError, match="ngram@3 not in this ladder's units"):
        check_only(cfg, None, 3, ["ngram@3"])


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (["--part", "3/2"], "--part"),
        (["--only", "ngram@7"], "--only"),
        (["--features", "turbo"], "--features"),
        (["--profile", "poetry"], "--profile"),
        (["--steps", "4"], "--steps"),
        (["--app-name", "Bad_Name"], "--app-name"),
    ],
)
def test_bad_ladder_flags_exit_2_naming_the_flag(args, flag, tmp_path):
    result = CliRunner().invoke(app, ["ladder", "--env", "local", "--out", str(tmp_path), *args])
    assert result.exit_code == 2, result.output
    assert flag in result.output


def test_gpu_report_merges_the_parts_of_both_calls(tmp_path):
    from loadtests.gpu.report import copy_ladder

    runs = clear_gains()
    for call, k, part in ((1, 1, runs[:3]), (1, 2, runs[3:6]), (2, 3, runs[6:9]), (2, 4, runs[9:])):
        folder = tmp_path / "run" / f"ladder-{call}" / f"part{k}"
        ladder_report.write(results(part), folder)
        for r in part:
            (folder / r.raw_file).write_bytes(b"")
    copy_ladder(tmp_path / "run", tmp_path / "out" / "ladder")
    merged = ladder_report.read(tmp_path / "out" / "ladder")
    assert len(merged.runs) == 12
    assert (tmp_path / "out" / "ladder" / "part4" / runs[-1].raw_file).is_file()
    assert merged.runs[-1].raw_file == f"part4/{runs[-1].raw_file}"
