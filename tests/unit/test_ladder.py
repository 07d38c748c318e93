"""The ladder's decisions: which settings run, the production concurrency, and what to recommend."""

from __future__ import annotations

import math

from loadtests.ladder import apply, feature_verdicts, production_concurrency, recommend, settings_for
from serve_app.config import deep_merge, load_env_config, parse_config


def local(**overlay):
    return parse_config(deep_merge(load_env_config("local").model_dump(mode="json"), overlay))


def steps(*rows):
    return [
        {"concurrency": c, "ttft_p95_ms": ttft, "tpot_p50_ms": tpot, "output_tokens_per_s": tput}
        for c, ttft, tpot, tput in rows
    ]


def run(setting, feature, rows, production=None):
    return {
        "setting": setting,
        "feature": feature,
        "steps": steps(*rows),
        "production_concurrency": production,
    }


def test_settings_switch_features_on_one_at_a_time():
    draft = {"method": "draft_model", "draft_model": "embedded:tiny-qwen3-draft", "num_speculative_tokens": 3}
    cfg = local(engine={"speculative": draft})
    names = [s.name for s in settings_for(cfg)]
    assert names == [
        "baseline",
        "+prefix caching",
        "+chunked prefill",
        "+ngram speculation",
        "+draft-model speculation",
    ]
    engines = [apply(cfg, s, "ladder").engine for s in settings_for(cfg)]
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


def test_no_draft_setting_without_a_draft_model():
    assert [s.name for s in settings_for(local())][-1] == "+ngram speculation"


def test_production_concurrency_is_the_last_step_within_the_slo():
    rows = steps((1, 50, 2, 100), (4, 90, 2, 300), (16, 150, 3, 600), (32, 80, 4, 700))
    assert production_concurrency(rows, ttft_slo_ms=100) == 4  # the first breach ends it
    assert production_concurrency(rows, ttft_slo_ms=10) is None
    assert production_concurrency(steps((1, math.nan, 2, 0)), ttft_slo_ms=100) is None


def test_speculation_that_loses_at_high_concurrency_is_switched_off():
    runs = [
        run("baseline", None, [(1, 50, 2, 100), (16, 200, 4, 1000)], 1),
        run("+prefix caching", "prefix caching", [(1, 30, 2, 110), (16, 120, 4, 1100)], 16),
        run("+chunked prefill", "chunked prefill", [(1, 30, 2, 110), (16, 115, 4, 1120)], 16),
        # ngram: faster at low concurrency, but TTFT x1.5 and less throughput at 16 (the seeds' warning).
        run("+ngram speculation", "ngram speculation", [(1, 25, 1, 150), (16, 180, 3, 1000)], 1),
        run("+draft-model speculation", "draft-model speculation", [(1, 25, 1, 150), (16, 110, 3, 1300)], 16),
    ]
    verdicts = {v["feature"]: v for v in feature_verdicts(runs)}
    assert verdicts["prefix caching"]["keep"] and verdicts["chunked prefill"]["keep"]
    assert not verdicts["ngram speculation"]["keep"]
    assert "switch off" in verdicts["ngram speculation"]["reason"]
    # Speculation methods are compared with the last non-speculative setting, not with each other.
    assert "against +chunked prefill" in verdicts["draft-model speculation"]["reason"]
    rec = recommend(runs, ttft_slo_ms=150)
    assert rec["features"] == ["prefix caching", "chunked prefill", "draft-model speculation"]
    assert rec["setting"] == "+draft-model speculation" and rec["max_num_seqs"] == 16


def test_a_setting_without_measurements_is_not_judged():
    runs = [
        run("baseline", None, [(1, 50, 2, 100), (16, 200, 4, 1000)], 1),
        run("+prefix caching", "prefix caching", [(1, 30, 2, 110), (16, math.nan, math.nan, math.nan)], 1),
    ]
    [verdict] = feature_verdicts(runs)
    assert verdict["keep"] is None and "not judged" in verdict["reason"]
    assert recommend(runs, ttft_slo_ms=150)["features"] == ["prefix caching"]
