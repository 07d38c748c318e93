"""Rollouts: rendering, diffing, the smoke gate, history, and bad inputs refused before any deploy.

No Ray cluster: the Serve schema is Ray's own (ray.serve.schema), and the cluster is a fake that records
what a rollout asks of it (tests/integration/test_rollout.py runs the real thing).
"""

from __future__ import annotations

import copy
import json
import socket
import threading
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import typer
import yaml
from ray.serve.schema import ServeDeploySchema
from typer.testing import CliRunner

from loadtests.raw_stats import summarize
from loadtests.smoke import smoke_command
from serve_app.cli.rollout_commands import register
from serve_app.config import DEFAULT_CONFIG_DIR, ConfigError, SLOSection, load_env_config
from serve_app.planning.from_config import cluster_spec, plan_config, planning_cluster
from serve_app.rollout import (
    RolloutError,
    SmokeOptions,
    append_history,
    assess_app,
    config_hash,
    dashboard,
    dashboard_url,
    deploy_body,
    diff,
    format_changes,
    gate,
    last_rollouts,
    load_target,
    read_history,
    render,
    render_target,
    rollout,
    state_dir,
)
from serve_app.rollout.changes import field_changes
from serve_app.rollout.dashboard import (
    ServeCluster,
    dashboard_auth_headers,
    default_address,
    is_local_address,
    open_dashboard_warning,
)
from serve_app.rollout.serve_state import check_conflicts, serve_base_url, update_kind
from serve_app.serving.serve_options import deployment_options

BASE = DEFAULT_CONFIG_DIR / "base.yaml"
LOCAL = DEFAULT_CONFIG_DIR / "local.yaml"


