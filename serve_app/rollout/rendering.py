"""From a config to the Ray Serve config that `serve deploy` and `headroom rollout` send (pure, apart from
reading a local model's config.json and checking the result with Ray Serve's own schema).

A rendered file is a Ray Serve config (``ServeDeploySchema``) with one application per config. Its ``args``
carry the merged, validated headroom config inline (``args.config``, a mapping) plus ``args.headroom``
(env, config hash, planned TP size and max_num_seqs), so that:
- the file is self-contained: `serve deploy` from any machine works, the cluster needs no copy of configs/;
- Serve's code version (a hash of import_path, runtime_env and args) changes exactly when the merged config
  or the plan's engine settings change, so an engine change rolls the replicas over with Serve's rolling
  update, and redeploying the same config changes nothing;
- the live cluster reports which config it runs (`status`, and `rollout --dry-run` diffs against it).
"""

from __future__ import annotations

import hashlib
import json
import math
import textwrap
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from serve_app.config import DEFAULT_CONFIG_DIR, HeadroomConfig, load_config_files, load_env_config
from serve_app.planning.from_config import describe_cluster, plan_config, planning_cluster, require_fit
from serve_app.planning.placement import ClusterSpec, Plan
from serve_app.rollout.errors import RolloutError
from serve_app.serving.serve_options import deployment_options

IMPORT_PATH = "serve_app.app:build_app"
DEPLOYMENT_NAME = "LLMServer"
HASH_CHARS = 12


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


def deployment_entry(app: Mapping[str, Any]) -> dict[str, Any]:
    """The LLM deployment's options in a Serve app config, without its name ({} when absent)."""
    for dep in app.get("deployments") or []:
        if dep.get("name") == DEPLOYMENT_NAME:
            return {k: v for k, v in dep.items() if k != "name"}
    return {}


def config_hash(cfg: HeadroomConfig) -> str:
    """A short sha256 of the merged config (canonical JSON): the same config always has the same hash."""
    text = json.dumps(cfg.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:HASH_CHARS]


def target_replicas(cfg: HeadroomConfig) -> int:
    """The replicas a deployment runs at most: max_replicas when autoscaled, else num_replicas."""
    auto = cfg.deployment.autoscaling
    return auto.max_replicas if auto is not None else (cfg.deployment.num_replicas or 1)


def rolling_surge(cfg: HeadroomConfig, plan: Plan) -> tuple[int, str]:
    """Serve's max_surge_percent for an in-place update, and what it means.

    With a surge, Serve starts a replacement before it stops an old replica, so capacity never drops during
    a rolling update; without room for an extra replica it stops one first (Serve's default). On GPUs the
    room is what the plan says fits beyond the deployment's target (max_replicas when autoscaled); a CPU
    replica gets one extra at a time. The percent is rounded down so Serve's ceiling stays within the room.
    """
    target = target_replicas(cfg)
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
                deployment_entry(self.app).get("max_surge_percent", 0)
                * target_replicas(self.target.cfg)
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
