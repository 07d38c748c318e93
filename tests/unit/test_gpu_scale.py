"""The pure parts of the GPU scaling run: the autoscaling variant, the rolling p95 and event times."""

from __future__ import annotations

import pytest

from loadtests.gpu.scale import autoscaling_variant, first_time, rolling_p95
from serve_app.config import load_config_files


def test_autoscaling_variant_replaces_the_fixed_replica_count():
    base = load_config_files("configs/base.yaml", "loadtests/gpu/qwen3-8b.yaml")
    assert base.deployment.num_replicas == 1 and base.model.dummy_weights
    cfg = autoscaling_variant(base, 250)
    auto = cfg.deployment.autoscaling
    assert cfg.deployment.num_replicas is None and cfg.slo.ttft_p95_ms == 250
    assert (auto.min_replicas, auto.max_replicas, auto.policy) == (1, 2, "ttft_headroom")
    assert auto.downscale_sustain_s >= 600  # no scale-down inside the run


def test_rolling_p95_follows_the_first_tokens_in_the_window():
    fast = [{"sent_s": t, "ttft_s": 0.1, "ok": True} for t in range(10)]
    slow = [{"sent_s": 10 + t, "ttft_s": 2.0, "ok": True} for t in range(10)]
    failed = [{"sent_s": 5, "ttft_s": 99.0, "ok": False}]
    series = dict(rolling_p95(fast + slow + failed, window_s=3))
    assert series[5.1] == pytest.approx(0.1)  # the failed request is not a first token
    assert series[20.1] == pytest.approx(2.0)
    breach = next(t for t, v in rolling_p95(fast + slow, 3) if v > 1.0)
    assert breach == pytest.approx(12.1)  # the first slow first token lands at 12.0


def test_first_time_after_a_moment():
    samples = [(1.0, {"RUNNING": 1}), (5.0, {"RUNNING": 1, "STARTING": 1}), (9.0, {"RUNNING": 2})]
    assert first_time(samples, lambda s: s.get("RUNNING", 0) >= 2, after=0) == 9.0
    assert first_time(samples, lambda s: "STARTING" in s, after=6) is None