def closed_port_address() -> str:
    """A dashboard address nothing listens on: contacting it fails."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def overlay(tmp_path: Path, text: str, name: str = "overlay.yaml") -> list[Path]:
    path = tmp_path / name
    path.write_text(text)
    return [BASE, LOCAL, path]


# --------------------------------------------------------------------------------------------------------
# render
# --------------------------------------------------------------------------------------------------------


def test_render_local_is_a_valid_serve_config_carrying_the_plan():
    config = render("local")
    ServeDeploySchema.model_validate(config)
    cfg = load_env_config("local")
    plan = plan_config(cfg, cluster_spec(cfg))
    (app,) = config["applications"]
    assert app["name"] == cfg.name and app["route_prefix"] == cfg.route_prefix
    assert app["import_path"] == "serve_app.app:build_app"
    assert app["args"]["config"] == cfg.model_dump(mode="json")
    assert app["args"]["headroom"] == {
        "env": "local",
        "config_hash": config_hash(cfg),
        "tensor_parallel_size": plan.tensor_parallel_size,
        "max_num_seqs": plan.max_num_seqs,
    }
    (dep,) = app["deployments"]
    assert dep == {"name": "LLMServer", **deployment_options(cfg, plan), "max_surge_percent": 100}
    # Serve admits twice headroom's own bound (max_num_seqs 32 + a queue of 8), which refuses first.
    assert dep["num_replicas"] == 1 and dep["max_ongoing_requests"] == 80
    assert dep["health_check_period_s"] == 10 and dep["health_check_timeout_s"] == 30


def test_render_prod_autoscales_on_gpus_and_surges_when_the_cluster_has_room():
    config = render("prod", gpus=8, nodes=2)
    ServeDeploySchema.model_validate(config)
    dep = config["applications"][0]["deployments"][0]
    assert "num_replicas" not in dep
    auto = dep["autoscaling_config"]
    assert (auto["min_replicas"], auto["max_replicas"]) == (2, 8)
    assert auto["policy"]["policy_function"] == "autoscale.ray_policy:TTFTHeadroomPolicy"
    assert dep["ray_actor_options"] == {"num_cpus": 1.0, "num_gpus": 1}
    assert dep["max_surge_percent"] == 100  # 16 replicas fit, 8 at most run
    # On one node of 8 GPUs a peak of 8 replicas leaves no room: stop-then-start, and the header says so.
    tight = render_target(load_target("prod"), planning_cluster(load_env_config("prod"), gpus=8))
    assert tight.app["deployments"][0]["max_surge_percent"] == 0
    assert "no surge" in tight.header()


def test_render_tensor_parallel_config_gets_a_strict_pack_placement_group(tmp_path):
    path = tmp_path / "big.yaml"
    path.write_text("name: big\nmodel: {source: meta-llama/Llama-3.1-70B-Instruct, served_name: llama-70b}\n")
    target = load_target(config_files=[BASE, path])
    rendered = render_target(target, planning_cluster(target.cfg, gpus=8))
    ServeDeploySchema.model_validate(rendered.config)
    dep = rendered.app["deployments"][0]
    assert rendered.plan.tensor_parallel_size > 1
    assert dep["placement_group_strategy"] == "STRICT_PACK"
    assert sum(b.get("GPU", 0) for b in dep["placement_group_bundles"]) == rendered.plan.tensor_parallel_size
    assert rendered.app["args"]["headroom"]["tensor_parallel_size"] == rendered.plan.tensor_parallel_size


def test_rendered_yaml_round_trips_and_is_deterministic():
    target = load_target("staging")
    cluster = planning_cluster(target.cfg, gpus=2)
    first, second = render_target(target, cluster), render_target(target, cluster)
    assert first.config == second.config  # same config, same args: Serve sees no change
    text = first.to_yaml("2026-11-30T00:00:00+00:00")
    assert f"# config hash:  {first.config_hash}" in text
    assert "# planned on:   1 node(s) x 2 H200" in text
    assert yaml.safe_load(text) == first.config
    ServeDeploySchema.model_validate(yaml.safe_load(text))


def test_config_files_target_is_labelled_by_app_name(tmp_path):
    target = load_target(config_files=overlay(tmp_path, "name: canary\nroute_prefix: /canary\n"))
    assert target.label == "canary" and target.env is None
    assert render_target(target, planning_cluster(target.cfg)).app["route_prefix"] == "/canary"


@pytest.mark.parametrize(
    "cfg_text,percent",
    [
        ("deployment: {num_replicas: 1}\n", 100),  # CPU: one extra replica at a time
        ("deployment: {num_replicas: 4}\n", 25),
    ],
)
def test_cpu_surge_is_one_replica(tmp_path, cfg_text, percent):
    target = load_target(config_files=overlay(tmp_path, cfg_text))
    rendered = render_target(target, planning_cluster(target.cfg))
    assert rendered.app["deployments"][0]["max_surge_percent"] == percent


# --------------------------------------------------------------------------------------------------------
# diff
# --------------------------------------------------------------------------------------------------------


def test_diff_staging_prod_lists_replica_and_autoscaling_differences():
    changes = diff("staging", "prod", gpus=8, nodes=2)
    by_key = {(c.section, c.path): c for c in changes}
    assert by_key[("config", "deployment.num_replicas")].before == 1
    assert by_key[("config", "deployment.num_replicas")].after is None
    assert by_key[("config", "deployment.autoscaling.min_replicas")].after == 2
    assert by_key[("config", "deployment.autoscaling.max_replicas")].after == 8
    assert ("config", "deployment.autoscaling") not in by_key  # null -> mapping shows as its leaves
    assert by_key[("config", "name")].after == "headroom"
    assert by_key[("plan", "replicas")].before == "1"
    assert by_key[("plan", "replicas")].after.startswith("2-8 (autoscaled")
    assert (
        by_key[("serve", "LLMServer.num_replicas")].render() == "serve: LLMServer.num_replicas: 1 -> (unset)"
    )
    assert by_key[("serve", "LLMServer.autoscaling_config.max_replicas")].after == 8
    # Same model, same GPUs: the plan's TP size, KV tokens and max_num_seqs agree.
    for path in ("tensor_parallel_size", "kv_cache_tokens_per_replica", "max_num_seqs"):
        assert ("plan", path) not in by_key
    text = format_changes(changes, "staging", "prod")
    assert "[config]" in text and "[plan]" in text and "[serve]" in text


def test_diff_shows_the_plan_consequences_of_an_engine_change():
    changes = diff("local", "staging")
    paths = {(c.section, c.path) for c in changes}
    assert {("plan", "max_num_seqs"), ("plan", "kv_cache_tokens_per_replica"), ("plan", "cluster")} <= paths
    assert diff("prod", "prod", gpus=8) == []


def test_field_changes_leaf_by_leaf():
    changes = field_changes(
        "config", {"a": {"b": 1, "c": 2}, "d": None}, {"a": {"b": 1, "c": 3}, "d": {"e": 1}}
    )
    assert [c.render() for c in changes] == ["config: a.c: 2 -> 3", "config: d.e: (unset) -> 1"]


# --------------------------------------------------------------------------------------------------------
# smoke gate (raw records as loadtests/locustfile.py writes them, summarized by loadtests/raw_stats.py)
# --------------------------------------------------------------------------------------------------------


def raw(n_ok: int, ttft_s: float, tpot_s: float, n_err: int = 0) -> list[dict[str, Any]]:
    records = []
    for i in range(n_ok):
        e2e = ttft_s + 15 * tpot_s
        records.append(
            {
                "start_s": 1000.0 + i,
                "ttft_s": ttft_s,
                "tpot_s": tpot_s,
                "e2e_s": e2e,
                "output_tokens": 16,
                "status": 200,
                "error": None,
            }
        )
    for i in range(n_err):
        records.append(
            {
                "start_s": 2000.0 + i,
                "ttft_s": None,
                "tpot_s": None,
                "e2e_s": 0.1,
                "status": 503,
                "error": "HTTP 503",
            }
        )
    return records


SLO = SLOSection(ttft_p95_ms=200, tpot_p50_ms=50, max_error_rate=0.05)


@pytest.mark.parametrize(
    "records,passed,words",
    [
        (raw(40, 0.050, 0.010), True, []),
        (raw(40, 0.300, 0.010), False, ["TTFT p95 300.0 ms > slo.ttft_p95_ms 200 ms"]),
        (raw(40, 0.050, 0.080), False, ["TPOT p50 80.0 ms > slo.tpot_p50_ms 50 ms"]),
        (raw(38, 0.050, 0.010, n_err=2), True, []),  # 5.0%: at the limit passes
        (raw(37, 0.050, 0.010, n_err=3), False, ["error rate 7.5% (3 of 40) > slo.max_error_rate 5.0%"]),
        (raw(0, 0.050, 0.010, n_err=5), False, ["error rate 100.0%", "no request succeeded"]),
        ([], False, ["no request finished"]),
    ],
)
def test_gate_on_hand_made_raw_stats(records, passed, words):
    result = gate(summarize(records), SLO)
    assert result.passed is passed, result.reasons
    for word in words:
        assert any(word in reason for reason in result.reasons), result.reasons
    if records and any(r["status"] == 200 for r in records):
        assert result.numbers["ttft_p95_ms"] == pytest.approx(records[0]["ttft_s"] * 1000)


def test_gate_without_tpot_fails_rather_than_passing_unmeasured():
    records = raw(10, 0.05, 0.01)
    for r in records:
        r["tpot_s"] = None
    result = gate(summarize(records), SLO)
    assert not result.passed and "TPOT p50 not measured" in result.reasons[0]


# --------------------------------------------------------------------------------------------------------
# history
# --------------------------------------------------------------------------------------------------------


def test_history_write_read_and_last_per_env(tmp_path):
    append_history(tmp_path, "staging", {"outcome": "succeeded", "config_hash": "a"})
    append_history(tmp_path, "staging", {"outcome": "rolled_back", "config_hash": "b"})
    append_history(tmp_path, "prod", {"outcome": "succeeded", "config_hash": "c"})
    with open(tmp_path / "rollouts" / "staging" / "history.jsonl", "a") as f:
        f.write('{"outcome": "half a li')  # a crash mid-write is skipped
    assert [r["config_hash"] for r in read_history(tmp_path, "staging")] == ["a", "b"]
    assert read_history(tmp_path, "nothing") == []
    last = last_rollouts(tmp_path)
    assert {k: v["config_hash"] for k, v in last.items()} == {"prod": "c", "staging": "b"}
    assert last_rollouts(tmp_path / "missing") == {}


def test_state_dir_from_flag_env_or_default(tmp_path):
    assert state_dir(tmp_path) == tmp_path
    assert state_dir(None, {"HEADROOM_STATE_DIR": "/srv/headroom"}) == Path("/srv/headroom")
    assert state_dir(None, {}) == Path(".headroom")


# --------------------------------------------------------------------------------------------------------
# addresses and the live cluster as data
# --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "address,words",
    [
        ("", ["is empty"]),
        ("head:6379", ["has no scheme", "GCS port", "http://head:8265"]),
        ("ray://head:10001", ["Ray Client address"]),
        ("ftp://head:8265", ["scheme 'ftp'"]),
        ("http://:8265", ["no host"]),
        ("http://head:99999", ["port must be a number"]),
        ("http://head:abc", ["port must be a number"]),
        ("http://head:8265/api/serve", ["without a path"]),
    ],
)
def test_malformed_addresses_are_refused(address, words):
    with pytest.raises(RolloutError) as err:
        dashboard_url(address)
    for word in words:
        assert word in str(err.value)


def test_addresses_are_normalized():
    assert dashboard_url(" http://head:8265/ ") == "http://head:8265"
    assert dashboard_url("https://ray.example.com") == "https://ray.example.com"
    assert default_address({}) == ("http://127.0.0.1:8265", "the default")
    assert default_address({"RAY_ADDRESS": "http://h:8265"}) == ("http://h:8265", "$RAY_ADDRESS")


def test_an_address_with_credentials_is_refused_without_echoing_them():
    with pytest.raises(RolloutError) as err:
        dashboard_url("http://admin:s3cret@head:8265")
    assert "user name or password" in str(err.value) and "s3cret" not in str(err.value)
    assert "RAY_AUTH_MODE=token" in str(err.value)


# --------------------------------------------------------------------------------------------------------
# Ray's token authentication on the control path
# --------------------------------------------------------------------------------------------------------

RAY_AUTH_VARS = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")


@pytest.fixture
def ray_auth_env(monkeypatch, tmp_path) -> Iterator[Callable[..., None]]:
    """Sets Ray's auth variables (nothing else: HOME is an empty folder, so no ~/.ray/auth_token) and makes
    Ray re-read them, as a new process would; the environment and Ray's view of it are put back after."""
    from ray._private.authentication_test_utils import reset_auth_token_state

    def set_env(**variables: str) -> None:
        monkeypatch.setenv("HOME", str(tmp_path / "home"))
        for name in RAY_AUTH_VARS:
            monkeypatch.delenv(name, raising=False)
        for name, value in variables.items():
            monkeypatch.setenv(name, value)
        reset_auth_token_state()

    yield set_env
    monkeypatch.undo()
    reset_auth_token_state()


