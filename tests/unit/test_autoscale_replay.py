"""The GPU replay's pure parts (loadtests/gpu/autoscale_replay.py): its flags, its capacity search, its
config."""

from __future__ import annotations

import gzip
import json
import shlex
from pathlib import Path

import numpy as np
import pytest

from autoscale.sim import StaticPolicy, simulate
from loadtests.gpu.autoscale_replay import (
    deployment_for,
    fixed_trace,
    main,
    measured_timeline,
    one_replica_capacity,
    parse_cells,
    parser,
    plan_and_predict,
    render,
    replay_config,
    report,
    window_rates,
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


def test_render_rebuilds_a_runs_report_from_its_json_and_raw_files(tmp_path):
    """A run as run_on_gpus leaves it (one replay, every request served at 100 ms), rendered again: the
    prediction recomputed for the saved arrivals, the measured timeline rebuilt from the raw file."""
    command = (
        "python -m loadtests.gpu.autoscale_replay --config configs/base.yaml loadtests/gpu/qwen3-8b.yaml "
        f"--out {tmp_path} --duration-s 30 --max-replicas 1 --peak-replicas 0.5 --calibrate-at ''"
    )
    args = parser().parse_args(shlex.split(command)[3:])
    cfg = replay_config(load_config_files(*args.config), 1)
    dep = deployment_for(cfg, 1)
    replay = plan_and_predict(dep, None, window_rates(30.0), 0.5, args)
    arrivals = replay.pop("_arrivals")
    replay["measured"] = {
        "requests": len(arrivals),
        "failed": 0,
        "attainment": 1.0,
        "startup_s": None,
        "replica_seconds": 30.0,
        "prompt_tokens_mean": 1024.0,
        "late_fraction": 0.0,
    }
    result = {
        "command": command,
        "ttft_target_ms": dep.ttft_target_ms,
        "max_replicas": 1,
        "replays": [replay],
    }
    (tmp_path / "autoscale_replay.json").write_text(json.dumps(result))
    with open(tmp_path / "raw_0.jsonl", "w") as f:
        for t in arrivals:
            f.write(
                json.dumps({"scheduled_s": 5000.0 + t, "ttft_s": 0.1, "status": 200, "error": None}) + "\n"
            )

    again = render(tmp_path)
    (rendered,) = again["replays"]
    assert (
        rendered["predicted_configured_startup"]["attainment"]
        == replay["predicted_configured_startup"]["attainment"]
    )
    assert rendered["measured"]["timeline"]["missed"] == [0, 0, 0]
    assert rendered["attainment_gap_pp"] == pytest.approx(
        100 * (rendered["predicted_configured_startup"]["attainment"] - 1.0)
    )
    assert "Per 10 s of arrivals" in report(again)


def test_render_refuses_a_calibrated_run_without_its_calibration_results(tmp_path):
    result = {"command": f"python -m loadtests.gpu.autoscale_replay --out {tmp_path}", "replays": [],
              "calibration": {"points": [{"concurrency": 1, "requests": 16}]}}  # fmt: skip
    (tmp_path / "autoscale_replay.json").write_text(json.dumps(result))
    with pytest.raises(SystemExit, match="calibration results are not there"):
        render(tmp_path)


def test_render_of_a_directory_without_a_run_names_the_flag(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("sys.argv", ["autoscale_replay", "--render", str(tmp_path)])
    with pytest.raises(SystemExit):
        main()
    assert "--render" in capsys.readouterr().err


def test_the_calibration_fits_step_costs_to_step_logs_that_carry_the_kv_cache_size(gpu_config, tmp_path):
    """Step logs saved with the KV cache's size (engine_steps since this evening) give the step costs; the
    three runs that saved bare step lists are rendered with the percentile fit they reported."""
    from autoscale.calibrate import Point
    from loadtests.gpu.autoscale_replay import fitted, saved_step_logs
    from tests.unit.test_step_log import KV_TOKENS, TRUE, engine_log

    log = {"kv_cache_tokens": KV_TOKENS, "block_size": 16, "steps": engine_log(300, seed=9)}
    (tmp_path / "calibration_steps_c1.json.gz").write_bytes(gzip.compress(json.dumps(log).encode()))
    logs = saved_step_logs(tmp_path, [(1, 16)])
    assert logs == [log]
    dep = deployment_for(gpu_config, 1)
    lone = Point("c1", "synthetic", 1, 1024, 128, 8, ttft_p50_ms=60.0, fit=("ttft_p50_ms",))
    with_steps, result = fitted(dep, [lone], logs)
    assert {k: getattr(with_steps.cost, k) for k in TRUE} == pytest.approx(TRUE, rel=1e-6)
    assert result["step_log_kv_cache_tokens"] == with_steps.limits.kv_cache_tokens == KV_TOKENS
    assert with_steps.limits.max_num_seqs == dep.limits.max_num_seqs
    run = {"command": "", "ttft_target_ms": 1000, "max_replicas": 1, "replays": [], "calibration": result}
    shown = report(run)
    assert "fitted to the replica's step log" in shown
    # The costs to four significant digits: the fit's last digits differ between machines.
    assert "'step_ms': 6.6," in shown and "'attention_ms_per_kv_token': 5.6e-05," in shown
    # Several replicas' logs: the simulated replica holds no more KV than the smallest of them.
    smaller = {
        **log,
        "kv_cache_tokens": KV_TOKENS - 16,
        "steps": engine_log(300, seed=10, kv_tokens=KV_TOKENS - 16),
    }
    pooled, result = fitted(dep, [lone], [log, smaller])
    assert {k: getattr(pooled.cost, k) for k in TRUE} == pytest.approx(TRUE, rel=1e-6)
    assert result["step_log_kv_cache_tokens"] == pooled.limits.kv_cache_tokens == KV_TOKENS - 16

    earlier = Path(__file__).resolve().parents[2] / "results/gpu/2026-12-07/replay-steps-seed17"
    assert saved_step_logs(earlier, [(1, 16)]) is None
    assert saved_step_logs(tmp_path, [(1, 16), (16, 64)]) is None  # one missing


def test_render_refuses_an_early_runs_file_and_leaves_its_report(monkeypatch):
    """results/gpu/2026-12-01/replay predates the per-peak 'replays': an error naming it, not a KeyError."""
    from loadtests.gpu.autoscale_replay import main

    early = Path(__file__).resolve().parents[2] / "results/gpu/2026-12-01/replay"
    before = (early / "report.md").read_bytes()
    monkeypatch.setattr("sys.argv", ["autoscale_replay", "--render", str(early)])
    with pytest.raises(SystemExit, match="an early run's file"):
        main()
    assert (early / "report.md").read_bytes() == before
