"""serve_app.config: the shipped YAML envs load, and every bad config is reported with its path and fix."""

from __future__ import annotations

import pickle
import textwrap
import typing
from pathlib import Path
from typing import Any

import annotated_types
import pytest
from pydantic import BaseModel, ValidationError

from autoscale.settings import AutoscalingSettings
from serve_app.config import (
    DEFAULT_CONFIG_DIR,
    ConfigError,
    DeploymentSection,
    EngineSection,
    HeadroomConfig,
    ModelSection,
    ResourcesSection,
    SLOSection,
    SpeculativeSection,
    WorkloadSection,
    available_envs,
    deep_merge,
    load_config,
    load_env_config,
    load_yaml,
    parse_config,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
ALL_SECTIONS = [
    HeadroomConfig,
    ModelSection,
    EngineSection,
    SpeculativeSection,
    DeploymentSection,
    AutoscalingSettings,
    SLOSection,
    ResourcesSection,
    WorkloadSection,
]
DRAFT_FAMILY = "'draft_model', 'eagle', 'eagle3', 'dflash', 'dspark'"


def build(overlay: dict[str, Any] | None = None) -> dict[str, Any]:
    """A minimal valid config with overlay merged on top."""
    return deep_merge({"model": {"source": "Qwen/Qwen3-8B"}}, overlay or {})


def problems_of(data: dict[str, Any]) -> dict[str, str]:
    with pytest.raises(ConfigError) as info:
        parse_config(data, source="test.yaml")
    return dict(info.value.problems)


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return path


# ---------------------------------------------------------------------------------------------------------
# The shipped environments
# ---------------------------------------------------------------------------------------------------------


def test_shipped_envs_are_discovered() -> None:
    assert {"local", "staging", "prod"} <= set(available_envs())
    assert "base" not in available_envs()


@pytest.mark.parametrize(
    ("env", "accelerator", "served", "num_replicas", "autoscaling_bounds"),
    [
        ("local", "cpu", "tiny-qwen3", 1, None),
        ("staging", "gpu", "qwen3-8b", 1, None),
        ("prod", "gpu", "qwen3-8b", None, (2, 8)),
    ],
)
def test_shipped_env_loads(
    env: str,
    accelerator: str,
    served: str,
    num_replicas: int | None,
    autoscaling_bounds: tuple[int, int] | None,
) -> None:
    config = load_env_config(env)
    assert config.resources.accelerator == accelerator
    assert config.served_model_name == served
    assert config.deployment.num_replicas == num_replicas
    if autoscaling_bounds is None:
        assert config.deployment.autoscaling is None
    else:
        assert config.deployment.autoscaling is not None
        scaling = config.deployment.autoscaling
        assert (scaling.min_replicas, scaling.max_replicas) == autoscaling_bounds


def test_local_env_is_the_embedded_cpu_default() -> None:
    config = load_env_config("local", DEFAULT_CONFIG_DIR)
    assert config.name == "headroom"
    assert config.model.source == "embedded:tiny-qwen3"
    assert config.model.dtype == "bfloat16"
    assert config.model.max_model_len == 2048
    assert config.engine.max_num_seqs == 32
    assert config.engine.enforce_eager is True
    assert config.engine.cpu_kv_cache_space_gib == 0.5
    assert config.engine.max_num_batched_tokens == 2048
    assert config.engine.speculative is None
    assert config.resources.gpu_type is None and config.resources.gpu_memory_gib is None
    assert (config.slo.ttft_p95_ms, config.slo.tpot_p50_ms) == (2000, 200)


def test_base_is_what_staging_and_prod_share() -> None:
    for env in ("staging", "prod"):
        config = load_env_config(env)
        assert config.model.source == "Qwen/Qwen3-8B"
        assert config.model.max_model_len == 8192
        assert config.engine.enable_prefix_caching and config.engine.enable_chunked_prefill
        assert config.resources.gpu_type == "H200"
        assert config.resources.gpu_memory_gib == 139.8
        assert config.slo.tpot_p50_ms == 50


# ---------------------------------------------------------------------------------------------------------
# Bad configs: each names the field path and what is accepted
# ---------------------------------------------------------------------------------------------------------

SPEC = {"method": "ngram", "num_speculative_tokens": 3}

BAD_CONFIGS: list[tuple[str, dict[str, Any], str, list[str]]] = [
    # (id, overlay on a minimal valid config, path, substrings the message must contain)
    (
        "unknown top-level key",
        {"modle": {}},
        "modle",
        [
            "unknown key 'modle'",
            "did you mean 'model'?",
            "allowed keys here: deployment, engine, model, name, resources, route_prefix, security, slo, "
            "workload",
        ],
    ),
    (
        "unknown nested key, did you mean",
        {"engine": {"max_num_seq": 64}},
        "engine.max_num_seq",
        [
            "unknown key 'max_num_seq'",
            "did you mean 'max_num_seqs'?",
            "enable_chunked_prefill, enable_prefix_caching",
        ],
    ),
    (
        "key in the wrong section",
        {"engine": {"max_model_len": 4096}},
        "engine.max_model_len",
        ["unknown key 'max_model_len'", "model.max_model_len"],
    ),
    (
        "unknown key in speculative",
        {"engine": {"speculative": {**SPEC, "num_spec_tokens": 3}}},
        "engine.speculative.num_spec_tokens",
        ["did you mean 'num_speculative_tokens'?", "prompt_lookup_max"],
    ),
    (
        "string for an integer",
        {"engine": {"max_num_seqs": "256"}},
        "engine.max_num_seqs",
        ["expected an integer between 1 and 8192", "got '256' (string)"],
    ),
    (
        "float for an integer",
        {"deployment": {"max_ongoing_requests": 2.5}},
        "deployment.max_ongoing_requests",
        ["expected an integer", "got 2.5 (number)"],
    ),
    (
        "string for a boolean",
        {"engine": {"enforce_eager": "yes"}},
        "engine.enforce_eager",
        ["expected true or false", "got 'yes' (string)"],
    ),
    (
        "boolean for a number",
        {"resources": {"gpu_memory_gib": True}},
        "resources.gpu_memory_gib",
        ["expected a number > 0 and <= 1024 or null", "got true (boolean)"],
    ),
    (
        "scalar for a section",
        {"engine": {"speculative": 5}},
        "engine.speculative",
        ["expected a mapping of engine.speculative settings", "method", "or null", "got 5 (integer)"],
    ),
    (
        "float above range",
        {"engine": {"gpu_memory_utilization": 1.5}},
        "engine.gpu_memory_utilization",
        ["must be between 0.05 and 0.99", "got 1.5"],
    ),
    (
        "float below range states both bounds",
        {"engine": {"gpu_memory_utilization": 0.01}},
        "engine.gpu_memory_utilization",
        ["must be between 0.05 and 0.99", "got 0.01"],
    ),
    (
        "exclusive lower bound",
        {"slo": {"ttft_p95_ms": 0}},
        "slo.ttft_p95_ms",
        ["must be > 0 and <= 600000", "got 0"],
    ),
    (
        "integer out of range",
        {"engine": {"speculative": {**SPEC, "num_speculative_tokens": 0}}},
        "engine.speculative.num_speculative_tokens",
        ["must be between 1 and 16", "got 0"],
    ),
    (
        "bad dtype literal",
        {"model": {"dtype": "bf16"}},
        "model.dtype",
        ["must be one of 'auto', 'bfloat16', 'float16', 'float32'", "got 'bf16'", "did you mean 'bfloat16'?"],
    ),
    (
        "bad quantization literal",
        {"model": {"quantization": "int4"}},
        "model.quantization",
        ["'fp8', 'awq', 'gptq', 'awq_marlin', 'gptq_marlin', 'compressed-tensors', 'bitsandbytes' or null"],
    ),
    (
        "bad speculative method",
        {"engine": {"speculative": {**SPEC, "method": "medusa"}}},
        "engine.speculative.method",
        [
            "must be one of 'ngram', 'draft_model', 'eagle', 'eagle3', 'mtp', 'dflash', 'dspark'",
            "got 'medusa'",
        ],
    ),
    (
        "tensor parallel size not a power of two",
        {"engine": {"tensor_parallel_size": 3}},
        "engine.tensor_parallel_size",
        ["must be one of 1, 2, 4, 8 or null", "got 3"],
    ),
    (
        "tensor parallel size true",
        {"engine": {"tensor_parallel_size": True}},
        "engine.tensor_parallel_size",
        ["expected one of 1, 2, 4, 8 or null", "got true (boolean)"],
    ),
    (
        "missing speculative method",
        {"engine": {"speculative": {"num_speculative_tokens": 2}}},
        "engine.speculative.method",
        ["required key is missing", "'ngram', 'draft_model'"],
    ),
    (
        "draft_model missing for draft_model",
        {"engine": {"speculative": {**SPEC, "method": "draft_model"}}},
        "engine.speculative.draft_model",
        ["draft_model is required when method is 'draft_model'", DRAFT_FAMILY],
    ),
    (
        "draft_model missing for eagle3",
        {"engine": {"speculative": {**SPEC, "method": "eagle3"}}},
        "engine.speculative.draft_model",
        ["required when method is 'eagle3'"],
    ),
    (
        "draft_model given for ngram",
        {"engine": {"speculative": {**SPEC, "draft_model": "Qwen/Qwen3-0.6B"}}},
        "engine.speculative.draft_model",
        ["draft_model ('Qwen/Qwen3-0.6B') is not allowed when method is 'ngram'", DRAFT_FAMILY],
    ),
    (
        "prompt_lookup_max < prompt_lookup_min",
        {"engine": {"speculative": {**SPEC, "prompt_lookup_min": 4, "prompt_lookup_max": 2}}},
        "engine.speculative.prompt_lookup_max",
        ["prompt_lookup_max (2) must be >= prompt_lookup_min (4)"],
    ),
    (
        "prompt lookup with a non-ngram method",
        {"engine": {"speculative": {**SPEC, "method": "mtp", "prompt_lookup_max": 3}}},
        "engine.speculative.prompt_lookup_max",
        ["only used by method 'ngram'", "not by method 'mtp'"],
    ),
    (
        "parallel_drafting with ngram",
        {"engine": {"speculative": {**SPEC, "parallel_drafting": True}}},
        "engine.speculative.parallel_drafting",
        ["parallel-draft family", DRAFT_FAMILY, "not by method 'ngram'"],
    ),
    (
        "parallel_drafting with mtp",
        {"engine": {"speculative": {**SPEC, "method": "mtp", "parallel_drafting": True}}},
        "engine.speculative.parallel_drafting",
        ["parallel-draft family", "not by method 'mtp'"],
    ),
    (
        "num_replicas and autoscaling together",
        {"deployment": {"num_replicas": 2, "autoscaling": {"min_replicas": 1, "max_replicas": 4}}},
        "deployment.num_replicas",
        ["num_replicas (2) and autoscaling are mutually exclusive"],
    ),
    (
        "max_replicas < min_replicas",
        {"deployment": {"autoscaling": {"min_replicas": 3, "max_replicas": 2}}},
        "deployment.autoscaling.max_replicas",
        ["max_replicas (2) must be >= min_replicas (3)"],
    ),
    (
        "initial_replicas outside bounds",
        {"deployment": {"autoscaling": {"min_replicas": 1, "max_replicas": 4, "initial_replicas": 6}}},
        "deployment.autoscaling.initial_replicas",
        ["initial_replicas (6) must be between min_replicas (1) and max_replicas (4)"],
    ),
    (
        "cpu accelerator with tensor parallelism",
        {"resources": {"accelerator": "cpu"}, "engine": {"tensor_parallel_size": 2}},
        "engine.tensor_parallel_size",
        ["tensor_parallel_size (2)", "accelerator 'cpu'", "only 1 or null"],
    ),
    (
        "chunked prefill off with a budget below max_model_len",
        {
            "model": {"max_model_len": 8192},
            "engine": {"enable_chunked_prefill": False, "max_num_batched_tokens": 4096},
        },
        "engine.max_num_batched_tokens",
        [
            "max_num_batched_tokens (4096) must be >= model.max_model_len (8192)",
            "enable_chunked_prefill: true",
            "at least 8192",
        ],
    ),
    (
        "budget below max_num_seqs",
        {"engine": {"max_num_seqs": 256, "max_num_batched_tokens": 128}},
        "engine.max_num_batched_tokens",
        ["max_num_batched_tokens (128) must be >= max_num_seqs (256)"],
    ),
    (
        "empty model source",
        {"model": {"source": ""}},
        "model.source",
        ["must be a non-empty string", "got ''"],
    ),
    (
        "bad application name",
        {"name": "Prod_App"},
        "name",
        ["got 'Prod_App'", "lowercase letters, digits and '-'", "^[a-z0-9][a-z0-9-]{0,62}$"],
    ),
    (
        "bad served name",
        {"model": {"served_name": "my model"}},
        "model.served_name",
        ["got 'my model'", "letters, digits and . _ / : -"],
    ),
    (
        "route prefix without a slash",
        {"route_prefix": "v1"},
        "route_prefix",
        ["must start with '/'", "got 'v1'"],
    ),
]


@pytest.mark.parametrize(
    ("overlay", "path", "needles"), [c[1:] for c in BAD_CONFIGS], ids=[c[0] for c in BAD_CONFIGS]
)
def test_bad_config_names_path_and_accepted_values(
    overlay: dict[str, Any], path: str, needles: list[str]
) -> None:
    problems = problems_of(build(overlay))
    assert path in problems, f"no problem at {path}: {problems}"
    for needle in needles:
        assert needle in problems[path], f"{needle!r} not in {problems[path]!r}"


def test_missing_model_section_is_reported() -> None:
    problems = problems_of({"engine": {"max_num_seqs": 8}})
    assert "required key is missing" in problems["model"]
    assert "source" in problems["model"]


def test_all_field_problems_are_reported_at_once() -> None:
    problems = problems_of(
        build(
            {
                "engine": {"max_num_seq": 1, "gpu_memory_utilization": 2.0},
                "slo": {"tpot_p50_ms": -1},
                "model": {"dtype": "fp16"},
            }
        )
    )
    assert set(problems) == {
        "engine.max_num_seq",
        "engine.gpu_memory_utilization",
        "slo.tpot_p50_ms",
        "model.dtype",
    }


def test_error_text_is_one_line_per_problem_with_source_and_path() -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(build({"engine": {"seed": -1}, "slo": {"max_error_rate": 2}}), source="my.yaml")
    lines = str(info.value).splitlines()
    assert lines == [
        "my.yaml: engine.seed: must be between 0 and 4294967295, got -1",
        "my.yaml: slo.max_error_rate: must be between 0 and 1, got 2",
    ]
    assert isinstance(info.value, ValueError)


def test_problem_is_attributed_to_the_file_that_set_it(tmp_path: Path) -> None:
    base = write(
        tmp_path,
        "base.yaml",
        """\
        model:
          source: Qwen/Qwen3-8B
        engine:
          max_num_seqs: 64
        """,
    )
    overlay = write(
        tmp_path,
        "prod.yaml",
        """\
        engine:
          max_num_seq: 128
        """,
    )
    with pytest.raises(ConfigError) as info:
        load_config(base, overlay)
    assert str(info.value).startswith(f"{overlay}: engine.max_num_seq: unknown key 'max_num_seq'")
    assert info.value.source == f"{base} + {overlay}"


def test_unknown_env_lists_the_available_envs(tmp_path: Path) -> None:
    write(tmp_path, "base.yaml", "model: {source: Qwen/Qwen3-8B}\n")
    write(tmp_path, "dev.yaml", "{}\n")
    write(tmp_path, "prod.yaml", "{}\n")
    with pytest.raises(ConfigError) as info:
        load_env_config("qa", tmp_path)
    ((path, message),) = info.value.problems
    assert path == "env"
    assert "unknown environment 'qa'" in message
    assert "available environments: dev, prod" in message
    assert load_env_config("dev", tmp_path).model.source == "Qwen/Qwen3-8B"


@pytest.mark.parametrize("env", ["base", "prdo", "../configs/prod", ""])
def test_unknown_env_in_repo_configs(env: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_env_config(env)
    message = dict(info.value.problems)["env"]
    assert "available environments: local, prod, staging" in message


def test_unknown_env_suggests_the_closest() -> None:
    with pytest.raises(ConfigError, match=r"did you mean 'prod'\?"):
        load_env_config("prdo")


# ---------------------------------------------------------------------------------------------------------
# YAML files
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "where", "needle"),
    [
        ("model:\n  source: x\n engine: 3\n", "line 3", "invalid YAML"),
        ("model: {source: x\n", "line 2", "invalid YAML"),
        ("model:\n  source: a\n  source: b\n", "line 3", "duplicate key 'source' (first set on line 2)"),
        ("a: [1, 2\n", "line 2", "invalid YAML"),
    ],
    ids=["bad indentation", "unclosed flow mapping", "duplicate key", "unclosed list"],
)
def test_yaml_syntax_error_names_file_and_line(tmp_path: Path, text: str, where: str, needle: str) -> None:
    path = write(tmp_path, "broken.yaml", text)
    with pytest.raises(ConfigError) as info:
        load_yaml(path)
    ((location, message),) = info.value.problems
    assert location.startswith(where)
    assert needle in message
    assert str(info.value).startswith(f"{path}: {where}")


