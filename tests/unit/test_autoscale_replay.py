"""The GPU replay's pure parts (loadtests/gpu/autoscale_replay.py): its flags, its capacity search, its
config."""

from __future__ import annotations

import numpy as np
import pytest

from autoscale.sim import StaticPolicy, simulate
from loadtests.gpu.autoscale_replay import (
    deployment_for,
    fixed_trace,
    measured_timeline,
    one_replica_capacity,
    parse_cells,
    replay_config,
)
from serve_app.config import load_config_files


@pytest.fixture(scope="module")
def gpu_config():
    return replay_config(load_config_files("configs/base.yaml", "loadtests/gpu/qwen3-8b.yaml"), 2)


def test_calibration_cells_parse_and_bad_ones_name_the_flag():
    assert parse_cells("1:16, 64:320") == [(1, 16), (64, 320)]
    assert parse_cells("") == []
    for bad in ("64", "0:10", "8:0", "a:b", "8:-1"):
        with pytest.raises(SystemExit, match="--calibrate-at"):
            parse_cells(bad)


def test_the_replay_config_scales_from_one_replica_and_serves_tokenize(gpu_config):
    auto = gpu_config.deployment.autoscaling
    assert (auto.min_replicas, auto.max_replicas) == (1, 2)
    assert gpu_config.deployment.num_replicas is None
    # Locust's --tokens-per-word auto measures the prompts with /tokenize
    assert "tokenize" in gpu_config.security.optional_routes


def test_the_simulated_client_does_not_retry_as_locust_does_not(gpu_config):
    dep = deployment_for(gpu_config, 2)
    assert dep.admission.client_retries == 0
    assert dep.settings.max_replicas == 2


def test_capacity_search_finds_the_last_rate_that_holds(gpu_config):
    dep = deployment_for(gpu_config, 1)
    capacity = one_replica_capacity(dep, 1024, 128)

    def attainment(rate: float) -> float:
        trace = fixed_trace(list(np.arange(0.0, 120.0, 1.0 / rate)), 1024, 128, 120.0)
        return simulate(trace, StaticPolicy(1), dep.setup(0, 1)).attainment

    assert attainment(capacity) >= 0.99
    assert attainment(capacity + 0.5) < 0.99


def test_the_measured_timeline_bins_by_scheduled_arrival_and_counts_failures_as_missed():
    def record(at_s: float, ttft_s: float | None, status: int = 200) -> dict:
        return {"scheduled_s": 1000.0 + at_s, "ttft_s": ttft_s, "status": status, "error": None}

    records = [
        record(0.0, 0.1),
        record(9.9, 1.5),  # late: missed
        record(10.0, 0.2),
        record(25.0, None, 503),  # refused: missed, counted at the run's end
    ]
    t = measured_timeline(records, target_ms=1000.0, duration_s=30.0)
    assert t["missed"] == [1, 0, 1]
    assert t["ttft_p95_ms"][1] == pytest.approx(200.0)
    assert t["ttft_p95_ms"][2] >= 100_000