@pytest.mark.parametrize(
    "variables,header",
    [
        ({}, None),
        ({"RAY_AUTH_TOKEN": "tok-env"}, None),  # a token alone is not sent: Ray's clients need token mode
        ({"RAY_AUTH_MODE": "disabled", "RAY_AUTH_TOKEN": "tok-env"}, None),
        ({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "tok-env"}, "Bearer tok-env"),
        ({"RAY_AUTH_MODE": "TOKEN", "RAY_AUTH_TOKEN_PATH": "{file}"}, "Bearer tok-file"),
        (
            {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "tok-env", "RAY_AUTH_TOKEN_PATH": "{file}"},
            "Bearer tok-env",
        ),
    ],
)
def test_ray_token_header_is_built_by_ray_only_in_token_mode(ray_auth_env, tmp_path, variables, header):
    token_file = tmp_path / "token"
    token_file.write_text("tok-file")
    ray_auth_env(**{k: v.format(file=token_file) for k, v in variables.items()})
    assert dashboard_auth_headers() == ({"authorization": header} if header else {})


@pytest.mark.parametrize(
    "variables,words",
    [
        ({"RAY_AUTH_MODE": "token"}, ["no token could be loaded", "$RAY_AUTH_TOKEN", "~/.ray/auth_token"]),
        (
            {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": "{missing}"},
            ["RAY_AUTH_TOKEN_PATH is set but file cannot be opened or is empty: {missing}"],
        ),
    ],
)
def test_token_mode_without_a_token_is_refused_before_any_request(ray_auth_env, tmp_path, variables, words):
    missing = str(tmp_path / "missing")
    ray_auth_env(**{k: v.format(missing=missing) for k, v in variables.items()})
    with pytest.raises(RolloutError) as err:
        ServeCluster(closed_port_address())  # would say "cannot reach" had it sent a request
    for word in words:
        assert word.format(missing=missing) in str(err.value)


@pytest.mark.parametrize(
    "address,local",
    [
        ("http://127.0.0.1:8265", True),
        ("http://127.8.0.1:8265", True),
        ("http://localhost:8265", True),
        ("http://[::1]:8265", True),
        ("http://10.0.0.5:8265", False),
        ("http://0.0.0.0:8265", False),
        ("https://ray.example.com", False),
        ("http://head:8265", False),
    ],
)
def test_local_addresses(address, local):
    assert is_local_address(address) is local


def test_warning_only_for_a_remote_dashboard_without_token_authentication():
    warning = open_dashboard_warning("http://10.0.0.5:8265", "disabled")
    assert warning is not None and "answers without a token" in warning and "RAY_AUTH_MODE=token" in warning
    assert open_dashboard_warning("http://10.0.0.5:8265", "token") is None
    assert open_dashboard_warning("http://10.0.0.5:8265", None) is None  # it did not say: no guess
    assert open_dashboard_warning("http://127.0.0.1:8265", "disabled") is None


class FakeDashboard(BaseHTTPRequestHandler):
    """Ray's dashboard as far as ServeCluster's first calls go: /api/ray/version checks the token as Ray's
    middleware does (401 none, 403 wrong), /api/authentication_mode is public."""

    token: str | None = None
    seen: list[dict[str, str]] = []

    def do_GET(self) -> None:
        self.seen.append(dict(self.headers))
        if self.path == "/api/authentication_mode":
            mode = "token" if self.token else "disabled"
            return self._send(200, json.dumps({"authentication_mode": mode}))
        sent = self.headers.get("authorization")
        if self.token and not sent:
            return self._send(401, "Unauthorized: Missing authentication token")
        if self.token and sent != f"Bearer {self.token}":
            return self._send(403, "Forbidden: Invalid authentication token")
        return self._send(200, json.dumps({"ray_version": "2.60.0", "version": "4"}))

    def _send(self, status: int, body: str) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body.encode())

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def fake_dashboard() -> Iterator[tuple[str, type[FakeDashboard]]]:
    handler = type("Handler", (FakeDashboard,), {"token": None, "seen": []})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", handler
    server.shutdown()
    thread.join()


