"""`headroom render | diff | rollout | status`: config-driven rollouts on Ray Serve (serve_app/rollout/).

serve_app/cli/commands.py adds them to the `headroom` app with `register(app)`. Bad input (config, address, a
plan that does not fit, an unreachable cluster, a missing or rejected Ray token) prints `error: ...` and exits
2 before anything is deployed; a rollout that deployed but failed (rolled back, or the rollback failed)
exits 1.
"""

from __future__ import annotations

import json
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Annotated, Any

import typer

from loadtests.smoke import run_smoke_load
from serve_app.cli.common import fail
from serve_app.config import ConfigError
from serve_app.planning.from_config import planning_cluster
from serve_app.rollout import (
    DEFAULT_DASHBOARD_ADDRESS,
    STATE_DIR_ENV,
    RolloutError,
    ServeCluster,
    SmokeOptions,
    Target,
    dashboard_url,
    diff_rendered,
    format_changes,
    format_status,
    load_target,
    render_target,
    rollout,
    status,
)

EnvOption = Annotated[
    str | None, typer.Option("--env", "-e", help="Environment: configs/base.yaml + configs/<env>.yaml.")
]
ConfigOption = Annotated[
    list[Path] | None,
    typer.Option("--config", "-c", help="Config file(s), merged in order (instead of --env)."),
]
AddressOption = Annotated[
    str | None,
    typer.Option(
        "--address",
        "-a",
        help=(
            f"The Ray dashboard's HTTP address; default $RAY_ADDRESS, else {DEFAULT_DASHBOARD_ADDRESS}. "
            "A cluster with Ray token authentication needs RAY_AUTH_MODE=token and its token in "
            "$RAY_AUTH_TOKEN, a file named by $RAY_AUTH_TOKEN_PATH, or ~/.ray/auth_token."
        ),
        show_default=False,
    ),
]
PlanAddressOption = Annotated[
    str | None,
    typer.Option(
        "--address",
        "-a",
        help="Plan GPU configs on this live cluster (dashboard HTTP address) instead of --gpus/--nodes.",
        show_default=False,
    ),
]
GpusOption = Annotated[
    int | None, typer.Option("--gpus", min=1, max=16, help="GPUs per node to plan for (GPU configs).")
]
NodesOption = Annotated[
    int, typer.Option("--nodes", min=1, max=4096, help="Nodes to plan for (GPU configs).")
]
GpuMemoryOption = Annotated[
    float | None,
    typer.Option(
        "--gpu-memory-gib", min=1, max=1024, help="GPU memory as torch reports it; default the GPU's."
    ),
]
StateOption = Annotated[
    Path | None,
    typer.Option(
        "--state-dir",
        help=f"Where rendered configs and history are kept; default ${STATE_DIR_ENV} or ./.headroom.",
    ),
]
JsonOption = Annotated[bool, typer.Option("--json", help="Print JSON.")]


def _live_gpus(address: str | None, targets: list[Target]) -> list[int] | None:
    """GPUs per node of the cluster at --address, read only when a GPU config is to be planned."""
    if not address or all(t.cfg.resources.accelerator == "cpu" for t in targets):
        return None
    return ServeCluster(dashboard_url(address)).gpus_per_node()


def render_command(
    env: EnvOption = None,
    config: ConfigOption = None,
    out: Annotated[
        Path | None, typer.Option("--out", "-o", help="Write the Serve config here (default: stdout).")
    ] = None,
    gpus: GpusOption = None,
    nodes: NodesOption = 1,
    gpu_memory_gib: GpuMemoryOption = None,
    address: PlanAddressOption = None,
) -> None:
    """Render the Ray Serve config (the file `serve deploy` reads) for an environment, from its merged
    config and the plan; refused when the plan does not fit."""
    try:
        target = load_target(env, config)
        live = _live_gpus(address, [target])
        rendered = render_target(target, planning_cluster(target.cfg, gpus, nodes, gpu_memory_gib, live))
    except (ConfigError, RolloutError) as e:
        fail(e)
    text = rendered.to_yaml(datetime.now(timezone.utc).isoformat(timespec="seconds"))
    if out is None:
        sys.stdout.write(text)
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text, encoding="utf-8")
    print(
        f"wrote {out} (config {rendered.config_hash}; deploy it with `serve deploy {out}`)", file=sys.stderr
    )