@pytest.mark.parametrize(
    ("text", "type_name"), [("- a\n- b\n", "list"), ("just a string\n", "string"), ("42\n", "integer")]
)
def test_top_level_must_be_a_mapping(tmp_path: Path, text: str, type_name: str) -> None:
    path = write(tmp_path, "flat.yaml", text)
    with pytest.raises(ConfigError) as info:
        load_yaml(path)
    ((location, message),) = info.value.problems
    assert location == "(top level)"
    assert "expected a mapping of settings (keys: name, route_prefix, model, engine" in message
    assert f"got a {type_name}" in message
    assert str(info.value).startswith(str(path))


def test_parse_config_rejects_a_list() -> None:
    with pytest.raises(ConfigError, match=r"config: \(top level\): expected a mapping .* got a list"):
        parse_config([{"model": {"source": "x"}}])  # type: ignore[arg-type]


def test_empty_yaml_is_an_empty_mapping(tmp_path: Path) -> None:
    assert load_yaml(write(tmp_path, "empty.yaml", "# nothing here\n")) == {}


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="file not found"):
        load_config(tmp_path / "nope.yaml")


def test_yaml_merge_keys_still_work(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "anchors.yaml",
        """\
        defaults: &d
          x: 1
          y: 2
        other:
          <<: *d
          x: 3
        """,
    )
    assert load_yaml(path)["other"] == {"x": 3, "y": 2}


