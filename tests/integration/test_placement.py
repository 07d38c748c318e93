"""The planner's placement, deployed for real: a two-node Ray cluster (4 fake GPUs each) on this machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


def run_probe(model: str, replicas: int, out_path: Path) -> subprocess.CompletedProcess:
    # Its own cluster: none of the test session's Ray settings (RAY_ADDRESS would point at the session's
    # cluster; HAProxy ingress would compete for the session's ports).
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    return subprocess.run(
        [sys.executable, "-m", "tests.integration.placement_probe", model, str(replicas), str(out_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_tensor_parallel_groups_land_on_one_node_each(tmp_path):
    # Llama-3.1-70B in bf16 (141 GB of weights) cannot fit one 139.8 GiB H200: the plan must use TP.
    out = run_probe("meta-llama/Llama-3.1-70B-Instruct", 2, tmp_path / "report.json")
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    plan = report["plan"]
    assert report["cluster"] == {"nodes": 2, "gpus_per_node": 4}
    assert plan["fits"] and plan["tensor_parallel_size"] in (2, 4)
    tp = plan["tensor_parallel_size"]
    groups = report["placement_groups"]
    assert len(groups) == 2  # one placement group per replica
    for group in groups:
        assert group["strategy"] == "STRICT_PACK"
        assert [b.get("GPU") for b in group["bundles"]] == [1.0] * tp
        assert group["bundles"] == [{k: float(v) for k, v in b.items()} for b in plan["bundles"]]
        assert len(set(group["bundle_nodes"])) == 1  # the whole TP group on one node
    gpus_used = Counter(node for g in groups for node in g["bundle_nodes"])
    assert all(gpus_used[node] <= gpus for node, gpus in report["node_gpus"].items())


def test_a_plan_that_does_not_fit_the_cluster_is_refused_before_deploying(tmp_path):
    out = run_probe("meta-llama/Llama-3.1-70B-Instruct", 5, tmp_path / "report.json")
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert "deployment.num_replicas (5)" in report["refused"]
    assert report["placement_groups"] == []  # nothing was deployed