def diff_command(
    env: Annotated[
        list[str], typer.Option("--env", "-e", help="Two environments: --env staging --env prod.")
    ],
    gpus: GpusOption = None,
    nodes: NodesOption = 1,
    gpu_memory_gib: GpuMemoryOption = None,
    address: PlanAddressOption = None,
    as_json: JsonOption = False,
) -> None:
    """Show what differs between two environments, field by field: the merged config, the plan's
    consequences (replicas, TP size, max_num_seqs, KV tokens) and the Serve deployment options."""
    if len(env) != 2:
        fail(RolloutError(f"give exactly two environments (--env A --env B), got {len(env)}"))
    try:
        targets = [load_target(name) for name in env]
        live = _live_gpus(address, targets)
        rendered = [
            render_target(t, planning_cluster(t.cfg, gpus, nodes, gpu_memory_gib, live)) for t in targets
        ]
    except (ConfigError, RolloutError) as e:
        fail(e)
    changes = diff_rendered(rendered[0], rendered[1])
    if as_json:
        rows = [
            {"section": c.section, "path": c.path, env[0]: _jsonable(c.before), env[1]: _jsonable(c.after)}
            for c in changes
        ]
        print(json.dumps(rows, indent=2))
    else:
        print(format_changes(changes, env[0], env[1]))


def _jsonable(value: Any) -> Any:
    try:
        json.dumps(value)
    except TypeError:
        return "(unset)"
    return value


def rollout_command(
    env: EnvOption = None,
    config: ConfigOption = None,
    address: AddressOption = None,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Check everything and say what would happen; change nothing.")
    ] = False,
    state_dir: StateOption = None,
    timeout_s: Annotated[
        float,
        typer.Option("--timeout-s", min=10, help="Seconds to wait for the new version (and a rollback)."),
    ] = 900,
    smoke_users: Annotated[
        int, typer.Option("--smoke-users", min=1, help="Smoke load: concurrent users.")
    ] = 2,
    smoke_duration_s: Annotated[
        float, typer.Option("--smoke-duration-s", min=1, help="Smoke load: seconds.")
    ] = 10,
    smoke_max_tokens: Annotated[
        int, typer.Option("--smoke-max-tokens", min=1, help="Smoke load: output tokens per request.")
    ] = 32,
    no_smoke: Annotated[
        bool, typer.Option("--no-smoke", help="Gate on readiness alone (no smoke load).")
    ] = False,
    as_json: JsonOption = False,
) -> None:
    """Validate, plan, render, deploy (Serve's declarative REST API, as `serve deploy`), wait until
    healthy, run a smoke load gated on the config's SLO, and roll back automatically on failure."""
    smoke = None if no_smoke else SmokeOptions(smoke_users, smoke_duration_s, smoke_max_tokens)
    try:
        result = rollout(
            env,
            address,
            dry_run,
            config_files=config,
            state=state_dir,
            smoke=smoke,
            ready_timeout_s=timeout_s,
            smoke_runner=run_smoke_load,
        )
    except (ConfigError, RolloutError) as e:
        fail(e)
    if as_json:
        print(json.dumps(result.record or {"outcome": result.outcome, "message": result.message}, indent=2))
    if not result.ok:
        raise typer.Exit(1)


def status_command(
    address: AddressOption = None, state_dir: StateOption = None, as_json: JsonOption = False
) -> None:
    """Show the cluster's applications, replicas and the config each runs, and the last rollout per
    environment."""
    try:
        st = status(address, state_dir)
    except (ConfigError, RolloutError) as e:
        fail(e)
    print(json.dumps(st, indent=2) if as_json else format_status(st))


def register(app: typer.Typer) -> None:
    """Adds render, diff, rollout and status to the `headroom` Typer app."""
    app.command("render")(render_command)
    app.command("diff")(diff_command)
    app.command("rollout")(rollout_command)
    app.command("status")(status_command)