def test_overlay_null_clears_a_base_value(tmp_path: Path) -> None:
    base = write(
        tmp_path,
        "base.yaml",
        """\
        model: {source: Qwen/Qwen3-8B}
        engine:
          speculative: {method: ngram, num_speculative_tokens: 4}
        deployment:
          num_replicas: 2
        """,
    )
    overlay = write(
        tmp_path,
        "prod.yaml",
        """\
        engine:
          speculative: null
        deployment:
          num_replicas: null
          autoscaling: {min_replicas: 1, max_replicas: 3}
        """,
    )
    config = load_config(base, overlay)
    assert config.engine.speculative is None
    assert config.deployment.num_replicas is None
    assert config.deployment.autoscaling == AutoscalingSettings(min_replicas=1, max_replicas=3)


# ---------------------------------------------------------------------------------------------------------
# deep_merge
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("base", "overlay", "expected"),
    [
        ({"a": {"b": 1, "c": 2}}, {"a": {"c": 3, "d": 4}}, {"a": {"b": 1, "c": 3, "d": 4}}),
        ({"a": {"b": {"c": 1, "d": 2}}}, {"a": {"b": {"d": 5}}}, {"a": {"b": {"c": 1, "d": 5}}}),
        ({"a": [1, 2, 3]}, {"a": [4]}, {"a": [4]}),
        ({"a": {"b": 1}}, {"a": 7}, {"a": 7}),
        ({"a": 7}, {"a": {"b": 1}}, {"a": {"b": 1}}),
        ({"a": {"b": 1}}, {"a": None}, {"a": None}),
        ({"a": {"b": 1}}, {"a": {"b": None}}, {"a": {"b": None}}),
        ({"a": 1}, {}, {"a": 1}),
        ({}, {"a": {"b": [1]}}, {"a": {"b": [1]}}),
    ],
    ids=[
        "nested keys merge",
        "deep merge",
        "list replaced",
        "scalar replaces mapping",
        "mapping replaces scalar",
        "null clears a section",
        "null clears a leaf",
        "empty overlay",
        "empty base",
    ],
)
def test_deep_merge(base: dict[str, Any], overlay: dict[str, Any], expected: dict[str, Any]) -> None:
    assert deep_merge(base, overlay) == expected


