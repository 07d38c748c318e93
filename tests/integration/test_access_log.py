"""Ray Serve's access log: written by the main app's replica (the default), not by the draft app's, whose
config turns it off (deployment.access_log: false)."""

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


def access_lines(app: str) -> list[str]:
    """The access lines of the app's replicas, wherever Ray put them: the replica's Serve log, or its worker's
    stdout/stderr log (in headroom's replicas Serve's file handler stops after start-up and the lines reach
    the worker's stderr; seen with Ray 2.60 and vLLM 0.32)."""
    logs = Path(ray._private.worker.global_worker.node.get_logs_dir_path())
    pids = [p.pid for p in serve_replicas(app)]
    assert pids, f"no replica of app {app!r}"
    files = list((logs / "serve").glob(f"replica_{app}_LLMServer_*.log"))
    files += [f for pid in pids for f in logs.glob(f"worker-*-{pid}.*") if f.suffix in (".out", ".err")]
    lines = [line for f in files for line in f.read_text(errors="replace").splitlines()]
    return [line for line in lines if ACCESS_LINE.search(line)]


def test_serve_access_log_is_written_unless_the_config_turns_it_off(cluster):
    for prefix, model in (("", "tiny-qwen3"), ("/draft", "tiny-qwen3-drafted")):
        cluster.client(prefix).completions.create(model=model, prompt="access log", max_tokens=2)
    deadline = time.monotonic() + 10
    while not access_lines("main") and time.monotonic() < deadline:
        time.sleep(0.5)  # Ray writes the worker's output to its log files as it comes
    assert access_lines("main")
    assert access_lines("draft") == []
