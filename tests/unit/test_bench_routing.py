"""The routing benchmark's arithmetic (loadtests/bench_routing.py): configs per mode, hit rates, ratios."""

from __future__ import annotations

import math

import pytest

from loadtests.bench_routing import comparisons, deltas, markdown, parse_args, routed
from serve_app.config import load_env_config


def test_each_mode_gets_its_replicas_and_name() -> None:
    cfg = routed(load_env_config("local"), "prefix_affinity", 2, "effect-prefix-affinity")
    assert (cfg.name, cfg.deployment.routing, cfg.deployment.num_replicas) == (
        "effect-prefix-affinity",
        "prefix_affinity",
        2,
    )


def test_hit_rates_are_per_replica_deltas() -> None:
    before = {"cache": {"aaaaaaaa-1": {"hits": 100.0, "queries": 200.0}}, "decisions": {"preferred": 3.0}}
    after = {
        "cache": {
            "aaaaaaaa-1": {"hits": 400.0, "queries": 600.0},  # +300 of +400
            "bbbbbbbb-2": {"hits": 0.0, "queries": 100.0},  # new replica, +0 of +100
            "cccccccc-3": {"hits": 0.0, "queries": 0.0},
        },
        "decisions": {"preferred": 10.0, "spilled": 2.0},
    }
    d = deltas(before, after)
    assert d["replicas"]["aaaaaaaa"]["hit_rate"] == 0.75
    assert d["replicas"]["bbbbbbbb"]["hit_rate"] == 0.0
    assert math.isnan(d["replicas"]["cccccccc"]["hit_rate"])
    assert d["hit_rate"] == 300 / 500
    assert d["decisions"] == {"preferred": 7.0, "spilled": 2.0}


def row(mode: str, ttft_ms: float, tokens_per_s: float, profile: str = "multi-turn", repeat: int = 0) -> dict:
    return {
        "repeat": repeat,
        "mode": mode,
        "profile": profile,
        "concurrency": 4,
        "ttft_p50_ms": ttft_ms,
        "output_tokens_per_s": tokens_per_s,
    }


def test_comparisons_pool_repeats_and_skip_unpaired_profiles() -> None:
    effect = [
        row("least_loaded", 100, 50),
        row("prefix_affinity", 40, 60),
        row("prefix_affinity", 60, 60, repeat=1),
        row("least_loaded", 100, 40, repeat=1),
        row("least_loaded", 10, 10, profile="random"),  # its prefix_affinity run was cut short
    ]
    [c] = comparisons(effect)
    assert c["profile"] == "multi-turn"
    assert c["ttft_p50_ratio_ll_over_pa"] == pytest.approx(2.0)
    assert c["ttft_p50_delta_ms"] == pytest.approx(-50.0)
    assert c["throughput_ratio_pa_over_ll"] == pytest.approx(60 / 45)
    assert c["repeat_ttft_p50_delta_ms"] == pytest.approx([-60.0, -40.0])  # the spread, per repeat
    assert c["repeat_throughput_ratio"] == pytest.approx([1.2, 1.5])


def test_report_renders_partial_results() -> None:
    report = {
        "model": "m",
        "replicas": 2,
        "machine": "x",
        "versions": {"ray": "2.60.0"},
        "command": "python -m loadtests.bench_routing",
        "side_call": {
            "requests_per_mode": 4,
            "prompts_left_out": 1,
            "max_tokens": 8,
            "ttft_p50_ms": {"least_loaded": 40.0, "prefix_affinity": 43.0},
            "delta_ms": 3.0,
            "round_delta_ms": [2.0, 4.0],
        },
        "effect": [],
        "comparisons": [],
    }
    text = markdown(report)
    assert "**+3.0 ms**" in text and "per round: +2.0, +4.0 ms" in text and "## The effect" not in text


def test_profile_specs_are_checked() -> None:
    with pytest.raises(SystemExit):
        parse_args(["--profiles", "multi-turn:64"])
    assert parse_args(["--profiles", "random:1:10"]).profiles == ["random:1:10"]