def test_deep_merge_does_not_mutate_or_alias_inputs() -> None:
    base = {"a": {"b": [1, 2]}, "c": 1}
    overlay = {"a": {"d": {"e": 1}}}
    merged = deep_merge(base, overlay)
    merged["a"]["b"].append(3)
    merged["a"]["d"]["e"] = 2
    assert base == {"a": {"b": [1, 2]}, "c": 1}
    assert overlay == {"a": {"d": {"e": 1}}}


# ---------------------------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------------------------


def test_models_are_frozen() -> None:
    config = load_env_config("local")
    with pytest.raises(ValidationError):
        config.engine.max_num_seqs = 8  # type: ignore[misc,unused-ignore]
    with pytest.raises(ValidationError):
        config.model = ModelSection(source="x")  # type: ignore[misc,unused-ignore]
    assert hash(config.slo) == hash(SLOSection(ttft_p95_ms=2000, tpot_p50_ms=200))


def test_defaults() -> None:
    config = HeadroomConfig(model=ModelSection(source="Qwen/Qwen3-8B"))
    assert config.name == "headroom" and config.route_prefix == "/"
    assert config.deployment.num_replicas == 1  # neither num_replicas nor autoscaling: one replica
    assert not config.deployment.autoscaling_enabled
    assert config.engine == EngineSection()
    assert config.engine.max_num_seqs == 256 and config.engine.gpu_memory_utilization == 0.9
    assert config.engine.enable_prefix_caching and config.engine.enable_chunked_prefill
    assert config.resources.accelerator == "gpu"
    assert (config.slo.ttft_p95_ms, config.slo.tpot_p50_ms, config.slo.max_error_rate) == (1000, 100, 0.01)


