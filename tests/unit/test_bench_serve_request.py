"""The per-request CPU benchmark's report: medians and per-round differences against uvicorn."""

from __future__ import annotations

import argparse

import pytest

from loadtests import bench_serve_request as b


def test_report_pairs_each_round_with_uvicorns() -> None:
    samples = {"uvicorn": [100.0, 120.0, 110.0], "serve, through HAProxy": [400.0, 380.0, 500.0]}
    args = argparse.Namespace(chunks=1, requests=10, concurrency=2, rounds=3)
    text = b.report(samples, args, "python -m loadtests.bench_serve_request")
    assert "| uvicorn | 110 [100, 120] | +0 [+0, +0] |" in text
    # per round: 300, 260, 390 over uvicorn
    assert "| serve, through HAProxy | 400 [380, 500] | +300 [+260, +390] |" in text


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
