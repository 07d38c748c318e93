"""What headroom keeps on disk: every rendered config and one JSON line per rollout, per environment.

$HEADROOM_STATE_DIR (default ./.headroom)/rollouts/<env>/<UTC time>-<config hash>.yaml
                                              .../<UTC time>-<config hash>.smoke.jsonl  (Locust raw)
                                              .../history.jsonl  (one JSON line per rollout)
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

STATE_DIR_ENV = "HEADROOM_STATE_DIR"
DEFAULT_STATE_DIR = ".headroom"


def state_dir(explicit: str | Path | None = None, environ: Mapping[str, str] = os.environ) -> Path:
    """--state-dir, else $HEADROOM_STATE_DIR, else ./.headroom."""
    if explicit:
        return Path(explicit)
    return Path(environ.get(STATE_DIR_ENV) or DEFAULT_STATE_DIR)


def env_dir(state: Path, label: str) -> Path:
    """Where an environment's rendered configs and history live."""
    return state / "rollouts" / label


def stamp(now: datetime) -> str:
    """UTC time as a file-name prefix: 20261130T120000Z."""
    return now.astimezone(timezone.utc).strftime("%Y%m%dT%H%M%SZ")


def append_history(state: Path, label: str, record: Mapping[str, Any]) -> Path:
    """Appends one rollout's record to the environment's history.jsonl; returns the file."""
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


def previous_rendered(state: Path, label: str, previous_hash: str | None) -> str | None:
    """The rendered file of the last rollout of config `previous_hash`, when headroom rolled it out."""
    if previous_hash is None:
        return None
    for record in reversed(read_history(state, label)):
        if record.get("config_hash") == previous_hash and record.get("rendered"):
            return str(record["rendered"])
    return None