@pytest.mark.parametrize(
    ("model", "expected"),
    [
        ({"source": "embedded:tiny-qwen3"}, "tiny-qwen3"),
        ({"source": "Qwen/Qwen3-8B"}, "Qwen3-8B"),
        ({"source": "/models/llama 3/"}, "llama-3"),
        ({"source": "Qwen/Qwen3-8B", "served_name": "chat"}, "chat"),
    ],
)
def test_served_model_name(model: dict[str, Any], expected: str) -> None:
    assert parse_config({"model": model}).served_model_name == expected


@pytest.mark.parametrize(
    "speculative",
    [
        {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4},
        {"method": "mtp", "num_speculative_tokens": 1},
        {"method": "mtp", "num_speculative_tokens": 2, "draft_model": "Qwen/Qwen3-8B-MTP"},
        {
            "method": "eagle3",
            "num_speculative_tokens": 3,
            "draft_model": "org/eagle3-head",
            "parallel_drafting": True,
        },
        {
            "method": "dflash",
            "num_speculative_tokens": 8,
            "draft_model": "org/dflash",
            "parallel_drafting": True,
        },
        {"method": "draft_model", "num_speculative_tokens": 3, "draft_model": "embedded:tiny-qwen3-draft"},
    ],
    ids=lambda s: s["method"],
)
def test_valid_speculative_settings(speculative: dict[str, Any]) -> None:
    config = parse_config(build({"engine": {"speculative": speculative}}))
    assert config.engine.speculative is not None
    assert config.engine.speculative.method == speculative["method"]


