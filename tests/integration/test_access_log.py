"""Ray Serve's access log: written by the main app's replica (the default) to Serve's replica log file, not
by the draft app's, whose config turns it off (deployment.access_log: false)."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
import ray

from loadtests.processes import serve_replicas

pytestmark = pytest.mark.integration

# Ray Serve's access line: "<method> <route> <status> <latency>ms" (ray/serve/_private/logging_utils.py).
ACCESS_LINE = re.compile(r"\b(GET|POST) \S* \d{3} [\d.]+ms\b")


def serve_log_lines(app: str) -> list[str]:
    """The lines of Serve's log files of the app's replicas (logs/serve/replica_<app>_*.log): written only
    while the file handler Serve gives each replica survives vLLM's logging set-up
    (engine.serve_log_file_kept)."""
    logs = Path(ray._private.worker.global_worker.node.get_logs_dir_path())
    assert serve_replicas(app), f"no replica of app {app!r}"
    files = list((logs / "serve").glob(f"replica_{app}_LLMServer_*.log"))
    assert files, f"no Serve log file of app {app!r}"
    return [line for f in files for line in f.read_text(errors="replace").splitlines()]


def access_lines(app: str) -> list[str]:
    return [line for line in serve_log_lines(app) if ACCESS_LINE.search(line)]


def test_serve_access_log_is_written_unless_the_config_turns_it_off(cluster):
    for prefix, model in (("", "tiny-qwen3"), ("/draft", "tiny-qwen3-drafted")):
        cluster.client(prefix).completions.create(model=model, prompt="access log", max_tokens=2)
    deadline = time.monotonic() + 10
    while not access_lines("main") and time.monotonic() < deadline:
        time.sleep(0.5)  # Serve logs a request after its response
    assert access_lines("main")
    assert access_lines("draft") == []
    # Lines logged after the engine started reach the file too, this one only the file (not stderr).
    assert any("Finished initializing replica" in line for line in serve_log_lines("draft"))