@pytest.mark.parametrize(
    "sent,words",
    [
        ({}, ["requires a token", "none was sent", "RAY_AUTH_MODE=token", "$RAY_AUTH_TOKEN_PATH"]),
        (
            {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "wrong-token"},
            ["rejected the token", "get-auth-token"],
        ),
    ],
)
def test_a_dashboard_that_wants_a_token_refuses_clearly(ray_auth_env, fake_dashboard, sent, words):
    address, handler = fake_dashboard
    handler.token = "the-cluster-token"
    ray_auth_env(**sent)
    with pytest.raises(RolloutError) as err:
        ServeCluster(address)
    for word in words:
        assert word in str(err.value)
    assert "wrong-token" not in str(err.value) and "the-cluster-token" not in str(err.value)


def test_the_token_is_sent_and_a_remote_open_dashboard_warned_about_once(
    ray_auth_env, fake_dashboard, monkeypatch
):
    address, handler = fake_dashboard
    handler.token = "the-cluster-token"
    ray_auth_env(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN="the-cluster-token")
    warnings: list[str] = []
    ServeCluster(address, warn=warnings.append)
    assert warnings == []  # token mode, and local anyway
    assert {h.get("authorization") for h in handler.seen} >= {"Bearer the-cluster-token"}

    handler.token = None  # the same dashboard, open, seen as a remote address
    monkeypatch.setattr(dashboard, "is_local_address", lambda address: False)
    ServeCluster(address, warn=warnings.append)
    assert len(warnings) == 1 and f"the Ray dashboard at {address} answers without a token" in warnings[0]


