"""`headroom status`: the cluster's applications, replicas and the config each runs, and the last rollout of
every environment (the state directory's history)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from serve_app.rollout.dashboard import ClusterAPI, ServeCluster, dashboard_url, default_address
from serve_app.rollout.history import last_rollouts, state_dir
from serve_app.rollout.serve_state import app_meta, counts_text, replica_counts


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
    """status() as `headroom status` prints it."""
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
                f"{counts_text(dep['replicas'])}"
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
