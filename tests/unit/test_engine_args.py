"""Config -> vLLM flags and Ray Serve options: what the engine and Serve are told."""

from __future__ import annotations

import importlib
import json
import shlex
from dataclasses import asdict

import pytest
from typer.testing import CliRunner

from serve_app.cli.commands import app
from serve_app.config import ConfigError, deep_merge, load_config_files, load_env_config, parse_config
from serve_app.models.resolve import resolve_models
from serve_app.planning import catalogue
from serve_app.planning.from_config import cluster_spec, plan_config, require_fit
from serve_app.serving.engine_args import PlannedEngine, ResolvedModels, plan_engine, vllm_cli_args
from serve_app.serving.serve_options import deployment_options

MODELS = ResolvedModels("/models/target", "/models/draft")
ONE_RANK = PlannedEngine(tensor_parallel_size=1, max_num_seqs=32)


def config(**overlay):
    base = load_env_config("local").model_dump(mode="json")
    return parse_config(deep_merge(base, overlay))


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def test_local_config_flags():
    args = vllm_cli_args(config(), MODELS, ONE_RANK)
    assert flag(args, "--model") == "/models/target"
    assert flag(args, "--served-model-name") == "tiny-qwen3"
    assert flag(args, "--max-num-seqs") == "32"
    assert flag(args, "--max-model-len") == "2048"
    assert flag(args, "--kv-cache-memory-bytes") == str(512 * 1024**2)
    assert "--enable-prefix-caching" in args and "--enforce-eager" in args
    # gpu_memory_utilization reserves a share of RAM on the CPU backend: never passed there.
    assert "--gpu-memory-utilization" not in args and "--speculative-config" not in args
    # The CPU worker imports this class's module first, which requests the AMX registers (cpu_worker.py).
    extension = flag(args, "--worker-extension-cls")
    module, _, name = extension.rpartition(".")
    assert hasattr(importlib.import_module(module), name)


def test_features_switch_off():
    args = vllm_cli_args(
        config(engine={"enable_prefix_caching": False, "enable_chunked_prefill": False}), MODELS, ONE_RANK
    )
    assert "--no-enable-prefix-caching" in args and "--no-enable-chunked-prefill" in args


@pytest.mark.parametrize(
    "spec,expected",
    [
        (
            {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5},
            {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5},
        ),
        (
            {
                "method": "draft_model",
                "num_speculative_tokens": 5,
                "draft_model": "embedded:tiny-qwen3-draft",
            },
            {"method": "draft_model", "num_speculative_tokens": 5, "model": "/models/draft"},
        ),
        (
            {"method": "eagle3", "num_speculative_tokens": 3, "draft_model": "/x", "parallel_drafting": True},
            {
                "method": "eagle3",
                "num_speculative_tokens": 3,
                "model": "/models/draft",
                "parallel_drafting": True,
            },
        ),
    ],
)
def test_speculative_config_reaches_flags(spec, expected):
    cfg = config(engine={"speculative": spec})
    models = MODELS if "draft_model" in spec else ResolvedModels("/models/target")
    args = vllm_cli_args(cfg, models, ONE_RANK)
    assert json.loads(flag(args, "--speculative-config")) == expected


def test_gpu_flags_and_tensor_parallel():
    cfg = config(
        resources={"accelerator": "gpu", "gpu_type": "H200"}, engine={"gpu_memory_utilization": 0.85}
    )
    args = vllm_cli_args(cfg, MODELS, PlannedEngine(tensor_parallel_size=2, max_num_seqs=64))
    assert flag(args, "--gpu-memory-utilization") == "0.85"
    assert flag(args, "--tensor-parallel-size") == "2"
    assert flag(args, "--max-num-seqs") == "64"  # the plan's safe value, not the config's
    # TP ranks must be Ray actors in the replica's placement group.
    assert flag(args, "--distributed-executor-backend") == "ray"
    assert "--kv-cache-memory-bytes" not in args and "--worker-extension-cls" not in args
    # The fusion pass that crashed TP=2 on the lab's H200 pair is off unless the config turns it on.
    assert json.loads(flag(args, "--compilation-config")) == {"pass_config": {"fuse_allreduce_rms": False}}
    fused = config(
        resources={"accelerator": "gpu", "gpu_type": "H200"}, engine={"allreduce_rms_fusion": True}
    )
    assert "--compilation-config" not in vllm_cli_args(fused, MODELS, PlannedEngine(2, 64))
    single = vllm_cli_args(cfg, MODELS, PlannedEngine(tensor_parallel_size=1, max_num_seqs=256))
    assert "--distributed-executor-backend" not in single and flag(single, "--tensor-parallel-size") == "1"
    assert "--compilation-config" not in single


def gpu_config(model: str, **deployment):
    return config(
        model={"source": model, "served_name": "m", "max_model_len": 8192, "dtype": "auto"},
        engine={"enforce_eager": False, "cpu_kv_cache_space_gib": None, "max_num_batched_tokens": None},
        resources={"accelerator": "gpu", "gpu_type": "H200", "gpu_memory_gib": 139.8},
        deployment=deployment,
    )


def test_tensor_parallel_plan_becomes_a_strict_pack_placement_group():
    cfg = gpu_config("Qwen/Qwen3-32B", num_replicas=2)
    cfg = parse_config(deep_merge(cfg.model_dump(mode="json"), {"engine": {"tensor_parallel_size": 2}}))
    result = plan_config(cfg, cluster_spec(cfg, nodes=2, gpus_per_node=4))
    assert result.fits and result.tensor_parallel_size == 2
    opts = deployment_options(cfg, result)
    assert opts["placement_group_strategy"] == "STRICT_PACK"
    assert [b["GPU"] for b in opts["placement_group_bundles"]] == [1, 1]
    assert opts["ray_actor_options"] == {"num_cpus": 1}
    assert opts["num_replicas"] == 2


