"""The TTFT-headroom autoscaler on real Ray Serve: 1 -> 2 replicas under a Locust load, back to 1 after."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
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
    down_s = wait_for_replicas("autoscale", 1, timeout_s=240)
    print(f"scaled 1->2 {up_s:.0f} s into the load, 2->1 {down_s:.0f} s after it stopped")
    # Quiet again: it stays at one replica (no flapping back up).
    time.sleep(20)
    assert running_replicas("autoscale") == 1