def app_entry(
    app_config: dict[str, Any],
    status: str = "RUNNING",
    replicas: tuple[str, ...] = ("RUNNING",),
    source: str = "declarative",
) -> dict[str, Any]:
    return {
        "status": status,
        "message": "",
        "route_prefix": app_config.get("route_prefix"),
        "source": source,
        "deployed_app_config": copy.deepcopy(app_config),
        "deployments": {
            "LLMServer": {
                "status": "HEALTHY" if status == "RUNNING" else "UPDATING",
                "target_num_replicas": len(replicas),
                "replicas": [{"replica_id": f"r{i}", "state": s} for i, s in enumerate(replicas)],
            }
        },
    }


def local_app(**changes: Any) -> dict[str, Any]:
    app = render("local")["applications"][0]
    app.update(changes)
    return app


def test_deploy_body_keeps_other_declarative_apps_and_serve_options():
    ours, other = local_app(), local_app(name="other", route_prefix="/other")
    details = {
        "http_options": {"host": "127.0.0.1", "port": 8123},
        "proxy_location": "EveryNode",
        "applications": {
            "other": app_entry(other),
            "manual": app_entry(local_app(name="manual", route_prefix="/m"), source="imperative"),
            "headroom": app_entry(local_app(args={"config": "old"})),
        },
    }
    body = deploy_body(details, ours, "headroom")
    ServeDeploySchema.model_validate(body)
    assert [a["name"] for a in body["applications"]] == ["other", "headroom"]  # imperative apps are not ours
    assert body["applications"][1] == ours
    assert body["http_options"] == {"host": "127.0.0.1", "port": 8123}
    removed = deploy_body(details, None, "headroom")
    assert [a["name"] for a in removed["applications"]] == ["other"]


