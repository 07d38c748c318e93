"""`headroom ladder` deploying its settings for real: each on a fresh engine, under its own Serve app and
route prefix beside the session's apps, measured with Locust, then removed."""

from __future__ import annotations

import json

import httpx
import pytest
from ray import serve

from loadtests.ladder import run_ladder
from serve_app.config import load_env_config

pytestmark = pytest.mark.integration


def test_ladder_deploys_each_setting_beside_other_apps(cluster, tmp_path):
    report = run_ladder(
        load_env_config("local"),
        "structured",
        ttft_slo_ms=2000,
        ladder="1:3,2:3",
        out=tmp_path,
        max_tokens=8,
        app_name="ladder-it",
        http_port=cluster.http_port,
    )
    runs = report["runs"]
    assert [r["setting"] for r in runs] == report["settings_planned"]
    assert [r["feature"] for r in runs] == [None, "prefix caching", "chunked prefill", "ngram speculation"]
    for run in runs:
        assert all(step["requests"] > 0 and step["error_rate"] == 0 for step in run["steps"]), run
        assert run["peak_memory_gib"] > 0  # the replica and its engine, found under the ladder's app name
    assert json.loads((tmp_path / "results.json").read_text())["runs"] == json.loads(json.dumps(runs))
    assert (tmp_path / "report.md").is_file() and (tmp_path / "ladder.png").is_file()
    # The ladder removed its app and left the session's apps serving.
    assert "ladder-it" not in serve.status().applications
    models = httpx.get(f"{cluster.base_url}/v1/models", timeout=30)
    assert models.status_code == 200
