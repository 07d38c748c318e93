"""The short Locust load that gates a rollout (`headroom rollout`), as one headless subprocess.

serve_app.rollout decides pass or fail from the summary; the load itself lives here, with the other load
generators, and the CLI hands `run_smoke_load` to the rollout.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

from serve_app.rollout.operations import RolloutError, SmokeOptions


def locustfile_path() -> Path:
    import loadtests

    return Path(loadtests.__file__).resolve().parent / "locustfile.py"


def smoke_command(base_url: str, model: str, raw_file: Path, opts: SmokeOptions) -> list[str]:
    """The headless Locust run (loadtests/locustfile.py): closed loop, `users` streaming clients."""
    flags = {
        "-f": str(locustfile_path()),
        "-u": str(opts.users),
        "-r": str(opts.users),
        "-t": f"{max(1, round(opts.duration_s))}s",
        "--host": base_url,
        "--model": model,
        "--profile": opts.profile,
        "--api": opts.api,
        "--max-tokens": str(opts.max_tokens),
        "--request-timeout": f"{opts.request_timeout_s:g}",
        "--raw-file": str(raw_file),
        "--exit-code-on-error": "0",
    }
    cmd = [sys.executable, "-m", "locust", "--headless", "--only-summary"]
    for flag, value in flags.items():
        cmd += [flag, value]
    return cmd


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