def test_conflicts_with_an_imperative_app_or_a_taken_route_are_refused():
    ours = local_app()
    with pytest.raises(RolloutError, match="deployed from Python"):
        check_conflicts({"applications": {"headroom": app_entry(ours, source="imperative")}}, ours)
    with pytest.raises(RolloutError, match="already served by application 'x'"):
        check_conflicts({"applications": {"x": app_entry(local_app(name="x"))}}, ours)
    check_conflicts({"applications": {"headroom": app_entry(ours)}}, ours)


def test_update_kind():
    a = local_app()
    b = local_app(args={**a["args"], "config": {**a["args"]["config"], "name": "b"}})
    scaled = copy.deepcopy(a)
    scaled["deployments"][0]["num_replicas"] = 3
    assert update_kind(None, a).startswith("new application")
    assert update_kind(a, copy.deepcopy(a)).startswith("no change")
    assert update_kind(a, b).startswith("in-place update")
    assert update_kind(a, scaled).startswith("options-only")


@pytest.mark.parametrize(
    "entry,expected_hash,phase,word",
    [
        (None, "h1", "waiting", "not listed"),
        ({"status": "RUNNING", "hash": "h0"}, "h1", "waiting", "still reports config h0"),
        ({"status": "DEPLOYING", "hash": "h1"}, "h1", "waiting", "DEPLOYING"),
        ({"status": "DEPLOY_FAILED", "hash": "h1"}, "h1", "failed", "failed to deploy"),
        (
            {"status": "RUNNING", "hash": "h1", "replicas": ("RUNNING", "STARTING")},
            "h1",
            "waiting",
            "STARTING",
        ),
        ({"status": "RUNNING", "hash": "h1"}, "h1", "ready", "RUNNING config h1"),
        ({"status": "RUNNING", "hash": None}, None, "ready", "RUNNING"),
    ],
)
def test_assess_app(entry, expected_hash, phase, word):
    apps = {}
    if entry is not None:
        app = local_app(args={"headroom": {"config_hash": entry["hash"]}})
        apps["headroom"] = app_entry(app, entry["status"], entry.get("replicas", ("RUNNING",)))
    health = assess_app({"applications": apps}, "headroom", expected_hash)
    assert health.phase == phase and word in health.message, health


def test_assess_app_absent():
    assert assess_app({"applications": {}}, "headroom", None, absent=True).phase == "ready"
    details = {"applications": {"headroom": app_entry(local_app())}}
    assert assess_app(details, "headroom", None, absent=True).phase == "waiting"


def test_serve_base_url():
    details = {"http_options": {"host": "0.0.0.0", "port": 8000}}
    assert serve_base_url(details, "http://head:8265", "/") == "http://head:8000"
    assert (
        serve_base_url({"http_options": {"host": "10.0.0.5", "port": 9}}, "http://h:1", "/v")
        == "http://10.0.0.5:9/v"
    )


def test_smoke_command_runs_the_locustfile_headless(tmp_path):
    cmd = smoke_command("http://h:8000/x", "m", tmp_path / "raw.jsonl", SmokeOptions(users=3, duration_s=7))
    text = " ".join(cmd)
    assert cmd[1:3] == ["-m", "locust"] and "--headless" in cmd
    assert cmd[cmd.index("-f") + 1].endswith("loadtests/locustfile.py")
    for flag, value in (("-u", "3"), ("-t", "7s"), ("--host", "http://h:8000/x"), ("--model", "m")):
        assert f"{flag} {value}" in text
    assert f"--raw-file {tmp_path / 'raw.jsonl'}" in text


# --------------------------------------------------------------------------------------------------------
# rollout against a fake cluster
# --------------------------------------------------------------------------------------------------------


class FakeCluster:
    """Serve as data: a deploy sets the apps it declares RUNNING with that config (or whatever `on_deploy`
    makes of them); every call is recorded."""

    def __init__(self, address: str, apps: dict[str, Any] | None = None, gpus: list[int] | None = None):
        self.address = address
        self.apps: dict[str, Any] = apps or {}
        self.gpus = gpus or [0]
        self.deploys: list[dict[str, Any]] = []
        self.calls: list[str] = []

    def details(self) -> dict[str, Any]:
        self.calls.append("details")
        return {"http_options": {"host": "127.0.0.1", "port": 8000}, "applications": copy.deepcopy(self.apps)}

    def deploy(self, body: dict[str, Any]) -> None:
        self.calls.append("deploy")
        ServeDeploySchema.model_validate(body)
        self.deploys.append(copy.deepcopy(body))
        declared = {a["name"]: a for a in body["applications"]}
        self.apps = {
            name: entry
            for name, entry in self.apps.items()
            if entry["source"] != "declarative" or name in declared
        }
        for name, app in declared.items():
            self.apps[name] = app_entry(app)

    def gpus_per_node(self) -> list[int]:
        self.calls.append("gpus")
        return self.gpus

    def probe(self, base_url: str, model: str | None) -> str | None:
        self.calls.append("probe")
        return None


