"""autoscale.timeline: the bins where a run missed, and no look at judging seeds."""

from __future__ import annotations

from pathlib import Path

import pytest

from autoscale import timeline


def test_only_bins_with_a_missed_request_are_listed_with_their_fleet() -> None:
    tl = {
        "bin_s": 2.0,
        "rate_rps": [10.0, 30.0, 12.0],
        "missed": [0, 7, 1],
        "provisioned": [2, 2, 2, 4, 4, 4],
        "ready": [2, 2, 2, 2, 2, 4],
    }
    assert timeline.missed_bins(tl) == [
        {"start_s": 2.0, "rate_rps": 30.0, "missed": 7, "provisioned": 4, "serving": 2},
        {"start_s": 4.0, "rate_rps": 12.0, "missed": 1, "provisioned": 4, "serving": 2},
    ]


def test_judging_seeds_are_refused(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="judges the benchmark"):
        timeline.main(["bursty", "101", "--out", str(tmp_path / "x.md")])
    assert not (tmp_path / "x.md").exists()
