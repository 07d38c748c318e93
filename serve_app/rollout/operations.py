"""Config-driven rollouts on Ray Serve's own deploy path: render, diff, roll out (verify, roll back), status.

    headroom render  --env staging --out staging.serve.yaml   # the file `serve deploy` reads
    headroom diff    --env staging --env prod --gpus 8         # field by field, with the plan's consequences
    headroom rollout --env staging --address http://head:8265  # deploy, wait, smoke-test, keep or roll back
    headroom status  --address http://head:8265

A rendered file is a Ray Serve config (``ServeDeploySchema``) with one application per config. Its ``args``
carry the merged, validated headroom config inline (``args.config``, a mapping) plus ``args.headroom``
(env, config hash, planned TP size and max_num_seqs), so that:
- the file is self-contained: `serve deploy` from any machine works, the cluster needs no copy of configs/;
- Serve's code version (a hash of import_path, runtime_env and args) changes exactly when the merged config
  or the plan's engine settings change, so an engine change rolls the replicas over with Serve's rolling
  update, and redeploying the same config changes nothing;
- the live cluster reports which config it runs (`status`, and `rollout --dry-run` diffs against it).

`rollout` deploys through the dashboard's REST API (``PUT /api/serve/applications/``, exactly what
`serve deploy` sends). That call declares the *whole* set of declaratively deployed applications, so the
cluster's other applications are sent back unchanged with ours replaced, and Serve's running HTTP, gRPC
and proxy settings are kept. Every rendered config is kept under the state directory with a history:

    $HEADROOM_STATE_DIR (default ./.headroom)/rollouts/<env>/<UTC time>-<config hash>.yaml
                                                  .../<UTC time>-<config hash>.smoke.jsonl  (Locust raw)
                                                  .../history.jsonl  (one JSON line per rollout)

Decisions (what to render, what differs, what the update will do, whether the app is ready, whether the
smoke load passed the SLO) are pure functions of their inputs. The Ray/HTTP calls live in `ServeCluster`,
the load in the injected smoke runner (loadtests.smoke); `rollout()` validates every input (config,
address, plan) before its first network call, and deploys nothing before the cluster has been read.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
import textwrap
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlsplit

import yaml

from serve_app.config import (
    DEFAULT_CONFIG_DIR,
    HeadroomConfig,
    SLOSection,
    load_config_files,
    load_env_config,
)
from serve_app.planning.from_config import describe_cluster, plan_config, planning_cluster, require_fit
from serve_app.planning.placement import ClusterSpec, Plan
from serve_app.serving.serve_options import deployment_options

__all__ = [
    "DEFAULT_DASHBOARD_ADDRESS",
    "DEPLOYMENT_NAME",
    "IMPORT_PATH",
    "STATE_DIR_ENV",
    "AppHealth",
    "FieldChange",
    "GateResult",
    "Rendered",
    "RolloutError",
    "RolloutResult",
    "ServeCluster",
    "SmokeOptions",
    "Target",
    "append_history",
    "assess_app",
    "auth_headers",
    "config_hash",
    "dashboard_url",
    "deploy_body",
    "diff",
    "diff_rendered",
    "format_changes",
    "format_status",
    "gate",
    "last_rollouts",
    "load_target",
    "planning_cluster",
    "prepare",
    "read_history",
    "render",
    "render_target",
    "rollout",
    "state_dir",
    "status",
]

IMPORT_PATH = "serve_app.app:build_app"
DEPLOYMENT_NAME = "LLMServer"
STATE_DIR_ENV = "HEADROOM_STATE_DIR"
DEFAULT_STATE_DIR = ".headroom"
DEFAULT_DASHBOARD_ADDRESS = "http://127.0.0.1:8265"
HASH_CHARS = 12


class RolloutError(RuntimeError):
    """A rollout that cannot start or go on: a bad address, an unreachable cluster, a rejected deploy."""


# --------------------------------------------------------------------------------------------------------
# Inputs: which config, which cluster address
# --------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    """A validated config and where it came from; `label` names its history (the env, else the app)."""

    label: str
    cfg: HeadroomConfig
    sources: tuple[str, ...]
    env: str | None = None


def load_target(
    env: str | None = None,
    config_files: Sequence[str | Path] | None = None,
    config_dir: str | Path = DEFAULT_CONFIG_DIR,
) -> Target:
    """base.yaml + <env>.yaml from config_dir, or the given files merged in order (as `--config` does).

    Raises ConfigError for an unknown environment, an unknown key, a bad value or a missing file.
    """
    if env and config_files:
        raise RolloutError("give --env or --config, not both")
    if config_files:
        cfg = load_config_files(*config_files)
        files = [Path(p) for p in config_files]
        if len(files) == 1 and files[0].name != "base.yaml" and (files[0].parent / "base.yaml").is_file():
            files.insert(0, files[0].parent / "base.yaml")  # load_config_files overlays it on base.yaml
        return Target(cfg.name, cfg, tuple(_show_path(p) for p in files))
    if not env:
        raise RolloutError("give --env ENV (an environment in configs/) or --config FILE...")
    cfg = load_env_config(env, config_dir)
    directory = Path(config_dir)
    sources = (_show_path(directory / "base.yaml"), _show_path(directory / f"{env}.yaml"))
    return Target(env, cfg, sources, env)


def _show_path(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def default_address(environ: Mapping[str, str] = os.environ) -> tuple[str, str]:
    """(address, where it came from): $RAY_ADDRESS, else the local dashboard."""
    if environ.get("RAY_ADDRESS"):
        return environ["RAY_ADDRESS"], "$RAY_ADDRESS"
    return DEFAULT_DASHBOARD_ADDRESS, "the default"


def dashboard_url(address: str, source: str = "--address") -> str:
    """The Ray dashboard's HTTP address (what `serve deploy` talks to), normalized; pure.

    Refuses, naming the problem: no scheme (host:port), a Ray Client address (ray://), another scheme,
    no host, a port that is not a number in 1-65535, or a path/query after the port.
    """
    text = address.strip()
    hint = "the Ray dashboard's HTTP address, e.g. http://<head-node>:8265 (what `serve deploy` uses)"
    if not text:
        raise RolloutError(f"{source} is empty: give {hint}")
    if "://" not in text:
        host = text.split("/")[0].rsplit(":", 1)[0] or "<head-node>"
        extra = ""
        if text.endswith((":6379", ":10001")):
            extra = " (6379 is the GCS port and 10001 the Ray Client port; the dashboard listens on 8265)"
        raise RolloutError(
            f"{source} {address!r} has no scheme{extra}: give {hint}, here probably http://{host}:8265"
        )
    parts = urlsplit(text)
    scheme = parts.scheme.lower()
    if scheme == "ray":
        raise RolloutError(
            f"{source} {address!r} is a Ray Client address; rollouts use the dashboard's REST API: "
            f"give {hint}"
        )
    if scheme not in ("http", "https"):
        raise RolloutError(f"{source} {address!r}: scheme {parts.scheme!r} is not supported; give {hint}")
    if not parts.hostname:
        raise RolloutError(f"{source} {address!r} has no host name; give {hint}")
    try:
        port = parts.port
    except ValueError:
        raise RolloutError(
            f"{source} {address!r}: the port must be a number in 1-65535; give {hint}"
        ) from None
    if port == 0:
        raise RolloutError(f"{source} {address!r}: the port must be a number in 1-65535; give {hint}")
    if parts.path.strip("/") or parts.query or parts.fragment:
        raise RolloutError(f"{source} {address!r}: give the dashboard's address without a path; {hint}")
    return f"{scheme}://{parts.netloc}"


# --------------------------------------------------------------------------------------------------------
# Plan and render (pure)
# --------------------------------------------------------------------------------------------------------


def config_hash(cfg: HeadroomConfig) -> str:
    """A short sha256 of the merged config (canonical JSON): the same config always has the same hash."""
    text = json.dumps(cfg.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:HASH_CHARS]


def _target_replicas(cfg: HeadroomConfig) -> int:
    auto = cfg.deployment.autoscaling
    return auto.max_replicas if auto is not None else (cfg.deployment.num_replicas or 1)


def rolling_surge(cfg: HeadroomConfig, plan: Plan) -> tuple[int, str]:
    """Serve's max_surge_percent for an in-place update, and what it means.

    With a surge, Serve starts a replacement before it stops an old replica, so capacity never drops during
    a rolling update; without room for an extra replica it stops one first (Serve's default). On GPUs the
    room is what the plan says fits beyond the deployment's target (max_replicas when autoscaled); a CPU
    replica gets one extra at a time. The percent is rounded down so Serve's ceiling stays within the room.
    """
    target = _target_replicas(cfg)
    extra = 1 if cfg.resources.accelerator == "cpu" else min(max(plan.replicas - target, 0), target)
    percent = min(100, math.floor(100 * extra / target)) if extra else 0
    if percent == 0:
        note = (
            "no surge: the cluster has no room for an extra replica, so Serve stops an old replica before "
            "its replacement starts (capacity dips by a replica per step"
            + ("; with 1 replica the app is down while the new one starts)" if target == 1 else ")")
        )
    else:
        extra = math.ceil(percent * target / 100)
        note = (
            f"surge {percent}% (up to {extra} extra replica(s)): replacements start before old replicas "
            "stop, so capacity stays up during the update"
        )
    return percent, note


@dataclass(frozen=True)
class Rendered:
    """A rendered Serve config and everything it was made from."""

    target: Target
    cluster: ClusterSpec
    plan: Plan
    config_hash: str
    surge_note: str
    config: dict[str, Any]

    @property
    def app(self) -> dict[str, Any]:
        app: dict[str, Any] = self.config["applications"][0]
        return app

    def plan_facts(self) -> dict[str, Any]:
        """The plan's consequences, as `diff` compares them and the file header shows them."""
        p = self.plan
        return {
            "cluster": describe_cluster(self.target.cfg, self.cluster),
            "tensor_parallel_size": p.tensor_parallel_size,
            "replicas_that_fit": p.replicas,
            "replicas": _replica_text(self.target.cfg),
            "max_num_seqs": p.max_num_seqs,
            "kv_cache_tokens_per_replica": p.kv_cache_tokens_per_replica,
            "max_concurrency_per_replica": round(p.max_concurrency_per_replica, 1),
            "bundles": [dict(b) for b in p.bundles],
            "placement_strategy": p.placement_strategy,
            "rolling_update_extra_replicas": math.ceil(
                _deployment_entry(self.app).get("max_surge_percent", 0)
                * _target_replicas(self.target.cfg)
                / 100
            ),
        }

    def header(self, rendered_at: str | None = None) -> str:
        cfg, facts = self.target.cfg, self.plan_facts()
        lines = [
            "Ray Serve config rendered by headroom (`serve deploy` and `headroom rollout` read it). Do not",
            "edit it: change configs/ and render again. args.config is the merged config the replicas run.",
            f"env:          {self.target.env or '(config files)'}  [{' + '.join(self.target.sources)}]",
            f"app:          {cfg.name} at {cfg.route_prefix}, model {cfg.served_model_name}",
            f"config hash:  {self.config_hash}",
            f"planned on:   {facts['cluster']}",
            (
                f"plan:         TP {facts['tensor_parallel_size']}, replicas {facts['replicas']} "
                f"({facts['replicas_that_fit']} fit), max_num_seqs {facts['max_num_seqs']}, "
                f"{facts['kv_cache_tokens_per_replica']:,} KV tokens/replica"
            ),
            f"rollout:      {self.surge_note}",
        ]
        lines += [f"warning:      {w}" for w in self.plan.warnings]
        if rendered_at:
            lines.append(f"rendered at:  {rendered_at}")
        wrapped = [textwrap.wrap(line, 106, subsequent_indent=" " * 14) or [""] for line in lines]
        return "".join(f"# {part}\n" for parts in wrapped for part in parts)

    def to_yaml(self, rendered_at: str | None = None) -> str:
        body: str = yaml.safe_dump(self.config, sort_keys=False, width=110)
        return self.header(rendered_at) + body


def _replica_text(cfg: HeadroomConfig) -> str:
    auto = cfg.deployment.autoscaling
    if auto is None:
        return str(cfg.deployment.num_replicas or 1)
    return f"{auto.min_replicas}-{auto.max_replicas} (autoscaled, {auto.policy})"


def render_target(target: Target, cluster: ClusterSpec) -> Rendered:
    """The Serve config for a target planned on `cluster`; refused when the plan does not fit. Pure apart
    from reading a local model's config.json."""
    cfg = target.cfg
    plan = plan_config(cfg, cluster)
    require_fit(plan)
    digest = config_hash(cfg)
    surge, note = rolling_surge(cfg, plan)
    deployment: dict[str, Any] = {"name": DEPLOYMENT_NAME, **deployment_options(cfg, plan)}
    deployment["max_surge_percent"] = surge
    app = {
        "name": cfg.name,
        "route_prefix": cfg.route_prefix,
        "import_path": IMPORT_PATH,
        "args": {
            "config": cfg.model_dump(mode="json"),
            # Deterministic (no time): identical configs give identical args, so Serve sees no change.
            "headroom": {
                "env": target.label,
                "config_hash": digest,
                "tensor_parallel_size": plan.tensor_parallel_size,
                "max_num_seqs": plan.max_num_seqs,
            },
        },
        "deployments": [deployment],
    }
    config = {"applications": [app]}
    validate_serve_config(config)
    return Rendered(target, cluster, plan, digest, note, config)


def validate_serve_config(config: Mapping[str, Any]) -> None:
    """Checks a Serve config with Ray's own schema (what `serve deploy` and the REST API validate)."""
    from pydantic import ValidationError
    from ray.serve.schema import ServeDeploySchema

    try:
        ServeDeploySchema.model_validate(dict(config))
    except ValidationError as err:
        raise RolloutError(f"the Serve config is not valid for Ray Serve: {err}") from None


def render(
    env: str | None = None,
    config_files: Sequence[str | Path] | None = None,
    *,
    gpus: int | None = None,
    nodes: int = 1,
    gpu_memory_gib: float | None = None,
    live_gpus_per_node: Sequence[int] | None = None,
    config_dir: str | Path = DEFAULT_CONFIG_DIR,
) -> dict[str, Any]:
    """The Ray Serve config (a ServeDeploySchema-valid dict) for an environment or config files."""
    target = load_target(env, config_files, config_dir)
    cluster = planning_cluster(target.cfg, gpus, nodes, gpu_memory_gib, live_gpus_per_node)
    return render_target(target, cluster).config


# --------------------------------------------------------------------------------------------------------
# Diff (pure)
# --------------------------------------------------------------------------------------------------------

_UNSET = object()


@dataclass(frozen=True)
class FieldChange:
    """One field that differs: section 'config' (merged config), 'plan' (the planner's consequences) or
    'serve' (the rendered Serve deployment options)."""

    section: str
    path: str
    before: Any
    after: Any

    def render(self) -> str:
        return f"{self.section}: {self.path}: {_fmt(self.before)} -> {_fmt(self.after)}"


def _fmt(value: Any) -> str:
    if value is _UNSET:
        return "(unset)"
    if isinstance(value, str):
        return value
    return json.dumps(value, sort_keys=True)


def flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """Dotted paths to leaves; lists are leaves (compared whole); an empty mapping is a leaf."""
    if isinstance(value, Mapping) and value:
        out: dict[str, Any] = {}
        for key, item in value.items():
            out.update(flatten(item, f"{prefix}.{key}" if prefix else str(key)))
        return out
    return {prefix: value}


def field_changes(section: str, before: Mapping[str, Any], after: Mapping[str, Any]) -> list[FieldChange]:
    """Leaf by leaf. A section that is null on one side and a mapping on the other shows as its leaves
    (unset on the null side), e.g. deployment.autoscaling.min_replicas: (unset) -> 2."""
    a, b = flatten(before), flatten(after)
    changes = []
    for path in sorted(set(a) | set(b)):
        old, new = a.get(path, _UNSET), b.get(path, _UNSET)
        if old == new:
            continue
        nested = path + "."
        if (old is None and new is _UNSET and any(k.startswith(nested) for k in b)) or (
            new is None and old is _UNSET and any(k.startswith(nested) for k in a)
        ):
            continue  # shown by the leaves below it
        changes.append(FieldChange(section, path, old, new))
    return changes


def _deployment_entry(app: Mapping[str, Any]) -> dict[str, Any]:
    for dep in app.get("deployments") or []:
        if dep.get("name") == DEPLOYMENT_NAME:
            return {k: v for k, v in dep.items() if k != "name"}
    return {}


def diff_rendered(a: Rendered, b: Rendered) -> list[FieldChange]:
    """Config fields, then the plan's consequences, then the Serve deployment options that differ."""
    changes = field_changes(
        "config", a.target.cfg.model_dump(mode="json"), b.target.cfg.model_dump(mode="json")
    )
    changes += field_changes("plan", a.plan_facts(), b.plan_facts())
    changes += field_changes("serve", _serve_view(a.app), _serve_view(b.app))
    return changes


def _serve_view(app: Mapping[str, Any]) -> dict[str, Any]:
    return {"name": app["name"], "route_prefix": app["route_prefix"], DEPLOYMENT_NAME: _deployment_entry(app)}


def diff(
    env_a: str,
    env_b: str,
    *,
    gpus: int | None = None,
    nodes: int = 1,
    gpu_memory_gib: float | None = None,
    live_gpus_per_node: Sequence[int] | None = None,
    config_dir: str | Path = DEFAULT_CONFIG_DIR,
) -> list[FieldChange]:
    """What differs between two environments, both planned on the same cluster."""
    rendered = []
    for env in (env_a, env_b):
        target = load_target(env, None, config_dir)
        cluster = planning_cluster(target.cfg, gpus, nodes, gpu_memory_gib, live_gpus_per_node)
        rendered.append(render_target(target, cluster))
    return diff_rendered(rendered[0], rendered[1])


def format_changes(changes: Sequence[FieldChange], a: str, b: str) -> str:
    if not changes:
        return f"{a} and {b} render the same deployment"
    lines = [f"{len(changes)} field(s) differ ({a} -> {b}):"]
    section = None
    for change in changes:
        if change.section != section:
            section = change.section
            lines.append(f"[{section}]")
        lines.append(f"  {change.path}: {_fmt(change.before)} -> {_fmt(change.after)}")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------------
# The live cluster as data (pure): what runs, what a deploy would change, whether it is ready
# --------------------------------------------------------------------------------------------------------


def app_meta(app_config: Mapping[str, Any] | None) -> dict[str, Any]:
    """The headroom metadata a rendered app carries in args ({} for an app headroom did not render)."""
    if not app_config:
        return {}
    args = app_config.get("args") or {}
    meta = args.get("headroom") if isinstance(args, Mapping) else None
    return dict(meta) if isinstance(meta, Mapping) else {}


def live_app_config(details: Mapping[str, Any], name: str) -> dict[str, Any] | None:
    """The config a declaratively deployed app runs, as the cluster reports it; None when it is absent."""
    app = (details.get("applications") or {}).get(name)
    if not app or not app.get("deployed_app_config"):
        return None
    return dict(app["deployed_app_config"])


def check_conflicts(details: Mapping[str, Any], app: Mapping[str, Any]) -> None:
    """Refuses a deploy Serve could not do or that would take another app's route."""
    for name, other in (details.get("applications") or {}).items():
        if name == app["name"]:
            if other.get("source") == "imperative":
                raise RolloutError(
                    f"application {name!r} on the cluster was deployed from Python (serve.run / headroom "
                    "serve), and Serve updates such an app only from Python; shut it down first (serve "
                    "shutdown) or give this config another name"
                )
        elif other.get("route_prefix") and other.get("route_prefix") == app.get("route_prefix"):
            raise RolloutError(
                f"route_prefix {app.get('route_prefix')!r} is already served by application {name!r}; set "
                "another route_prefix in the config"
            )


def deploy_body(details: Mapping[str, Any], app: Mapping[str, Any] | None, name: str) -> dict[str, Any]:
    """The declarative config to PUT: the cluster's other declarative apps unchanged (a PUT declares the whole
    set, and Serve deletes what is missing), app `name` replaced by `app` (or removed when None), and Serve's
    running proxy/HTTP/gRPC options and target capacity kept."""
    apps: list[dict[str, Any]] = []
    placed = False
    for other_name, other in (details.get("applications") or {}).items():
        if other_name == name:
            if app is not None:
                apps.append(dict(app))
                placed = True
        elif other.get("source") == "declarative" and other.get("deployed_app_config"):
            apps.append(dict(other["deployed_app_config"]))
    if app is not None and not placed:
        apps.append(dict(app))
    body: dict[str, Any] = {"applications": apps}
    for key in ("proxy_location", "http_options", "grpc_options", "target_capacity"):
        if details.get(key) is not None:
            body[key] = details[key]
    return body


def update_kind(previous: Mapping[str, Any] | None, new: Mapping[str, Any]) -> str:
    """What Serve will do with `new` given the app config it runs now (code version = import_path, runtime_env
    and args; see ray.serve._private.deploy_utils.get_app_code_version)."""
    if previous is None:
        return "new application: Serve builds it and starts its replicas"

    def code(app: Mapping[str, Any]) -> Any:
        return (app.get("import_path"), app.get("runtime_env") or {}, app.get("args") or {})

    same_options = _deployment_entry(previous) == _deployment_entry(new)
    if code(previous) == code(new):
        if same_options and previous.get("route_prefix") == new.get("route_prefix"):
            return "no change: the cluster already runs this config"
        return (
            "options-only update: Serve applies the new deployment options to the running replicas (it "
            "restarts them only for options that need it, such as ray_actor_options)"
        )
    return "in-place update: the config changed, so Serve's rolling update replaces every replica"


def serve_base_url(details: Mapping[str, Any], dashboard: str, route_prefix: str) -> str:
    """Where the app answers HTTP: Serve's host and port on the cluster (0.0.0.0: the dashboard's host)."""
    http = details.get("http_options") or {}
    host = str(http.get("host") or "127.0.0.1")
    if host in ("0.0.0.0", "::", ""):
        host = urlsplit(dashboard).hostname or "127.0.0.1"
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    port = int(http.get("port") or 8000)
    return f"http://{host}:{port}{route_prefix.rstrip('/')}"


@dataclass(frozen=True)
class AppHealth:
    """Whether an app reached its target: phase 'waiting', 'ready' or 'failed', and why."""

    phase: str
    message: str


_BUSY_REPLICA_STATES = ("STARTING", "UPDATING", "RECOVERING", "PENDING_MIGRATION")


def assess_app(
    details: Mapping[str, Any], name: str, config_hash: str | None, *, absent: bool = False
) -> AppHealth:
    """Whether app `name` reached its target, from Serve's details (GET /api/serve/applications/).

    absent=True: ready once the app is gone. Otherwise ready when the cluster reports config `config_hash`
    for it (None: any config), the app is RUNNING, and every deployment is HEALTHY with its target replicas
    RUNNING and none still starting or updating. DEPLOY_FAILED is final; anything else is waiting.
    """
    app = (details.get("applications") or {}).get(name)
    if absent:
        if app is None:
            return AppHealth("ready", f"application {name!r} is gone")
        return AppHealth("waiting", f"application {name!r} is being deleted ({app.get('status')})")
    if app is None:
        return AppHealth("waiting", f"application {name!r} is not listed yet")
    running = app_meta(app.get("deployed_app_config")).get("config_hash")
    if config_hash is not None and running != config_hash:
        return AppHealth("waiting", f"the cluster still reports config {running} for {name!r}")
    status, message = app.get("status"), (app.get("message") or "").strip()
    if status == "DEPLOY_FAILED":
        return AppHealth("failed", f"application {name!r} failed to deploy: {message or 'no message'}")
    if status != "RUNNING":
        return AppHealth("waiting", f"application {name!r} is {status}" + (f": {message}" if message else ""))
    for dep_name, dep in (app.get("deployments") or {}).items():
        dep_status = dep.get("status")
        if dep_status == "DEPLOY_FAILED":
            return AppHealth("failed", f"deployment {dep_name} failed: {dep.get('message') or 'no message'}")
        counts = replica_counts(dep)
        target = int(dep.get("target_num_replicas") or 0)
        busy = {s: n for s, n in counts.items() if s in _BUSY_REPLICA_STATES}
        if dep_status != "HEALTHY" or counts.get("RUNNING", 0) < target or busy:
            return AppHealth(
                "waiting",
                f"deployment {dep_name} is {dep_status}, replicas {_counts_text(counts)} (target {target})",
            )
    shown = f"config {running}" if running else "its config"
    return AppHealth("ready", f"application {name!r} is RUNNING {shown}")


def replica_counts(deployment: Mapping[str, Any]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for replica in deployment.get("replicas") or []:
        state = str(replica.get("state"))
        counts[state] = counts.get(state, 0) + 1
    return counts


def _counts_text(counts: Mapping[str, int]) -> str:
    return ", ".join(f"{n} {s}" for s, n in sorted(counts.items())) or "none"


# --------------------------------------------------------------------------------------------------------
# Smoke gate (pure)
# --------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GateResult:
    passed: bool
    reasons: tuple[str, ...]
    numbers: dict[str, Any]


def _num(value: Any) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return math.nan
    return number


def gate(summary: Mapping[str, Any], slo: SLOSection) -> GateResult:
    """The smoke load against the config's SLO: TTFT p95, TPOT p50 and error rate (loadtests/raw_stats.py's
    summary). No finished request, or no TPOT where requests produced tokens, fails: an unmeasured
    target is not met."""
    requests, ok = int(summary.get("requests") or 0), int(summary.get("ok") or 0)
    error_rate = _num(summary.get("error_rate"))
    ttft, tpot = _num(summary.get("ttft_p95_ms")), _num(summary.get("tpot_p50_ms"))
    numbers = {
        "requests": requests,
        "ok": ok,
        "error_rate": None if math.isnan(error_rate) else round(error_rate, 4),
        "ttft_p95_ms": None if math.isnan(ttft) else round(ttft, 2),
        "tpot_p50_ms": None if math.isnan(tpot) else round(tpot, 2),
    }
    reasons: list[str] = []
    if requests == 0:
        reasons.append("no request finished during the smoke load")
    else:
        if error_rate > slo.max_error_rate:
            reasons.append(
                f"error rate {error_rate:.1%} ({requests - ok} of {requests}) > slo.max_error_rate "
                f"{slo.max_error_rate:.1%}"
            )
        if ok == 0:
            reasons.append("no request succeeded, so TTFT and TPOT were not measured")
        else:
            if math.isnan(ttft) or ttft > slo.ttft_p95_ms:
                reasons.append(f"TTFT p95 {_ms(ttft)} > slo.ttft_p95_ms {slo.ttft_p95_ms:g} ms")
            if math.isnan(tpot) or tpot > slo.tpot_p50_ms:
                reasons.append(f"TPOT p50 {_ms(tpot)} > slo.tpot_p50_ms {slo.tpot_p50_ms:g} ms")
    return GateResult(not reasons, tuple(reasons), numbers)


def _ms(value: float) -> str:
    return "not measured" if math.isnan(value) else f"{value:.1f} ms"


# --------------------------------------------------------------------------------------------------------
# State directory and history
# --------------------------------------------------------------------------------------------------------


def state_dir(explicit: str | Path | None = None, environ: Mapping[str, str] = os.environ) -> Path:
    """--state-dir, else $HEADROOM_STATE_DIR, else ./.headroom."""
    if explicit:
        return Path(explicit)
    return Path(environ.get(STATE_DIR_ENV) or DEFAULT_STATE_DIR)


def env_dir(state: Path, label: str) -> Path:
    return state / "rollouts" / label


def stamp(now: datetime) -> str:
    return now.astimezone(timezone.utc).strftime("%Y%m%dT%H%M%SZ")


def append_history(state: Path, label: str, record: Mapping[str, Any]) -> Path:
    path = env_dir(state, label) / "history.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record, sort_keys=True) + "\n")
    return path


def read_history(state: Path, label: str) -> list[dict[str, Any]]:
    """The env's rollouts, oldest first; a line that is not JSON is skipped (a crash mid-write)."""
    path = env_dir(state, label) / "history.jsonl"
    if not path.is_file():
        return []
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def last_rollouts(state: Path) -> dict[str, dict[str, Any]]:
    """The last rollout of every environment with a history."""
    root = state / "rollouts"
    if not root.is_dir():
        return {}
    out = {}
    for directory in sorted(p for p in root.iterdir() if p.is_dir()):
        records = read_history(state, directory.name)
        if records:
            out[directory.name] = records[-1]
    return out


# --------------------------------------------------------------------------------------------------------
# The Ray/HTTP calls
# --------------------------------------------------------------------------------------------------------


class ClusterAPI(Protocol):
    address: str

    def details(self) -> dict[str, Any]: ...
    def deploy(self, body: Mapping[str, Any]) -> None: ...
    def gpus_per_node(self) -> list[int]: ...
    def probe(self, base_url: str, model: str | None) -> str | None: ...


def auth_headers(environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """Ray's auth token as an HTTP header when this machine has one (~/.ray/auth_token, $RAY_AUTH_TOKEN or
    $RAY_AUTH_TOKEN_PATH), as `ray start` turns token authentication on when a token exists; none when
    RAY_AUTH_MODE=disabled. A dashboard without token authentication ignores the header."""
    if environ.get("RAY_AUTH_MODE", "").lower() == "disabled":
        return {}
    try:
        from ray._raylet import AuthenticationTokenLoader  # type: ignore[attr-defined]

        headers = AuthenticationTokenLoader.instance().get_token_for_http_header(ignore_auth_mode=True)
    except Exception:  # no token machinery or an unreadable token: the dashboard says 401 if it wants one
        return {}
    return {str(k): str(v) for k, v in (headers or {}).items()}


_AUTH_HINT = (
    "the dashboard wants a Ray auth token (token authentication): put the cluster's token in "
    "~/.ray/auth_token, $RAY_AUTH_TOKEN or $RAY_AUTH_TOKEN_PATH (`ray get-auth-token` prints it on the "
    "head node)"
)


class ServeCluster:
    """A Ray cluster through its dashboard: Serve's REST API (ServeSubmissionClient, as `serve deploy`) and
    the state API. Construction checks, with a short timeout, that a Ray dashboard answers there."""

    def __init__(self, address: str, connect_timeout_s: float = 10.0):
        import httpx

        self.address = address
        self._headers = auth_headers()
        try:
            response = httpx.get(
                f"{address}/api/ray/version", headers=self._headers, timeout=connect_timeout_s
            )
        except httpx.HTTPError as err:
            raise RolloutError(
                f"cannot reach the Ray dashboard at {address} ({type(err).__name__}: {err}); check the "
                "address (http://<head-node>:8265) and that the cluster is up"
            ) from None
        if response.status_code in (401, 403):
            raise RolloutError(f"{address} answered {response.status_code}: {_AUTH_HINT}")
        if response.status_code != 200 or "ray_version" not in response.text:
            raise RolloutError(
                f"{address} answered {response.status_code} to /api/ray/version: not a Ray dashboard"
            )
        from ray.dashboard.modules.serve.sdk import ServeSubmissionClient

        try:
            self._client = ServeSubmissionClient(address, headers=dict(self._headers))
        except (ConnectionError, RuntimeError, ValueError) as err:
            raise RolloutError(f"the Ray dashboard at {address}: {err}") from None

    def details(self) -> dict[str, Any]:
        try:
            return dict(self._client.get_serve_details())
        except (ConnectionError, RuntimeError) as err:
            raise RolloutError(f"reading Serve's state from {self.address}: {err}") from None

    def deploy(self, body: Mapping[str, Any]) -> None:
        try:
            self._client.deploy_applications(dict(body))
        except (ConnectionError, RuntimeError) as err:
            raise RolloutError(f"Serve refused the deploy at {self.address}: {err}") from None

    def gpus_per_node(self) -> list[int]:
        """GPUs of each alive node, from the state API (GET /api/v0/nodes)."""
        import httpx

        try:
            response = httpx.get(
                f"{self.address}/api/v0/nodes", params={"limit": 10000}, headers=self._headers, timeout=30
            )
            response.raise_for_status()
            nodes = response.json()["data"]["result"]["result"]
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as err:
            raise RolloutError(f"listing the nodes of {self.address}: {err}") from None
        return [
            int((n.get("resources_total") or {}).get("GPU", 0)) for n in nodes if n.get("state") == "ALIVE"
        ]

    def probe(self, base_url: str, model: str | None) -> str | None:
        """None when {base_url}/v1/models answers 200 (listing `model`), else what is wrong."""
        import httpx

        try:
            response = httpx.get(f"{base_url}/v1/models", timeout=10)
        except httpx.HTTPError as err:
            return f"{base_url}/v1/models: {type(err).__name__}: {err}"
        if response.status_code != 200:
            return f"{base_url}/v1/models answered {response.status_code}"
        if model is not None:
            ids = [m.get("id") for m in response.json().get("data", [])]
            if model not in ids:
                return f"{base_url}/v1/models lists {ids}, not {model!r}"
        return None


@dataclass(frozen=True)
class SmokeOptions:
    """The short Locust run that gates a rollout."""

    users: int = 2
    duration_s: float = 10.0
    max_tokens: int = 32
    profile: str = "random"
    api: str = "chat"
    request_timeout_s: float = 60.0


SmokeRunner = Callable[[str, str, Path, SmokeOptions], Mapping[str, Any]]
"""Runs the smoke load against (base_url, served model name, raw file, options) and returns its summary
(loadtests.raw_stats.summarize's shape). The CLI passes loadtests.smoke.run_smoke_load: the load
generator lives in loadtests, which this layer does not import."""


# --------------------------------------------------------------------------------------------------------
# rollout
# --------------------------------------------------------------------------------------------------------


@dataclass
class RolloutResult:
    """What a rollout did. outcome: succeeded | rolled_back | rollback_failed | failed | dry_run."""

    outcome: str
    label: str
    app: str
    config_hash: str
    previous_hash: str | None
    update: str
    message: str
    rendered_path: str | None = None
    gate: GateResult | None = None
    timings_s: dict[str, float] = field(default_factory=dict)
    record: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.outcome in ("succeeded", "dry_run")


@dataclass(frozen=True)
class Prepared:
    """A validated rollout, before anything changes: the rendered config and what the cluster runs now."""

    target: Target
    rendered: Rendered
    address: str
    details: dict[str, Any]
    previous: dict[str, Any] | None
    previous_hash: str | None
    update: str
    base_url: str

    @property
    def cfg(self) -> HeadroomConfig:
        return self.target.cfg


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def prepare(
    env: str | None,
    address: str | None,
    *,
    config_files: Sequence[str | Path] | None = None,
    config_dir: str | Path = DEFAULT_CONFIG_DIR,
    connect: Callable[[str], ClusterAPI] = ServeCluster,
) -> tuple[Prepared, ClusterAPI]:
    """Every check before a deploy. First those that need no network (config, address, a CPU plan), then
    the cluster is read (reachable? a GPU plan on its nodes; an app in the way?); nothing is changed."""
    target = load_target(env, config_files, config_dir)
    cfg = target.cfg
    given, source = (address, "--address") if address else default_address()
    url = dashboard_url(given, source)
    rendered = render_target(target, planning_cluster(cfg)) if cfg.resources.accelerator == "cpu" else None
    api = connect(url)
    if rendered is None:
        rendered = render_target(target, planning_cluster(cfg, live_gpus_per_node=api.gpus_per_node()))
    details = api.details()
    check_conflicts(details, rendered.app)
    previous = live_app_config(details, cfg.name)
    prepared = Prepared(
        target=target,
        rendered=rendered,
        address=url,
        details=details,
        previous=previous,
        previous_hash=app_meta(previous).get("config_hash"),
        update=update_kind(previous, rendered.app),
        base_url=serve_base_url(details, url, cfg.route_prefix),
    )
    return prepared, api


def describe(prep: Prepared) -> list[str]:
    running = prep.previous_hash or (
        "nothing" if prep.previous is None else "a config headroom did not render"
    )
    return [
        f"rollout {prep.target.label}: app {prep.cfg.name!r}, config {prep.rendered.config_hash} "
        f"on {prep.address}",
        f"  now running: {running}",
        f"  update:      {prep.update}",
        f"  rolling:     {prep.rendered.surge_note}",
    ]


def dry_run_lines(
    prep: Prepared, state: Path, smoke: SmokeOptions | None, ready_timeout_s: float
) -> list[str]:
    """What a rollout would do, and how the new config differs from the one the cluster runs (pure)."""
    cfg, url, base_url = prep.cfg, prep.address, prep.base_url
    steps = [
        f"write the rendered config to {env_dir(state, prep.target.label)}/"
        f"<time>-{prep.rendered.config_hash}.yaml",
        f"PUT it to {url}/api/serve/applications/ (Serve's declarative deploy, as `serve deploy` does), "
        "keeping the cluster's other declarative apps",
        f"wait up to {ready_timeout_s:.0f} s for {cfg.name!r} to run it and {base_url}/v1/models to answer",
    ]
    if smoke is not None:
        slo = cfg.slo
        steps.append(
            f"smoke load: {smoke.users} user(s) for {smoke.duration_s:g} s against {base_url}; pass if "
            f"TTFT p95 <= {slo.ttft_p95_ms:g} ms, TPOT p50 <= {slo.tpot_p50_ms:g} ms, errors <= "
            f"{slo.max_error_rate:.1%}"
        )
    if prep.previous is None:
        steps.append("on failure: remove the app (nothing ran before)")
    else:
        steps.append(
            "on failure: redeploy the config running now "
            f"({prep.previous_hash or 'not rendered by headroom'})"
        )
    lines = ["dry run: nothing deployed, nothing written. It would:"]
    lines += [f"  {i}. {step}" for i, step in enumerate(steps, 1)]
    if prep.previous is not None:
        live_cfg = (prep.previous.get("args") or {}).get("config")
        changes = (
            field_changes("config", live_cfg, cfg.model_dump(mode="json"))
            if isinstance(live_cfg, Mapping)
            else []
        )
        changes += field_changes(
            "serve",
            {DEPLOYMENT_NAME: _deployment_entry(prep.previous)},
            {DEPLOYMENT_NAME: _deployment_entry(prep.rendered.app)},
        )
        lines.append(format_changes(changes, "running", "new"))
    return lines


def rollout(
    env: str | None = None,
    address: str | None = None,
    dry_run: bool = False,
    *,
    config_files: Sequence[str | Path] | None = None,
    config_dir: str | Path = DEFAULT_CONFIG_DIR,
    state: str | Path | None = None,
    smoke: SmokeOptions | None = SmokeOptions(),
    ready_timeout_s: float = 900.0,
    poll_s: float = 2.0,
    connect: Callable[[str], ClusterAPI] = ServeCluster,
    smoke_runner: SmokeRunner | None = None,
    say: Callable[[str], None] = _stderr,
    now: Callable[[], datetime] = lambda: datetime.now(timezone.utc),
) -> RolloutResult:
    """Validate, plan, render, deploy through Serve's REST API, wait until ready, smoke-test against the
    config's SLO, and keep the new version or roll back to the one that ran before.

    Bad inputs (unknown env, unknown key, plan that does not fit, malformed address) raise ConfigError or
    RolloutError before any network call; an unreachable cluster or an app in the way raise before any
    deploy (see prepare). smoke=None gates on readiness alone; otherwise smoke_runner runs the load.
    dry_run reads the cluster, says what would happen, and deploys and writes nothing.
    """
    prep, api = prepare(env, address, config_files=config_files, config_dir=config_dir, connect=connect)
    for line in describe(prep):
        say(line)
    state_path = state_dir(state)
    if dry_run:
        for line in dry_run_lines(prep, state_path, smoke, ready_timeout_s):
            say(line)
        r = prep.rendered
        return RolloutResult(
            "dry_run",
            prep.target.label,
            prep.cfg.name,
            r.config_hash,
            prep.previous_hash,
            prep.update,
            "dry run: nothing changed",
        )
    if smoke is not None and smoke_runner is None:
        raise ValueError(
            "rollout(smoke=...) needs smoke_runner (the CLI passes loadtests.smoke.run_smoke_load)"
        )
    return _execute(prep, api, state_path, smoke, ready_timeout_s, poll_s, smoke_runner, say, now())


def _execute(
    prep: Prepared,
    api: ClusterAPI,
    state: Path,
    smoke: SmokeOptions | None,
    ready_timeout_s: float,
    poll_s: float,
    smoke_runner: SmokeRunner | None,
    say: Callable[[str], None],
    started: datetime,
) -> RolloutResult:
    cfg, rendered, label = prep.cfg, prep.rendered, prep.target.label
    directory = env_dir(state, label)
    directory.mkdir(parents=True, exist_ok=True)
    stem = f"{stamp(started)}-{rendered.config_hash}"
    rendered_path = directory / f"{stem}.yaml"
    rendered_path.write_text(rendered.to_yaml(started.isoformat(timespec="seconds")), encoding="utf-8")
    say(f"  rendered:    {rendered_path}")
    previous_rendered = _previous_rendered(state, label, prep.previous_hash)
    timings: dict[str, float] = {}
    t0 = time.monotonic()

    def finish(outcome: str, message: str, result_gate: GateResult | None = None) -> RolloutResult:
        timings["total_s"] = round(time.monotonic() - t0, 1)
        record = history_record(
            prep, started, outcome, message, rendered_path, previous_rendered, result_gate, timings
        )
        append_history(state, label, record)
        say(f"{outcome}: {message}")
        return RolloutResult(
            outcome,
            label,
            cfg.name,
            rendered.config_hash,
            prep.previous_hash,
            prep.update,
            message,
            str(rendered_path),
            result_gate,
            dict(timings),
            record,
        )

    try:
        api.deploy(deploy_body(prep.details, rendered.app, cfg.name))
    except RolloutError as err:
        return finish("failed", f"the deploy request was refused, nothing changed: {err}")
    timings["deploy_request_s"] = round(time.monotonic() - t0, 1)

    t = time.monotonic()
    health = _wait_ready(
        api,
        cfg.name,
        rendered.config_hash,
        prep.base_url,
        cfg.served_model_name,
        ready_timeout_s,
        poll_s,
        say,
    )
    timings["ready_s"] = round(time.monotonic() - t, 1)
    result_gate: GateResult | None = None
    failure = None if health.phase == "ready" else health.message
    if failure is None and smoke is not None:
        t = time.monotonic()
        result_gate, failure = _smoke_gate(prep, smoke, directory / f"{stem}.smoke.jsonl", smoke_runner, say)
        timings["smoke_s"] = round(time.monotonic() - t, 1)
    if failure is None:
        return finish("succeeded", f"{cfg.name} runs config {rendered.config_hash}", result_gate)

    say(f"  failed:      {failure}")
    if prep.previous is not None and prep.previous_hash == rendered.config_hash:
        return finish(
            "failed",
            f"{failure}; the version before was this same config: nothing to roll back to",
            result_gate,
        )
    what = (
        f"config {prep.previous_hash or '(not rendered by headroom)'}"
        if prep.previous
        else "no app (removed)"
    )
    say(f"  rolling back to {what}")
    t = time.monotonic()
    back = _roll_back(prep, api, ready_timeout_s, poll_s, say)
    timings["rollback_s"] = round(time.monotonic() - t, 1)
    if back.phase == "ready":
        return finish("rolled_back", f"{failure}; rolled back to {what}", result_gate)
    return finish("rollback_failed", f"{failure}; rolling back to {what} failed: {back.message}", result_gate)


def _smoke_gate(
    prep: Prepared,
    smoke: SmokeOptions,
    raw_file: Path,
    smoke_runner: SmokeRunner,
    say: Callable[[str], None],
) -> tuple[GateResult, str | None]:
    cfg = prep.cfg
    say(
        f"  smoke load:  {smoke.users} user(s), {smoke.duration_s:g} s, {smoke.max_tokens} tokens, "
        f"{prep.base_url}"
    )
    failure = None
    try:
        summary = smoke_runner(prep.base_url, cfg.served_model_name, raw_file, smoke)
    except RolloutError as err:
        summary, failure = {"requests": 0, "ok": 0}, str(err)
    result = gate(summary, cfg.slo)
    n = result.numbers
    say(
        f"  smoke:       {n['ok']}/{n['requests']} ok, TTFT p95 {n['ttft_p95_ms']} ms, TPOT p50 "
        f"{n['tpot_p50_ms']} ms, error rate {n['error_rate']}"
    )
    if failure is None and not result.passed:
        failure = "smoke gate failed: " + "; ".join(result.reasons)
    return result, failure


def _roll_back(
    prep: Prepared, api: ClusterAPI, ready_timeout_s: float, poll_s: float, say: Callable[[str], None]
) -> AppHealth:
    """Redeploys the app config that ran before (as the cluster reported it), or removes a new app."""
    name, previous = prep.cfg.name, prep.previous
    try:
        api.deploy(deploy_body(api.details(), previous, name))
        if previous is None:
            return _wait_ready(
                api, name, None, prep.base_url, None, ready_timeout_s, poll_s, say, absent=True
            )
        base_url = serve_base_url(prep.details, prep.address, str(previous.get("route_prefix") or "/"))
        return _wait_ready(
            api, name, prep.previous_hash, base_url, _served_name(previous), ready_timeout_s, poll_s, say
        )
    except RolloutError as err:
        return AppHealth("failed", str(err))


def history_record(
    prep: Prepared,
    started: datetime,
    outcome: str,
    message: str,
    rendered_path: Path,
    previous_rendered: str | None,
    result_gate: GateResult | None,
    timings: Mapping[str, float],
) -> dict[str, Any]:
    """One line of history.jsonl (pure)."""
    return {
        "time": started.isoformat(timespec="seconds"),
        "env": prep.target.label,
        "app": prep.cfg.name,
        "outcome": outcome,
        "message": message,
        "config_hash": prep.rendered.config_hash,
        "previous_hash": prep.previous_hash,
        "update": prep.update,
        "address": prep.address,
        "sources": list(prep.target.sources),
        "rendered": str(rendered_path),
        "previous_rendered": previous_rendered,
        "plan": {k: v for k, v in prep.rendered.plan_facts().items() if k != "bundles"},
        "slo": prep.cfg.slo.model_dump(mode="json"),
        "smoke": result_gate.numbers if result_gate else None,
        "gate_reasons": list(result_gate.reasons) if result_gate else [],
        "timings_s": dict(timings),
    }


def _served_name(app_config: Mapping[str, Any] | None) -> str | None:
    live_cfg = ((app_config or {}).get("args") or {}).get("config")
    if not isinstance(live_cfg, Mapping):
        return None
    model = live_cfg.get("model") or {}
    return model.get("served_name") if isinstance(model, Mapping) else None


def _previous_rendered(state: Path, label: str, previous_hash: str | None) -> str | None:
    if previous_hash is None:
        return None
    for record in reversed(read_history(state, label)):
        if record.get("config_hash") == previous_hash and record.get("rendered"):
            return str(record["rendered"])
    return None


def _wait_ready(
    api: ClusterAPI,
    name: str,
    config_hash: str | None,
    base_url: str,
    model: str | None,
    timeout_s: float,
    poll_s: float,
    say: Callable[[str], None],
    absent: bool = False,
) -> AppHealth:
    """Polls until assess_app says ready (and, for a live app, /v1/models answers), failed, or timeout."""
    deadline = time.monotonic() + timeout_s
    last = ""
    while True:
        try:
            health = assess_app(api.details(), name, config_hash, absent=absent)
        except RolloutError as err:  # the dashboard can blip while Serve works; keep polling to the deadline
            health = AppHealth("waiting", str(err))
        if health.phase == "ready" and not absent:
            problem = api.probe(base_url, model)
            if problem is not None:
                health = AppHealth("waiting", f"Serve reports RUNNING; {problem}")
        if health.phase == "failed":
            return health
        if health.phase == "ready":
            say(f"  ready:       {health.message}")
            return health
        if health.message != last:
            say(f"  waiting:     {health.message}")
            last = health.message
        if time.monotonic() >= deadline:
            return AppHealth("failed", f"not ready after {timeout_s:.0f} s: {health.message}")
        time.sleep(poll_s)


# --------------------------------------------------------------------------------------------------------
# status
# --------------------------------------------------------------------------------------------------------


def summarize_apps(details: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Applications, their deployments and replica states, and the config each runs (pure)."""
    out = []
    for name, app in sorted((details.get("applications") or {}).items()):
        meta = app_meta(app.get("deployed_app_config"))
        deployments = []
        for dep_name, dep in sorted((app.get("deployments") or {}).items()):
            deployments.append(
                {
                    "name": dep_name,
                    "status": dep.get("status"),
                    "target_replicas": dep.get("target_num_replicas"),
                    "replicas": replica_counts(dep),
                    "message": (dep.get("message") or "").strip(),
                }
            )
        out.append(
            {
                "name": name,
                "status": app.get("status"),
                "message": (app.get("message") or "").strip(),
                "route_prefix": app.get("route_prefix"),
                "source": app.get("source"),
                "env": meta.get("env"),
                "config_hash": meta.get("config_hash"),
                "tensor_parallel_size": meta.get("tensor_parallel_size"),
                "max_num_seqs": meta.get("max_num_seqs"),
                "last_deployed_time_s": app.get("last_deployed_time_s"),
                "deployments": deployments,
            }
        )
    return out


def status(
    address: str | None = None,
    state: str | Path | None = None,
    connect: Callable[[str], ClusterAPI] = ServeCluster,
) -> dict[str, Any]:
    """The cluster's applications and replicas, and the last rollout of every environment."""
    given, source = (address, "--address") if address else default_address()
    url = dashboard_url(given, source)
    api = connect(url)
    return {
        "address": url,
        "applications": summarize_apps(api.details()),
        "last_rollouts": last_rollouts(state_dir(state)),
    }


def format_status(st: Mapping[str, Any]) -> str:
    lines = [f"Serve on {st['address']}:"]
    apps = st.get("applications") or []
    if not apps:
        lines.append("  no applications")
    for app in apps:
        version = (
            f"config {app['config_hash']} (env {app['env']})"
            if app.get("config_hash")
            else "not rendered by headroom"
        )
        lines.append(f"  {app['name']} at {app['route_prefix']}: {app['status']}, {version}, {app['source']}")
        if app.get("tensor_parallel_size") is not None:
            lines.append(f"    plan: TP {app['tensor_parallel_size']}, max_num_seqs {app['max_num_seqs']}")
        if app.get("message"):
            lines.append(f"    message: {app['message']}")
        for dep in app["deployments"]:
            lines.append(
                f"    {dep['name']}: {dep['status']}, target {dep['target_replicas']} replica(s), "
                f"{_counts_text(dep['replicas'])}"
            )
    rollouts = st.get("last_rollouts") or {}
    lines.append(
        "Last rollout per environment:" if rollouts else "No rollouts recorded in the state directory."
    )
    for label, record in sorted(rollouts.items()):
        smoke = record.get("smoke") or {}
        numbers = (
            f", TTFT p95 {smoke.get('ttft_p95_ms')} ms, TPOT p50 {smoke.get('tpot_p50_ms')} ms, "
            f"errors {smoke.get('error_rate')}"
            if smoke
            else ""
        )
        lines.append(
            f"  {label}: {record.get('outcome')} at {record.get('time')}, config {record.get('config_hash')} "
            f"(was {record.get('previous_hash')}) on {record.get('address')}{numbers}"
        )
    return "\n".join(lines)