def fixed_now() -> datetime:
    return datetime(2026, 11, 30, 12, 0, 0, tzinfo=timezone.utc)


def smoke_with(ttft_s: float):
    def runner(base_url: str, model: str, raw_file: Path, opts: SmokeOptions) -> dict[str, Any]:
        raw_file.write_text("")
        return summarize(raw(20, ttft_s, 0.005))

    return runner


def run_rollout(files: list[Path], fake: FakeCluster, state: Path, ttft_s: float = 0.05, **kwargs: Any):
    return rollout(
        config_files=files,
        address="http://fake:8265",
        state=state,
        connect=lambda url: fake,
        smoke_runner=smoke_with(ttft_s),
        poll_s=0,
        ready_timeout_s=5,
        say=lambda line: None,
        now=fixed_now,
        **kwargs,
    )


def test_rollout_success_then_gate_failure_rolls_back(tmp_path):
    state = tmp_path / "state"
    fake = FakeCluster("http://fake:8265")
    version_a = overlay(tmp_path, "name: svc\n")
    a = run_rollout(version_a, fake, state)
    assert a.outcome == "succeeded" and a.previous_hash is None
    assert Path(a.rendered_path).is_file()
    app_a = fake.apps["svc"]["deployed_app_config"]

    version_b = overlay(tmp_path, "name: svc\nslo: {ttft_p95_ms: 10}\n", "b.yaml")
    b = run_rollout(version_b, fake, state, ttft_s=0.05)  # 50 ms > 10 ms: the gate fails
    assert b.outcome == "rolled_back"
    assert b.gate is not None and any("TTFT p95" in r for r in b.gate.reasons)
    assert fake.deploys[-1]["applications"] == [app_a]  # the version that ran before, as the cluster had it
    assert fake.apps["svc"]["deployed_app_config"]["args"]["headroom"]["config_hash"] == a.config_hash

    history = read_history(state, "svc")
    assert [h["outcome"] for h in history] == ["succeeded", "rolled_back"]
    assert history[1]["previous_rendered"] == a.rendered_path
    assert history[1]["smoke"]["ttft_p95_ms"] == pytest.approx(50)
    assert history[1]["slo"]["ttft_p95_ms"] == 10


def test_first_rollout_that_fails_removes_the_app_and_keeps_the_others(tmp_path):
    other = local_app(name="other", route_prefix="/other")
    fake = FakeCluster("http://fake:8265", apps={"other": app_entry(other)})
    result = run_rollout(
        overlay(tmp_path, "name: svc\nroute_prefix: /svc\nslo: {ttft_p95_ms: 1}\n"), fake, tmp_path / "state"
    )
    assert result.outcome == "rolled_back"
    assert set(fake.apps) == {"other"}
    assert fake.apps["other"]["deployed_app_config"] == other


def test_dry_run_reads_but_deploys_and_writes_nothing(tmp_path):
    state = tmp_path / "state"
    fake = FakeCluster("http://fake:8265")
    lines: list[str] = []
    files = overlay(tmp_path, "name: svc\n")
    result = rollout(
        config_files=files,
        address="http://fake:8265",
        dry_run=True,
        state=state,
        connect=lambda url: fake,
        say=lines.append,
    )
    assert result.outcome == "dry_run"
    assert "deploy" not in fake.calls and not state.exists()
    assert any("nothing deployed, nothing written" in line for line in lines)


class MustNotBeContacted:
    def __init__(self, address: str):
        raise AssertionError(f"the cluster at {address} was contacted before the inputs were checked")


@pytest.mark.parametrize(
    "kwargs,error,words",
    [
        ({"env": "production"}, ConfigError, ["unknown environment 'production'", "prod", "staging"]),
        ({"env": "local", "address": "head:8265"}, RolloutError, ["has no scheme"]),
        ({"env": "local", "address": "ray://head:10001"}, RolloutError, ["Ray Client address"]),
        ({}, RolloutError, ["give --env"]),
    ],
)
def test_bad_inputs_fail_before_the_cluster_is_contacted(tmp_path, kwargs, error, words):
    kwargs.setdefault("address", closed_port_address())
    with pytest.raises(error) as err:
        rollout(state=tmp_path, connect=MustNotBeContacted, **kwargs)
    for word in words:
        assert word in str(err.value)
    assert not any(tmp_path.iterdir())
    # The real client too: had it been contacted, the error would say so instead.
    with pytest.raises(error) as err:
        rollout(state=tmp_path, **kwargs)
    assert "cannot reach" not in str(err.value)


