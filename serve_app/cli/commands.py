"""The `headroom` command line."""

from __future__ import annotations

import os
import shlex
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from serve_app.cli import ladder_options as lo
from serve_app.cli.common import err, fail, out
from serve_app.cli.rollout_commands import register as register_rollout_commands
from serve_app.config import ConfigError, HeadroomConfig, available_envs, load_config_files, load_env_config

if TYPE_CHECKING:
    from serve_app.planning.request import ClusterSpec
    from serve_app.planning.result import Plan

app = typer.Typer(no_args_is_help=True, add_completion=False, help="Deploy vLLM on Ray Serve, within budget.")
model_app = typer.Typer(no_args_is_help=True, help="The embedded models headroom generates itself.")
app.add_typer(model_app, name="model")

EnvOption = Annotated[
    str | None, typer.Option("--env", "-e", help="Environment: configs/base.yaml + configs/<env>.yaml.")
]
ConfigFilesArgument = Annotated[
    list[Path] | None,
    typer.Argument(
        help="Config file(s); a file next to a base.yaml is merged on top of it.", show_default=False
    ),
]
ConfigOption = Annotated[
    list[Path] | None, typer.Option("--config", "-c", help="Config file(s), merged in order.")
]


def _load(env: str | None, config: list[Path] | None) -> HeadroomConfig:
    if env and config:
        raise typer.BadParameter("give --env or --config, not both", param_hint="--env/--config")
    if config:
        return load_config_files(*config)
    return load_env_config(env or "local")


@app.command()
def validate(env: EnvOption = None, config: ConfigOption = None) -> None:
    """Validate a config (schema, model files, draft-model compatibility) and print the merged result."""
    from serve_app.models.resolve import resolve_models

    try:
        cfg = _load(env, config)
        resolve_models(cfg)
    except ConfigError as e:
        fail(e)
    out.print_json(cfg.model_dump_json())


GpusOption = Annotated[
    int | None, typer.Option("--gpus", min=1, max=16, help="GPUs per node to plan for (default 1).")
]
NodesOption = Annotated[int, typer.Option("--nodes", min=1, max=4096, help="Nodes to plan for.")]
GpuMemoryOption = Annotated[
    float | None,
    typer.Option(
        "--gpu-memory-gib",
        min=1,
        max=1024,
        help="GPU memory as torch reports it; default the config's, else the GPU type's.",
    ),
]


@app.command("engine-args")
def engine_args(
    env: EnvOption = None,
    config: ConfigOption = None,
    gpus: GpusOption = None,
    nodes: NodesOption = 1,
    gpu_memory_gib: GpuMemoryOption = None,
) -> None:
    """Print the `vllm serve` flags each replica's engine gets, plan included, for a config planned on
    --nodes x --gpus (a note on stderr says which flags the plan set); exit 1 when it does not fit."""
    from serve_app.models.resolve import resolve_models
    from serve_app.planning.from_config import cluster_spec
    from serve_app.serving.engine_args import plan_engine, vllm_cli_args

    try:
        cfg = _load(env, config)
        models = resolve_models(cfg)
        cluster = cluster_spec(cfg, nodes=nodes, gpus_per_node=gpus, gpu_memory_gib=gpu_memory_gib)
        result, planned = plan_engine(cfg, models, cluster)
    except ConfigError as e:
        fail(e)
    if not result.fits:
        typer.echo("\n".join(f"error: {reason}" for reason in result.reasons), err=True)
        raise typer.Exit(1)
    typer.echo(_plan_note(cfg, cluster, result), err=True)
    print(shlex.join(vllm_cli_args(cfg, models, planned)))


def _plan_note(cfg: HeadroomConfig, cluster: ClusterSpec, result: Plan) -> str:
    """Which flags the plan set, and for which cluster: a replica on another cluster is planned again."""
    from serve_app.planning.from_config import describe_cluster

    on_gpu = cfg.resources.accelerator == "gpu"
    from_plan = [f"--max-num-seqs {result.max_num_seqs} (config: {cfg.engine.max_num_seqs})"]
    if on_gpu:
        from_plan.insert(0, f"--tensor-parallel-size {result.tensor_parallel_size}")
    return (
        f"# planned for {describe_cluster(cfg, cluster)}; from the plan: {', '.join(from_plan)}; "
        f"{result.max_num_seqs_without_preemption} sequences fit without preemption at max_model_len "
        f"{result.max_model_len:,}."
        + (" Deploying plans again for the live cluster's GPUs per node." if on_gpu else "")
    )


@app.command()
def plan(
    config_files: ConfigFilesArgument = None,
    env: EnvOption = None,
    gpus: GpusOption = None,
    nodes: NodesOption = 1,
    gpu_memory_gib: GpuMemoryOption = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the plan as JSON.")] = False,
) -> None:
    """Plan a config: TP size, replicas, placement bundles, KV-cache tokens and safe concurrency; exit 1
    when it does not fit."""
    import json

    from serve_app.planning.from_config import cluster_spec, plan_config
    from serve_app.planning.result import render_plan_table

    try:
        cfg = _load(env, config_files)
        result = plan_config(
            cfg, cluster_spec(cfg, nodes=nodes, gpus_per_node=gpus, gpu_memory_gib=gpu_memory_gib)
        )
    except ConfigError as e:
        fail(e)
    if as_json:
        print(json.dumps(result.to_json(), indent=2))
    else:
        print(render_plan_table(result))
    if not result.fits:
        raise typer.Exit(1)


