"""What differs between two rendered deployments, field by field (pure): the merged config, the plan's
consequences and the Serve deployment options; `headroom diff` and `rollout --dry-run` show it."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from serve_app.config import DEFAULT_CONFIG_DIR
from serve_app.planning.from_config import planning_cluster
from serve_app.rollout.rendering import (
    DEPLOYMENT_NAME,
    Rendered,
    deployment_entry,
    load_target,
    render_target,
)

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


def diff_rendered(a: Rendered, b: Rendered) -> list[FieldChange]:
    """Config fields, then the plan's consequences, then the Serve deployment options that differ."""
    changes = field_changes(
        "config", a.target.cfg.model_dump(mode="json"), b.target.cfg.model_dump(mode="json")
    )
    changes += field_changes("plan", a.plan_facts(), b.plan_facts())
    changes += field_changes("serve", _serve_view(a.app), _serve_view(b.app))
    return changes


def _serve_view(app: Mapping[str, Any]) -> dict[str, Any]:
    return {"name": app["name"], "route_prefix": app["route_prefix"], DEPLOYMENT_NAME: deployment_entry(app)}


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
    """The changes by section, as `headroom diff` prints them."""
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
