"""`headroom ladder` deploying its settings for real, beside the session's apps: in two parts (as the GPU
run does, one per device call), each unit a fresh engine that serves both profiles, measured with Locust,
speculation counted from vLLM's metrics through Ray's Prometheus export, then removed; the parts merged."""

from __future__ import annotations

import httpx
import pytest
from ray import serve

from loadtests import ladder_report
from loadtests.ladder import LadderOptions, run_ladder
from loadtests.raw_stats import load_records
from serve_app.config import load_env_config

pytestmark = pytest.mark.integration

APP = "ladder-it"


def test_ladder_in_two_parts_merged(cluster, tmp_path):
    cfg = load_env_config("local")
    options = dict(
        profiles=["structured", "random"],
        ttft_slo_ms=5000,
        steps="1:3,2:3",
        max_tokens=8,
        repeats=2,
        features=["ngram"],
        max_steps=2,
        app_name=APP,
        http_port=cluster.http_port,
        command="headroom ladder --env local --repeats 2 --features ngram",
    )
    parts = [run_ladder(cfg, LadderOptions(**options, part=(k, 2)), tmp_path / f"part{k}") for k in (1, 2)]

    # The schedule, interleaved: baseline@0 ngram@0 | ngram@1 baseline@1; the profile order turns per repeat.
    assert [p.units_planned for p in parts] == [["baseline@0", "ngram@0"], ["ngram@1", "baseline@1"]]
    first = [(r.setting, r.repeat, r.profile) for r in parts[0].runs]
    assert first == [
        ("baseline", 0, "structured"),
        ("baseline", 0, "random"),
        ("+ngram speculation", 0, "structured"),
        ("+ngram speculation", 0, "random"),
    ]
    assert [r.profile for r in parts[1].runs[:2]] == ["random", "structured"]
    runs = [r for p in parts for r in p.runs]
    for r in runs:
        assert [s.concurrency for s in r.steps] == [1, 2], r
        assert all(s.requests > 0 and s.error_rate == 0 for s in r.steps), r
        assert r.peak_memory_gib > 0 and r.engine_start_s and r.kv_ceiling > 0, r
        folder = tmp_path / ("part1" if r in parts[0].runs else "part2")
        assert len(load_records(folder / r.raw_file)) >= sum(s.requests for s in r.steps)
    # One engine per unit, measured on both profiles.
    assert len({r.engine_start_s for r in runs}) == 4
    for r in runs:
        if r.setting == "baseline":
            assert r.spec_decode is None
        else:  # vLLM's counters for this replica, over this profile's run
            c = r.spec_decode
            assert c is not None and c.drafts > 0, r
            assert c.drafts <= c.draft_tokens <= 3 * c.drafts and c.accepted_tokens <= c.draft_tokens, c

    merged = ladder_report.merge([tmp_path / "part1", tmp_path / "part2"], tmp_path / "all")
    ladder_report.write(merged, tmp_path / "all")
    assert len(merged.runs) == 8 and ladder_report.read(tmp_path / "all") == merged
    for analysis in ladder_report.analyses(merged):
        [verdict] = analysis.verdicts
        assert verdict.status == "not judged" and "3 needed" in verdict.reason  # two repeats measured
        assert analysis.recommendation.setting == "baseline"
        assert analysis.recommendation.max_num_seqs.text() == "at least 2"
    report = (tmp_path / "all" / "report.md").read_text()
    assert "acceptance rate" in report and (tmp_path / "all" / "ladder-random.png").is_file()

    # The ladder removed its apps and left the session's apps serving.
    apps = serve.status().applications
    assert APP not in apps and f"{APP}-2" not in apps
    assert httpx.get(f"{cluster.base_url}/v1/models", timeout=30).status_code == 200