def test_valid_cross_field_edges() -> None:
    # chunked prefill off is fine when the budget holds a whole sequence, and cpu with tp 1 is fine.
    parse_config(
        build(
            {
                "model": {"max_model_len": 4096},
                "engine": {
                    "enable_chunked_prefill": False,
                    "max_num_batched_tokens": 4096,
                    "tensor_parallel_size": 1,
                },
                "resources": {"accelerator": "cpu"},
            }
        )
    )
    parse_config(
        build({"deployment": {"autoscaling": {"min_replicas": 0, "max_replicas": 4, "initial_replicas": 0}}})
    )


@pytest.mark.parametrize("section", ALL_SECTIONS, ids=lambda s: s.__name__)
def test_every_field_is_documented_and_bounded(section: type[BaseModel]) -> None:
    assert section.model_config.get("extra") == "forbid" and section.model_config.get("frozen") is True
    for name, info in section.model_fields.items():
        assert info.description and len(info.description) > 15, (
            f"{section.__name__}.{name} lacks a description"
        )
        members = [a for a in typing.get_args(info.annotation) if a is not type(None)] or [info.annotation]
        if any(m in (int, float) for m in members):
            kinds = {type(m) for m in info.metadata}
            has_lower = kinds & {annotated_types.Ge, annotated_types.Gt}
            has_upper = kinds & {annotated_types.Le, annotated_types.Lt}
            assert has_lower and has_upper, f"{section.__name__}.{name} needs both bounds"


def test_config_error_pickles() -> None:
    err = ConfigError([("engine.seed", "must be >= 0")], "a.yaml")
    again = pickle.loads(pickle.dumps(err))
    assert again.problems == err.problems and str(again) == str(err)
