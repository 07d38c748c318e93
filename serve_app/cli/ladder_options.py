"""`headroom ladder`'s options and their checks: each bad value exits 2 naming its flag, before anything
starts. The command itself is in serve_app/cli/commands.py; the ladder in loadtests/ladder.py."""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from serve_app.config import HeadroomConfig
from serve_app.config.vocabulary import APP_NAME_HINT, APP_NAME_PATTERN

if TYPE_CHECKING:
    from loadtests.ladder_results import LadderResults

Profiles = Annotated[
    list[str] | None,
    typer.Option(
        "--profile",
        help="Workload, repeatable: random, shared-prefix, multi-turn, structured or creative; each engine "
        "serves every profile. Default random.",
    ),
]
TtftSlo = Annotated[
    float | None, typer.Option(min=0.001, help="TTFT p95 target; default the config's slo.ttft_p95_ms.")
]
Steps = Annotated[
    str,
    typer.Option(help="Concurrency steps, users:seconds; extended by doubling while the SLO holds."),
]
MaxSteps = Annotated[int, typer.Option(min=1, max=20, help="Most steps per run, the extension included.")]
MaxTokens = Annotated[int, typer.Option(min=1, max=32768, help="Output tokens per request.")]
Seed = Annotated[int, typer.Option(min=0, help="Workload seed.")]
Repeats = Annotated[int, typer.Option(min=1, max=20, help="Fresh engines per setting; a verdict needs 3.")]
Features = Annotated[
    str | None,
    typer.Option(
        help="Features switched on in order, comma-separated: prefix-caching, chunked-prefill, ngram, or "
        "the config's speculative method. Default: those three and the config's method."
    ),
]
Part = Annotated[
    str | None, typer.Option(help="Run only the K-th of M slices of the schedule, K/M; merge them after.")
]
Only = Annotated[
    str | None, typer.Option(help="Run only these units, comma-separated FEATURE@REPEAT, e.g. baseline@0.")
]
Merge = Annotated[
    list[Path] | None,
    typer.Option(help="Measure nothing: merge these partial runs' folders into --out (repeatable)."),
]
Url = Annotated[
    str | None, typer.Option(help="Measure a running server as deployed instead of deploying each setting.")
]
Out = Annotated[Path, typer.Option(help="Report folder.")]
AppName = Annotated[
    str,
    typer.Option(
        help="Serve application (and route prefix) the settings are deployed as; ladders that share a "
        "cluster need different names.",
    ),
]
HttpPort = Annotated[
    int | None, typer.Option(min=1, max=65535, help="Serve's HTTP port; default one per process.")
]


def profiles_arg(profiles: list[str] | None) -> list[str]:
    from loadtests.workloads import PROFILES

    for profile in profiles or []:
        if profile not in PROFILES:
            raise typer.BadParameter(
                f"{profile!r} is not one of {', '.join(PROFILES)}", param_hint="--profile"
            )
    return list(dict.fromkeys(profiles or ["random"]))


def steps_arg(steps: str) -> str:
    from loadtests.workloads import parse_steps

    try:
        parse_steps(steps)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--steps") from None
    return steps


def features_arg(cfg: HeadroomConfig, features: str | None) -> list[str] | None:
    from loadtests.ladder import check_features

    if features is None:
        return None
    chosen = [f.strip() for f in features.split(",") if f.strip()]
    try:
        check_features(cfg, chosen)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--features") from None
    return chosen


def only_arg(cfg: HeadroomConfig, features: list[str] | None, repeats: int, only: str | None) -> list[str]:
    from loadtests.ladder import check_only

    chosen = [u.strip() for u in (only or "").split(",") if u.strip()]
    try:
        check_only(cfg, features, repeats, chosen)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--only") from None
    return chosen


def part_arg(part: str | None) -> tuple[int, int] | None:
    if part is None:
        return None
    match = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", part)
    if not match or not 1 <= int(match.group(1)) <= int(match.group(2)):
        raise typer.BadParameter(f"{part!r}: expected K/M with 1 <= K <= M, e.g. 1/2", param_hint="--part")
    return int(match.group(1)), int(match.group(2))


def app_name_arg(name: str) -> str:
    if not re.fullmatch(APP_NAME_PATTERN, name):
        raise typer.BadParameter(f"{name!r}: {APP_NAME_HINT}", param_hint="--app-name")
    return name


def merged(parts: list[Path], out: Path) -> LadderResults:
    """The partial runs' results merged and written to `out`."""
    from loadtests import ladder_report

    try:
        results = ladder_report.merge(parts, out)
    except (OSError, ValueError) as e:
        raise typer.BadParameter(str(e), param_hint="--merge") from None
    ladder_report.write(results, out)
    return results
