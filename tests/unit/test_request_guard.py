"""The rules of the replica's ASGI layer (serving/request_guard.py) and the security config, tested
directly."""

from __future__ import annotations

import json

import pytest

from serve_app.config import ConfigError, deep_merge, load_env_config, parse_config
from serve_app.config.security import APIKeysSource, OverloadSettings, RequestLimits, SecuritySection
from serve_app.serving.request_guard import (
    AdmissionGate,
    RequestRefused,
    check_limits,
    field_caps,
    open_routes,
    openai_error_body,
    parse_api_keys,
    parse_json_body,
    read_api_keys,
    sequences_asked,
)

ENV_KEYS = APIKeysSource(env="HEADROOM_API_KEYS")


def local_with(security: dict) -> dict:
    return deep_merge(load_env_config("local").model_dump(mode="json"), {"security": security})


# --- config ---------------------------------------------------------------------------------------------

SECRET = "sk-live-0123456789abcdef"

# (case, security section, path of the problem, words the message must hold)
BAD_SECURITY = [
    ("key as api_keys", {"api_keys": SECRET}, "security.api_keys", ["never accepted", "{env: "]),
    ("key list as api_keys", {"api_keys": [SECRET]}, "security.api_keys", ["never accepted"]),
    ("key under api_key", {"api_key": SECRET}, "security.api_key", ["never accepted"]),
    ("key inside api_keys", {"api_keys": {"key": SECRET}}, "security.api_keys.key", ["never accepted"]),
    ("key as env name", {"api_keys": {"env": SECRET}}, "security.api_keys.env", ["NAME of an environment"]),
    ("relative key file", {"api_keys": {"file": SECRET}}, "security.api_keys.file", ["absolute path"]),
    ("neither env nor file", {"api_keys": {}}, "security.api_keys.env", ["exactly one", "neither"]),
    ("both env and file", {"api_keys": {"env": "K", "file": "/k"}}, "security.api_keys.env", ["both"]),
    ("unknown route group", {"optional_routes": ["admin"]}, "security.optional_routes.0", ["tokenize"]),
    ("overload status", {"overload": {"status": 500}}, "security.overload.status", ["429", "503"]),
    ("metrics access", {"metrics": "closed"}, "security.metrics", ["open", "api_key"]),
    ("body limit", {"limits": {"max_body_bytes": 10}}, "security.limits.max_body_bytes", ["1024"]),
]


@pytest.mark.parametrize("case,security,path,words", BAD_SECURITY, ids=[c[0] for c in BAD_SECURITY])
def test_bad_security_config_names_the_field_and_never_echoes_a_key(case, security, path, words):
    with pytest.raises(ConfigError) as err:
        parse_config(local_with(security))
    problems = dict(err.value.problems)
    assert path in problems, problems
    for word in words:
        assert word in problems[path], problems[path]
    assert SECRET not in str(err.value)


def test_security_defaults_and_a_key_source_from_yaml():
    cfg = parse_config(local_with({"api_keys": {"file": "/etc/keys"}, "optional_routes": ["docs"]}))
    assert cfg.security.api_keys == APIKeysSource(file="/etc/keys")
    assert cfg.security.optional_routes == ("docs",)
    assert load_env_config("local").security == SecuritySection()


@pytest.mark.parametrize(
    "fraction,max_num_seqs,bound", [(0.25, 32, 40), (0, 32, 32), (0.25, 4, 5), (1, 8, 16), (0.1, 1, 2)]
)
def test_admission_bound_is_safe_concurrency_plus_a_rounded_up_queue(fraction, max_num_seqs, bound):
    assert OverloadSettings(queue_fraction=fraction).admission_bound(max_num_seqs) == bound


# --- routes ---------------------------------------------------------------------------------------------


def test_without_keys_the_openai_routes_health_and_metrics_are_open_to_all():
    routes = open_routes(SecuritySection())
    assert set(routes) == {"/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics"}
    assert not any(r.needs_key for r in routes.values())
    assert routes["/v1/chat/completions"].methods == {"POST"}
    assert routes["/v1/models"].methods == {"GET", "HEAD"}


@pytest.mark.parametrize("metrics,metrics_needs_key", [("open", False), ("api_key", True)])
def test_with_keys_every_route_but_health_needs_one_and_metrics_follows_its_switch(
    metrics, metrics_needs_key
):
    routes = open_routes(
        SecuritySection(api_keys=ENV_KEYS, metrics=metrics, optional_routes=("tokenize", "docs"))
    )
    assert not routes["/health"].needs_key
    assert routes["/metrics"].needs_key is metrics_needs_key
    others = {p: r.needs_key for p, r in routes.items() if p not in ("/health", "/metrics")}
    assert set(others) >= {"/tokenize", "/detokenize", "/openapi.json", "/docs", "/redoc"}
    assert all(others.values())