def test_single_gpu_plan_is_a_plain_gpu_actor():
    cfg = gpu_config("Qwen/Qwen3-8B", num_replicas=1)
    result = plan_config(cfg, cluster_spec(cfg, gpus_per_node=1))
    opts = deployment_options(cfg, result)
    assert opts["ray_actor_options"] == {"num_cpus": 1, "num_gpus": 1}
    assert "placement_group_bundles" not in opts


def test_more_replicas_than_the_cluster_holds_is_refused():
    cfg = gpu_config("Qwen/Qwen3-8B", num_replicas=3)
    result = plan_config(cfg, cluster_spec(cfg, gpus_per_node=2))
    assert not result.fits
    assert "deployment.num_replicas (3)" in result.reasons[-1]
    with pytest.raises(ConfigError, match="Lower num_replicas to 2"):
        require_fit(result)


def test_replicas_and_autoscaling_options():
    local = config()
    assert deployment_options(local, plan_config(local, cluster_spec(local)))["num_replicas"] == 1
    auto = config(deployment={"num_replicas": None, "autoscaling": {"min_replicas": 1, "max_replicas": 3}})
    opts = deployment_options(auto, plan_config(auto, cluster_spec(auto)))
    assert "num_replicas" not in opts
    assert opts["autoscaling_config"]["max_replicas"] == 3
    assert opts["ray_actor_options"] == {"num_cpus": 1}


def test_serve_admission_is_a_backstop_behind_headroom_s_overload_bound():
    """Serve's queue is as deep as its ongoing limit, not one bound: in direct ingress Serve counts each
    arriving request as queued until it takes a slot, so a burst of clients returning after one Retry-After
    would otherwise get Serve's plain-text 503s instead of headroom's JSON ones."""
    cfg = config(engine={"max_num_seqs": 4}, deployment={"max_ongoing_requests": 4})
    cfg = parse_config(
        deep_merge(cfg.model_dump(mode="json"), {"security": {"overload": {"queue_fraction": 0}}})
    )
    opts = deployment_options(cfg, plan_config(cfg, cluster_spec(cfg)))
    bound = 4  # max_num_seqs, no queue
    assert opts["max_ongoing_requests"] == 2 * bound
    assert opts["max_queued_requests"] == 2 * bound
    overload = cfg.security.overload
    assert opts["backpressure_config"] == {
        "status_code": overload.status,
        "retry_after_s": overload.retry_after_s,
    }
    no_refusal = parse_config(deep_merge(cfg.model_dump(mode="json"), {"security": {"overload": None}}))
    assert "max_queued_requests" not in deployment_options(
        no_refusal, plan_config(no_refusal, cluster_spec(no_refusal))
    )


def llama70_config(tmp_path, gpu_type: str):
    """A GPU config file serving a local Llama-3.1-70B-shaped directory (config.json only: nothing is
    generated) at 8k."""
    model_dir = tmp_path / "llama-70b"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(catalogue.get("meta-llama/Llama-3.1-70B-Instruct")))
    path = tmp_path / "gpu.yaml"
    path.write_text(
        f"model: {{source: {model_dir}, max_model_len: 8192}}\n"
        f"resources: {{accelerator: gpu, gpu_type: {gpu_type}}}\n"
    )
    return path


def test_engine_args_prints_the_flags_the_deployment_gives_each_replica(tmp_path):
    """`headroom engine-args` = what build_from_config binds (config and planned engine as plain data) and
    the replica turns into flags, for a GPU config whose plan sets TP and lowers max_num_seqs."""
    config_path = llama70_config(tmp_path, "A100-80GB")
    result = CliRunner().invoke(app, ["engine-args", "--config", str(config_path), "--gpus", "2"])
    assert result.exit_code == 0, result.output
    printed = shlex.split(result.stdout)

    # build_from_config's step, then the replica's own: parse_config + resolve_models + PlannedEngine(**...).
    cfg = load_config_files(config_path)
    plan, planned = plan_engine(cfg, resolve_models(cfg), cluster_spec(cfg, gpus_per_node=2))
    bound_config, bound_planned = cfg.model_dump(mode="json"), asdict(planned)
    replica_cfg = parse_config(bound_config)
    replica_args = vllm_cli_args(replica_cfg, resolve_models(replica_cfg), PlannedEngine(**bound_planned))
    assert printed == replica_args
    # The plan, not the config, set these (the config has no tensor_parallel_size and 256 sequences).
    assert flag(printed, "--tensor-parallel-size") == "2" and cfg.engine.tensor_parallel_size is None
    assert flag(printed, "--max-num-seqs") == str(plan.max_num_seqs) == "19"
    assert "planned for 1 node(s) x 2 A100-80GB" in result.stderr
    assert "--tensor-parallel-size 2, --max-num-seqs 19 (config: 256)" in result.stderr


def test_engine_args_refuses_a_plan_that_does_not_fit(tmp_path):
    result = CliRunner().invoke(app, ["engine-args", "--config", str(llama70_config(tmp_path, "H100-80GB"))])
    assert result.exit_code == 1 and result.stdout == ""
    assert "won't fit" in result.stderr and "Weights need 131.45 GiB per GPU" in result.stderr


def test_access_log_is_serves_unless_turned_off():
    on = config()
    assert "logging_config" not in deployment_options(on, plan_config(on, cluster_spec(on)))
    off = config(deployment={"access_log": False})
    opts = deployment_options(off, plan_config(off, cluster_spec(off)))
    assert opts["logging_config"] == {"enable_access_log": False}
