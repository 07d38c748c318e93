"""Ray Serve's state as data (pure): what a cluster runs, what a deploy would change, whether an app is ready.

Every function reads the dict Serve's REST API returns (GET /api/serve/applications/, `ServeCluster.details`)
or builds the body it accepts (PUT, as `serve deploy` sends); none talks to the cluster.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from serve_app.rollout.errors import RolloutError
from serve_app.rollout.rendering import deployment_entry


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

    same_options = deployment_entry(previous) == deployment_entry(new)
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
                f"deployment {dep_name} is {dep_status}, replicas {counts_text(counts)} (target {target})",
            )
    shown = f"config {running}" if running else "its config"
    return AppHealth("ready", f"application {name!r} is RUNNING {shown}")


def replica_counts(deployment: Mapping[str, Any]) -> dict[str, int]:
    """How many of a deployment's replicas are in each state."""
    counts: dict[str, int] = {}
    for replica in deployment.get("replicas") or []:
        state = str(replica.get("state"))
        counts[state] = counts.get(state, 0) + 1
    return counts


def counts_text(counts: Mapping[str, int]) -> str:
    """Replica counts as text: `1 RUNNING, 1 STARTING`, or `none`."""
    return ", ".join(f"{n} {s}" for s, n in sorted(counts.items())) or "none"


def served_name(app_config: Mapping[str, Any] | None) -> str | None:
    """The model name an app config serves (None for an app headroom did not render)."""
    live_cfg = ((app_config or {}).get("args") or {}).get("config")
    if not isinstance(live_cfg, Mapping):
        return None
    model = live_cfg.get("model") or {}
    return model.get("served_name") if isinstance(model, Mapping) else None