# --- keys -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "source,text,keys",
    [
        (ENV_KEYS, "k1", ["k1"]),
        (ENV_KEYS, " k1 , k2,,", ["k1", "k2"]),
        (APIKeysSource(file="/k"), "# rotated 2026-11\nk1\n\n  k2  \n", ["k1", "k2"]),
    ],
)
def test_keys_are_read_from_an_env_value_or_a_key_file(source, text, keys):
    assert parse_api_keys(text, source) == keys


def test_a_missing_or_empty_key_source_stops_the_replica_with_a_message_naming_it(tmp_path):
    with pytest.raises(ValueError, match="HEADROOM_API_KEYS is not set"):
        read_api_keys(ENV_KEYS, {})
    with pytest.raises(ValueError, match="holds no keys"):
        read_api_keys(ENV_KEYS, {"HEADROOM_API_KEYS": " , "})
    missing = APIKeysSource(file=str(tmp_path / "none"))
    with pytest.raises(ValueError, match="cannot read the key file"):
        read_api_keys(missing, {})
    (tmp_path / "keys").write_text("# nothing yet\n")
    with pytest.raises(ValueError, match="holds no keys"):
        read_api_keys(APIKeysSource(file=str(tmp_path / "keys")), {})


# --- bodies and limits ----------------------------------------------------------------------------------

LIMITS = RequestLimits(max_n=4, max_tokens=64, max_logprobs=5)

# (case, body, the field named in the 400, or None when the body passes)
LIMIT_CASES = [
    ("within every limit", {"n": 4, "max_tokens": 64, "logprobs": 5, "top_logprobs": 5}, None),
    ("top_k beyond 64 bits", {"top_k": 1 << 70}, "top_k"),
    ("seed below 64 bits", {"seed": -(1 << 63) - 1}, "seed"),
    ("n over", {"n": 5}, "n"),
    ("best_of over", {"best_of": 9}, "best_of"),
    ("max_tokens over", {"max_tokens": 65}, "max_tokens"),
    ("max_completion_tokens over", {"max_completion_tokens": 1000}, "max_completion_tokens"),
    ("min_tokens over", {"min_tokens": 100}, "min_tokens"),
    ("completion logprobs over", {"logprobs": 6}, "logprobs"),
    ("chat top_logprobs over", {"logprobs": True, "top_logprobs": 6}, "top_logprobs"),
    ("prompt_logprobs over", {"prompt_logprobs": 6}, "prompt_logprobs"),
    ("wrong types are vLLM's to name", {"n": "many", "max_tokens": 1.5e9, "logprobs": True}, None),
]


@pytest.mark.parametrize("case,body,param", LIMIT_CASES, ids=[c[0] for c in LIMIT_CASES])
def test_limits_refuse_the_field_over_its_limit(case, body, param):
    if param is None:
        check_limits(body, field_caps(LIMITS))
        return
    with pytest.raises(RequestRefused) as refused:
        check_limits(body, field_caps(LIMITS))
    assert (refused.value.status, refused.value.param) == (400, param)
    setting = "64-bit integer" if "64 bits" in case else "security.limits."
    assert param in refused.value.message and setting in refused.value.message


def test_without_a_token_limit_any_max_tokens_passes_to_vllm():
    check_limits({"max_tokens": 10**6, "n": 16}, field_caps(RequestLimits()))


@pytest.mark.parametrize(
    "body,problem",
    [(b'{"a": \xff}', "not valid UTF-8"), (b'{"model": ', "not valid JSON"), (b"", "not valid JSON")],
)
def test_bodies_that_are_not_json_get_a_400(body, problem):
    with pytest.raises(RequestRefused) as refused:
        parse_json_body(body)
    assert refused.value.status == 400 and problem in refused.value.message


@pytest.mark.parametrize(
    "body,sequences",
    [
        ({}, 1),
        ({"n": 3}, 3),
        ({"n": 2, "best_of": 5}, 5),
        ({"prompt": "one"}, 1),
        ({"prompt": [1, 2, 3]}, 1),  # one prompt of token ids
        ({"prompt": ["a", "b", "c"], "n": 2}, 6),
        ({"prompt": [[1, 2], [3]]}, 2),
        ({"n": "x"}, 1),
    ],
)
def test_sequences_asked_counts_choices_times_prompts(body, sequences):
    assert sequences_asked(body) == sequences


def test_error_body_has_openais_shape():
    assert json.loads(openai_error_body(413, "too big")) == {
        "error": {"message": "too big", "type": "RequestTooLargeError", "param": None, "code": 413}
    }


# --- admission ------------------------------------------------------------------------------------------


def test_the_gate_admits_sequences_up_to_its_bound_and_frees_them():
    gate = AdmissionGate(5)
    assert gate.admit(4) and gate.admit(1)
    assert not gate.admit(1)
    gate.release(4)
    assert gate.admit(3) and not gate.admit(2)
    assert gate.admitted == 4


def test_a_request_larger_than_the_whole_bound_is_a_400_not_a_retry():
    with pytest.raises(RequestRefused) as refused:
        AdmissionGate(5).admit(6)
    assert (refused.value.status, refused.value.param) == (400, "n")