@app.command()
def serve(
    env: EnvOption = None,
    config: ConfigOption = None,
    address: Annotated[
        str | None, typer.Option(help="Ray cluster address; default $RAY_ADDRESS, else a local cluster.")
    ] = None,
    blocking: Annotated[bool, typer.Option(help="Keep running until Ctrl-C, then shut the app down.")] = True,
) -> None:
    """Deploy a config on Ray Serve (same as `serve run serve_app.app:build_app env=...`)."""
    from serve_app.serving.driver import init_ray_driver
    from serve_app.serving.serve_options import apply_cluster_env

    # Before Ray Serve is imported: it reads its settings then, and this process checks some of them (an
    # app with a prefix router needs HAProxy ingress). A local cluster starts from this environment too.
    apply_cluster_env(os.environ)
    try:
        cfg = _load(env, config)
        from serve_app.serving.deployment import build_from_config

        application = build_from_config(cfg)
    except ConfigError as e:
        fail(e)
    import ray
    from ray import serve as ray_serve

    address = address or os.environ.get("RAY_ADDRESS")
    init_ray_driver(address=address, ignore_reinit_error=True)
    ports = sorted({n["MetricsExportPort"] for n in ray.nodes() if n["Alive"]})
    err.print(
        f"deploying [bold]{cfg.name}[/bold] ({cfg.served_model_name}); the engine takes a minute or more to "
        f"start. OpenAI API: http://localhost:8000{cfg.route_prefix.rstrip('/')}/v1  "
        f"Prometheus metrics: Ray's metrics export port(s) {ports}"
    )
    # Ctrl-C shuts the app down so the replicas stop their engines; SIGTERM is Ray's: it drains the
    # local node and stops its processes.
    ray_serve.run(application, name=cfg.name, route_prefix=cfg.route_prefix)
    if not blocking:
        return
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        err.print("shutting down: stopping the replicas and their engines")
        ray_serve.shutdown()


@app.command()
def ladder(
    config_files: ConfigFilesArgument = None,
    env: EnvOption = None,
    profiles: lo.Profiles = None,
    ttft_slo_ms: lo.TtftSlo = None,
    steps: lo.Steps = "1:20,4:20,16:20",
    max_steps: lo.MaxSteps = 6,
    max_tokens: lo.MaxTokens = 64,
    seed: lo.Seed = 0,
    repeats: lo.Repeats = 3,
    features: lo.Features = None,
    part: lo.Part = None,
    only: lo.Only = None,
    merge: lo.Merge = None,
    url: lo.Url = None,
    out: lo.Out = Path("results/ladder"),
    app_name: lo.AppName = "ladder",
    http_port: lo.HttpPort = None,
) -> None:
    """The seeds' tuning procedure: a fixed workload and concurrency steps, the baseline, then prefix
    caching, chunked prefill and speculative decoding switched on in turn, each setting on fresh engines
    several times; keeps what beats the noise and writes a report. Stops what it started, also on Ctrl-C."""
    from loadtests import ladder_report
    from loadtests.ladder import LadderOptions, run_ladder

    # SIGTERM unwinds like Ctrl-C, so the app, Serve and Ray this command started are stopped.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    if merge:
        results = lo.merged(merge, out)
    else:
        try:
            cfg = _load(env, config_files)
        except ConfigError as e:
            fail(e)
        chosen = lo.features_arg(cfg, features)
        opts = LadderOptions(
            profiles=lo.profiles_arg(profiles),
            ttft_slo_ms=ttft_slo_ms or cfg.slo.ttft_p95_ms,
            steps=lo.steps_arg(steps),
            max_tokens=max_tokens,
            seed=seed,
            repeats=repeats,
            features=chosen,
            max_steps=max_steps,
            part=lo.part_arg(part),
            only=lo.only_arg(cfg, chosen, repeats, only),
            url=url,
            app_name=lo.app_name_arg(app_name),
            http_port=http_port,
            command=shlex.join(["headroom", "ladder", *sys.argv[2:]]),
        )
        results = run_ladder(cfg, opts, out, progress=err.print)
    for line in ladder_report.summary_lines(results):
        typer.echo(line)
    typer.echo(f"report: {out / 'report.md'}")


@model_app.command("prepare")
def model_prepare(
    names: Annotated[list[str] | None, typer.Argument(help="Embedded models; default all.")] = None,
) -> None:
    """Generate the embedded models (deterministic, offline) into $HEADROOM_HOME (~/.cache/headroom)."""
    from serve_app.config.vocabulary import EMBEDDED_PREFIX
    from serve_app.models.embedded import ensure_embedded_model
    from serve_app.planning.catalogue import EMBEDDED_MODELS

    for name in names or sorted(EMBEDDED_MODELS):
        try:
            path = ensure_embedded_model(name if name.startswith(EMBEDDED_PREFIX) else EMBEDDED_PREFIX + name)
        except ValueError as e:
            fail(e)
        print(f"{EMBEDDED_PREFIX}{name.removeprefix(EMBEDDED_PREFIX)}\t{path}")


@app.command("envs")
def envs() -> None:
    """List the environments in configs/."""
    print("\n".join(available_envs()))


register_rollout_commands(app)


def main() -> None:
    try:
        app()
    except ConfigError as e:  # a config error raised outside a command's own handling
        err.print(f"[red]error:[/red] {e}", highlight=False)
        sys.exit(2)


if __name__ == "__main__":
    main()