def test_overlay_with_an_unknown_key_fails_before_the_cluster_is_contacted(tmp_path):
    files = overlay(tmp_path, "engine: {max_num_seq: 8}\n")
    with pytest.raises(ConfigError) as err:
        rollout(config_files=files, address=closed_port_address(), state=tmp_path, connect=MustNotBeContacted)
    assert "engine.max_num_seq" in str(err.value) and "max_num_seqs" in str(err.value)


def test_plan_that_does_not_fit_is_refused_before_any_deploy(tmp_path):
    # Pure: rendering for 1 GPU.
    path = tmp_path / "big.yaml"
    path.write_text("model: {source: meta-llama/Llama-3.1-70B-Instruct}\ndeployment: {num_replicas: 1}\n")
    with pytest.raises(ConfigError, match="plan"):
        render(config_files=[BASE, path], gpus=1)
    # GPU config on a live cluster of one 1-GPU node: the cluster is read (GPUs), never deployed to.
    fake = FakeCluster("http://fake:8265", gpus=[1])
    with pytest.raises(ConfigError) as err:
        run_rollout([BASE, path], fake, tmp_path / "state")
    assert "deploy" not in fake.calls
    assert "GiB" in str(err.value) or "GPU" in str(err.value)
    # prod's autoscaling floor (2 replicas) on one GPU.
    fake = FakeCluster("http://fake:8265", gpus=[1])
    with pytest.raises(ConfigError, match="min_replicas \\(2\\) needs 2 GPUs"):
        rollout(env="prod", address="http://fake:8265", state=tmp_path, connect=lambda url: fake)
    assert "deploy" not in fake.calls


def test_gpu_config_on_a_cluster_without_gpus_is_refused(tmp_path):
    fake = FakeCluster("http://fake:8265", gpus=[0, 0])
    with pytest.raises(ConfigError, match="no GPU nodes"):
        rollout(env="staging", address="http://fake:8265", state=tmp_path, connect=lambda url: fake)
    assert "deploy" not in fake.calls


def test_unreachable_cluster_fails_before_anything_is_deployed_or_written(tmp_path):
    address = closed_port_address()
    with pytest.raises(RolloutError, match=f"cannot reach the Ray dashboard at {address}"):
        rollout(env="local", address=address, state=tmp_path / "state")
    assert not (tmp_path / "state").exists()


def test_conflicting_app_fails_before_any_deploy(tmp_path):
    ours = render(config_files=overlay(tmp_path, "name: svc\n"))["applications"][0]
    fake = FakeCluster("http://fake:8265", apps={"svc": app_entry(ours, source="imperative")})
    with pytest.raises(RolloutError, match="deployed from Python"):
        run_rollout(overlay(tmp_path, "name: svc\n"), fake, tmp_path / "state")
    assert "deploy" not in fake.calls


# --------------------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------------------


@pytest.fixture
def cli() -> typer.Typer:
    app = typer.Typer()
    register(app)
    return app


def test_cli_render_diff_and_errors(cli, tmp_path):
    runner = CliRunner()
    out = tmp_path / "prod.serve.yaml"
    result = runner.invoke(cli, ["render", "--env", "prod", "--gpus", "8", "--nodes", "2", "--out", str(out)])
    assert result.exit_code == 0, result.output
    ServeDeploySchema.model_validate(yaml.safe_load(out.read_text()))

    result = runner.invoke(cli, ["diff", "--env", "staging", "--env", "prod", "--gpus", "8", "--json"])
    assert result.exit_code == 0, result.output
    assert {"section": "config", "path": "deployment.num_replicas", "staging": 1, "prod": None} in json.loads(
        result.output
    )

    for args, word in (
        (["rollout", "--env", "nope", "--address", closed_port_address()], "unknown environment"),
        (["rollout", "--env", "local", "--address", "localhost:8265"], "has no scheme"),
        (["status", "--address", closed_port_address()], "cannot reach"),
        (["diff", "--env", "local"], "exactly two"),
        (["render", "--env", "local", "--config", str(LOCAL)], "not both"),
    ):
        result = runner.invoke(cli, args)
        assert result.exit_code == 2, (args, result.output)
        assert "error:" in result.output and word in result.output, result.output
