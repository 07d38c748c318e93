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
    assert "--served-model-name tiny-qwen3" in result.stdout
    assert "--max-num-seqs 32" in result.stdout
    # The note goes to stderr, so stdout stays a flag list a shell can pass to `vllm serve`.
    assert result.stderr.startswith("# planned for CPU") and "--max-num-seqs 32 (config: 32)" in result.stderr


def test_engine_args_flag_out_of_range_names_the_flag():
    result = runner.invoke(app, ["engine-args", "--env", "local", "--nodes", "0"])
    assert result.exit_code == 2
    assert "--nodes" in result.output


def test_plan_runs_qwen3_8b_at_bare_vllms_256_sequences_and_reports_the_guarantee():
    """Issue 12: on one H200 the GPU benchmark config used to be capped at 96 sequences (all at 8k)."""
    result = runner.invoke(app, ["plan", "configs/base.yaml", "loadtests/gpu/qwen3-8b.yaml", "--json"])
    assert result.exit_code == 0, result.output
    plan = json.loads(result.output)
    assert plan["max_num_seqs"] == 256 and plan["max_num_seqs_without_preemption"] == 96
    assert plan["expected_context_tokens"] == 1024 + 256
    assert any("counts on preemption" in w and "set max_num_seqs <= 96" in w for w in plan["warnings"])
    table = runner.invoke(app, ["plan", "configs/base.yaml", "loadtests/gpu/qwen3-8b.yaml"]).output
    assert "without preemption    96" in table


def test_plan_sizes_max_num_seqs_from_the_workload_section(tmp_path):
    path = tmp_path / "long.yaml"
    path.write_text(
        "model: {source: Qwen/Qwen3-8B, max_model_len: 32768}\n"
        "engine: {max_num_seqs: 512}\n"
        "resources: {accelerator: gpu, gpu_type: H200, gpu_memory_gib: 139.8}\n"
        "workload: {prompt_tokens: 4096, output_tokens: 1024}\n"
    )
    plan = json.loads(runner.invoke(app, ["plan", str(path), "--json"]).output)
    assert plan["fits"] and plan["max_num_seqs"] == 155 and plan["expected_context_tokens"] == 5120
    assert any("max_num_seqs lowered from 512 to 155" in w for w in plan["warnings"])


def test_bad_workload_value_names_the_field(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("model: {source: embedded:tiny-qwen3}\nworkload: {prefix_reuse_fraction: 1.5}\n")
    result = runner.invoke(app, ["plan", str(path)])
    assert result.exit_code == 2
    assert "workload.prefix_reuse_fraction" in result.output and "0.99" in result.output


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
    assert not plan["fits"] and plan["max_num_seqs_without_preemption"] == 0
    text = " ".join(plan["reasons"])
    assert "To serve at least one request with max_model_len (40,960), 10.00 GiB KV cache is needed" in text
    assert "max_num_seqs=512 sequences need 160.00 GiB of KV cache per GPU at the expected 1,280" in text
    assert "5,120.00 GiB at max_model_len 40,960" in text


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
