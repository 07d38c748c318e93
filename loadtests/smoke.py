"""The short Locust load that gates a rollout (`headroom rollout`), as one headless subprocess, and the one
builder of the Locust command line that every headless run uses (`locust_command`).

serve_app.rollout decides pass or fail from the summary; the load itself lives here, with the other load
generators, and the CLI hands `run_smoke_load` to the rollout.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from serve_app.rollout import RolloutError, SmokeOptions

LOCUSTFILE = Path(__file__).resolve().parent / "locustfile.py"


def locust_command(
    host: str, model: str, raw_file: Path, flags: Mapping[str, str | int | float]
) -> list[str]:
    """`python -m locust` headless on loadtests/locustfile.py against `host`, summary only, every request
    written to `raw_file`; `flags` adds Locust's and the locustfile's own options, e.g. {"-u": 2,
    "-t": "10s"} or {"--ladder": "1:15,4:15", "--seed": 0}."""
    cmd = [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless", "--only-summary"]
    cmd += ["--host", host, "--model", model, "--raw-file", str(raw_file)]
    for flag, value in flags.items():
        cmd += [flag, str(value)]
    return cmd


def smoke_command(base_url: str, model: str, raw_file: Path, opts: SmokeOptions) -> list[str]:
    """The smoke load: closed loop, `users` streaming clients for `duration_s`."""
    flags: dict[str, str | int | float] = {
        "-u": opts.users,
        "-r": opts.users,
        "-t": f"{max(1, round(opts.duration_s))}s",
        "--profile": opts.profile,
        "--api": opts.api,
        "--max-tokens": opts.max_tokens,
        "--request-timeout": f"{opts.request_timeout_s:g}",
        # Failed requests are data for the gate (its error rate), not a failed run.
        "--exit-code-on-error": 0,
    }
    return locust_command(base_url, model, raw_file, flags)


def run_smoke_load(base_url: str, model: str, raw_file: Path, opts: SmokeOptions) -> dict[str, Any]:
    """Runs the headless Locust smoke load and summarizes its raw file (loadtests/raw_stats.py)."""
    from loadtests.raw_stats import load_records, summarize

    raw_file.parent.mkdir(parents=True, exist_ok=True)
    cmd = smoke_command(base_url, model, raw_file, opts)
    limit = opts.duration_s + opts.request_timeout_s + 60
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=limit, check=False)
    except subprocess.TimeoutExpired:
        raise RolloutError(f"the smoke load did not finish within {limit:.0f} s") from None
    if proc.returncode != 0 or not raw_file.is_file():
        tail = (proc.stderr or proc.stdout or "").strip().splitlines()[-5:]
        raise RolloutError(
            f"the smoke load (locust) failed with exit code {proc.returncode}: {' | '.join(tail)}"
        )
    return summarize(load_records(raw_file))
