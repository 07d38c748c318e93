"""The per-request CPU benchmark's report: medians and per-round differences against uvicorn."""

from __future__ import annotations

import argparse

import pytest

from loadtests import bench_serve_request as b


def test_report_pairs_each_round_with_uvicorns() -> None:
    samples = {"uvicorn": [100.0, 120.0, 110.0], "serve, through HAProxy": [400.0, 380.0, 500.0]}
    args = argparse.Namespace(chunks=1, requests=10, concurrency=2, rounds=3)
    text = b.report(samples, {}, args, "python -m loadtests.bench_serve_request")
    assert "| uvicorn | 110 [100, 120] | +0 [+0, +0] |" in text
    # per round: 300, 260, 390 over uvicorn
    assert "| serve, through HAProxy | 400 [380, 500] | +300 [+260, +390] |" in text
    assert "Where the time goes" not in text


def test_a_parts_time_per_request_counts_every_sample_with_its_frame_anywhere_on_the_stack() -> None:
    loop = "thread (0x1): MainThread"
    serve_path = "Replica._direct_ingress_asgi (ray/serve/_private/replica.py:3300)"
    raw = [
        f"{loop};run (x.py:1);{serve_path};trivial_app.<locals>.app (b.py:60) 30",
        f"{loop};run (x.py:1);{serve_path};Replica._record_errors_and_metrics (r.py:1473);"
        "Logger.info (logging/__init__.py:1489) 20",
        f"{loop};run (x.py:1);{serve_path} 10",
        f"{loop};run (x.py:1) 440",  # waiting: in no part
    ]
    parts = b.us_per_request_in_parts(raw, rate_hz=500, requests=100)
    # 60 samples of 2 ms over 100 requests: 1,200 us each
    assert parts["Serve's request path, the app included"] == pytest.approx(1200)
    assert parts["the app itself"] == pytest.approx(600)
    assert parts["of which the access log's record (made with the log off too)"] == pytest.approx(400)
    assert parts["uvicorn: reading and parsing requests"] == 0


def test_the_report_tables_the_profiled_servers_parts_side_by_side() -> None:
    args = argparse.Namespace(chunks=1, requests=10, concurrency=2, rounds=1, profile_requests=50)
    parts = {
        label: dict.fromkeys((part for part, _ in b.SERVE_PARTS), float(i * 100))
        for i, label in enumerate(b.PROFILED)
    }
    text = b.report({"uvicorn": [100.0]}, parts, args, "cmd")
    assert "| part | uvicorn | serve, replica's port | serve, no access log, replica's port |" in text
    assert "| the app itself | 0 | 100 | 200 |" in text


def test_a_negative_profile_request_count_is_refused_naming_the_flag(capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        b.main(["--profile-requests", "-1"])
    assert exit_.value.code == 2
    assert "--profile-requests must be >= 0 (0: no profile), got -1" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--requests", "--concurrency", "--rounds", "--chunks"])
def test_counts_below_one_are_refused_naming_the_flag(flag, capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        b.main([flag, "0"])
    assert exit_.value.code == 2
    assert f"{flag} must be >= 1, got 0" in capsys.readouterr().err


def test_the_trivial_app_streams_the_asked_number_of_chunks() -> None:
    import asyncio

    sent: list[dict] = []

    async def receive():
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def send(message):
        sent.append(message)

    asyncio.run(b.trivial_app(3)({"type": "http"}, receive, send))
    assert [m["type"] for m in sent] == ["http.response.start"] + ["http.response.body"] * 3
    assert [m.get("more_body") for m in sent[1:]] == [True, True, False]
