"""The TTFT-headroom autoscaler on real Ray Serve: 1 -> 2 replicas under a Locust load, back to 1 after,
each decision logged by the controller with its reason code."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import ray
from ray import serve

from serve_app.serving.deployment import build_from_config
from tests.integration.conftest import overlay

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


def running_replicas(app: str) -> int:
    status = serve.status().applications[app].deployments["LLMServer"]
    return status.replica_states.get("RUNNING", 0)


def wait_for_replicas(app: str, count: int, timeout_s: float) -> float:
    start = time.time()
    while time.time() - start < timeout_s:
        if running_replicas(app) == count:
            return time.time() - start
        time.sleep(2)
    raise AssertionError(f"{app} did not reach {count} running replicas in {timeout_s} s")


def decisions() -> list[str]:
    """The policy's logged scale decisions ("up -> 2 [scale_up_ttft]") in this cluster's controller log."""
    logs = Path(ray._private.worker._global_node.get_logs_dir_path()) / "serve"
    text = "\n".join(p.read_text(errors="replace") for p in sorted(logs.glob("controller_*.log")))
    return re.findall(r"headroom autoscaler: ((?:up|down) -> \d+ \[\w+\])", text)


def wait_for_decision(pattern: str, timeout_s: float) -> str:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        found = [d for d in decisions() if re.fullmatch(pattern, d)]
        if found:
            return found[-1]
        time.sleep(2)
    raise AssertionError(f"no decision matching {pattern!r} in the controller log; saw {decisions()}")


@pytest.fixture(scope="module")
def autoscale_app(cluster):
    cfg = overlay("autoscale.yaml")
    serve.run(build_from_config(cfg), name=cfg.name, route_prefix=cfg.route_prefix)
    yield cfg
    serve.delete(cfg.name)


def test_scales_up_under_load_and_back_down_after(cluster, autoscale_app, tmp_path):
    assert running_replicas("autoscale") == 1
    locust = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "locust",
            "-f",
            "loadtests/locustfile.py",
            "--headless",
            "-u",
            "16",
            "-r",
            "16",
            "-t",
            "300s",
            "--host",
            f"{cluster.base_url}/autoscale",
            "--model",
            "tiny-qwen3-autoscaled",
            "--profile",
            "random",
            "--max-tokens",
            "64",
            "--raw-file",
            str(tmp_path / "raw.jsonl"),
            "--only-summary",
        ],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        up_s = wait_for_replicas("autoscale", 2, timeout_s=240)
    finally:
        locust.send_signal(signal.SIGTERM)
        locust.wait(timeout=60)
    assert (tmp_path / "raw.jsonl").stat().st_size > 0  # the load really ran
    up = wait_for_decision(r"up -> 2 \[scale_up_(ttft|queueing|demand)\]", timeout_s=30)
    down_s = wait_for_replicas("autoscale", 1, timeout_s=240)
    down = wait_for_decision(r"down -> 1 \[scale_down\]", timeout_s=30)
    print(f"scaled 1->2 ({up}) {up_s:.0f} s into the load, 2->1 ({down}) {down_s:.0f} s after it stopped")
    # Quiet again: it stays at one replica (no flapping back up).
    time.sleep(20)
    assert running_replicas("autoscale") == 1
