"""`headroom` answers bad configs and flags with a clear message and exit code 2 (and starts nothing)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from serve_app.cli.commands import app

runner = CliRunner()


@pytest.mark.parametrize(
    "yaml_text,words",
    [
        (
            "model: {source: embedded:tiny-qwen3}\nengine: {max_num_seq: 8}\n",
            ["engine.max_num_seq", "max_num_seqs"],
        ),
        (
            "model: {source: embedded:tiny-qwen3}\nengine: {gpu_memory_utilization: 1.5}\n",
            ["engine.gpu_memory_utilization", "0.05", "0.99"],
        ),
        ("model: {source: /nonexistent/model}\n", ["model.source", "config.json"]),
        (
            "model: {source: embedded:tiny-qwen3}\n"
            "engine: {speculative: {method: medusa, num_speculative_tokens: 2}}\n",
            ["engine.speculative.method", "ngram"],
        ),
    ],
)
def test_validate_rejects_bad_config(tmp_path, yaml_text, words):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml_text)
    result = runner.invoke(app, ["validate", "--config", str(path)])
    assert result.exit_code == 2
    for word in words:
        assert word in result.output


def test_unknown_env_lists_the_available_ones():
    result = runner.invoke(app, ["validate", "--env", "production"])
    assert result.exit_code == 2
    assert "prod" in result.output and "staging" in result.output


def test_env_and_config_together_are_refused(tmp_path):
    result = runner.invoke(app, ["validate", "--env", "local", "--config", str(tmp_path / "x.yaml")])
    assert result.exit_code == 2
    assert "--env/--config" in result.output


def test_engine_args_prints_vllm_flags():
    result = runner.invoke(app, ["engine-args", "--env", "local"])
    assert result.exit_code == 0, result.output
    assert "--served-model-name tiny-qwen3" in result.output
    assert "--max-num-seqs 32" in result.output


def test_plan_json_has_the_documented_keys():
    result = runner.invoke(app, ["plan", "configs/prod.yaml", "--json", "--gpus", "8", "--nodes", "2"])
    assert result.exit_code == 0, result.output
    plan = json.loads(result.output)
    for key in (
        "fits",
        "tensor_parallel_size",
        "replicas",
        "kv_cache_tokens_per_replica",
        "max_concurrency_per_replica",
        "bundles",
        "weights_gib_per_gpu",
        "kv_bytes_per_token",
        "reasons",
    ):
        assert key in plan
    assert plan["fits"] and plan["replicas"] >= 1 and plan["reasons"]


def test_plan_refuses_the_seeds_512_sequence_pitfall(tmp_path):
    # The seeds' pitfall: max_num_seqs 512, unquantized, long context, one GPU.
    path = tmp_path / "pitfall.yaml"
    path.write_text(
        "model: {source: Qwen/Qwen3-32B, max_model_len: 40960}\n"
        "engine: {max_num_seqs: 512}\n"
        "resources: {accelerator: gpu, gpu_type: H100-80GB}\n"
    )
    result = runner.invoke(app, ["plan", str(path), "--json"])
    assert result.exit_code == 1
    plan = json.loads(result.output)
    assert not plan["fits"]
    text = " ".join(plan["reasons"])
    assert "GiB" in text and "max_model_len" in text


def test_plan_flag_out_of_range_names_the_flag():
    result = runner.invoke(app, ["plan", "configs/prod.yaml", "--gpus", "0"])
    assert result.exit_code == 2
    assert "--gpus" in result.output


@pytest.mark.parametrize(
    ("flags", "hint"),
    [
        (["--app-name", "Bad_Name"], "--app-name"),
        (["--steps", "4:x"], "--steps"),
        (["--profile", "poetry"], "--profile"),
    ],
)
def test_ladder_refuses_bad_flags_before_deploying(flags, hint):
    result = runner.invoke(app, ["ladder", "--env", "local", *flags])
    assert result.exit_code == 2
    assert hint in result.output
