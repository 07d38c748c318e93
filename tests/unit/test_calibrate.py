"""The calibration fit (autoscale/calibrate.py): points from `vllm bench serve` results, the arrivals
replay, and a fit that recovers a known engine from what it produced."""

from __future__ import annotations

import gzip
import json
from dataclasses import asdict, replace

import numpy as np
import pytest

from autoscale.calibrate import Point, fit, fit_loss, point_from_vllm_bench_result, replay_arrivals
from autoscale.calibration import DEFAULT_CALIBRATION, EngineCost, EngineLimits, load_calibration
from autoscale.replica_engine import ReplicaEngine, Requests
from autoscale.replica_stats import ReplicaStatsWindow

LIMITS = EngineLimits(256, 8192, 794_064, 100_000)


def bench_result(starts: list[float], ttfts_s: list[float], concurrency: int) -> dict:
    n = len(starts)
    return {
        "completed": n,
        "max_concurrency": concurrency,
        "total_input_tokens": 1024 * n,
        "total_output_tokens": 128 * n,
        "median_ttft_ms": 1000 * float(np.median(ttfts_s)),
        "median_tpot_ms": 10.0,
        "output_throughput": 1000.0,
        "start_times": starts,
        "ttfts": ttfts_s,
    }


def test_a_saved_run_gives_its_arrivals_in_send_order_and_ttfts_in_ms():
    p = point_from_vllm_bench_result(bench_result([105.0, 100.0, 100.5], [0.3, 0.1, 0.2], 2), "x.json")
    assert p.arrivals_s == (0.0, 0.5, 5.0)
    assert p.ttfts_ms == pytest.approx((100.0, 200.0, 300.0))
    assert (p.concurrency, p.prompt_tokens, p.output_tokens, p.requests) == (2, 1024, 128, 3)
    without = {k: v for k, v in bench_result([1.0], [0.1], 1).items() if k not in ("start_times", "ttfts")}
    assert point_from_vllm_bench_result(without, "y.json").arrivals_s == ()


def test_a_saved_run_with_latencies_gives_each_requests_tpot_in_send_order():
    d = bench_result([105.0, 100.0], [0.3, 0.1], 2) | {"e2els": [1.57, 0.735], "output_lens": [128, 128]}
    p = point_from_vllm_bench_result(d, "x.json")
    assert p.tpots_ms == pytest.approx((5.0, 10.0))  # (0.735 - 0.1) / 127 s, then (1.57 - 0.3) / 127 s
    assert point_from_vllm_bench_result(bench_result([1.0], [0.1], 1), "y.json").tpots_ms == ()


def test_tpot_given_arrivals_is_a_lone_requests_decode_step():
    """Alone after its prefill, a request decodes one token per step: step, one sequence, its context."""
    cost = load_calibration().cost
    p = Point("one", "x", 1, 1024, 128, 1, arrivals_s=(0.0,), ttfts_ms=(50.0,), tpots_ms=(7.0,))
    mean_context = 1024 + 1 + 126 / 2  # context tokens over its 127 decode steps, on average
    expected = cost.step_ms + cost.decode_ms_per_seq + cost.attention_ms_per_kv_token * mean_context
    assert replay_arrivals(p, cost, LIMITS)["tpot_p50_ms"] == pytest.approx(expected, rel=1e-3)
    assert "tpot_p50_ms" not in replay_arrivals(replace(p, tpots_ms=()), cost, LIMITS)


def test_one_request_alone_takes_one_prefill_step_and_the_request_overhead():
    cost = load_calibration().cost
    p = Point("one", "x", 1, 1024, 128, 1, arrivals_s=(0.0,), ttfts_ms=(50.0,))
    expected = (
        cost.step_ms + 1024 * cost.prefill_ms_per_token + cost.request_overhead_ms
    )  # nothing decoding, no context yet
    assert replay_arrivals(p, cost, LIMITS)["ttft_p50_ms"] == pytest.approx(expected)


def test_mismatched_per_request_lists_are_refused_naming_the_point():
    with pytest.raises(ValueError, match="'p'.*arrivals_s and ttfts_ms"):
        Point.from_dict({"label": "p", "source": "x", "concurrency": 1, "prompt_tokens": 1,
                         "output_tokens": 1, "requests": 1, "arrivals_s": [0.0], "ttfts_ms": []})  # fmt: skip


def engine_ttfts(cost: EngineCost, arrivals: list[float]) -> list[float]:
    n = len(arrivals)
    req = Requests.create(list(arrivals), [1024] * n, [128] * n)
    engine = ReplicaEngine(cost, LIMITS, req, ReplicaStatsWindow(30.0), 0.0)
    for rid, t in enumerate(arrivals):
        engine.advance(t)
        engine.submit(rid, t)
    while engine.step():
        pass
    return list(req.ttft_ms)


def test_the_fit_recovers_first_tokens_under_load_from_the_arrivals_a_known_engine_saw():
    """A 'true' engine with 40% dearer prefill serves waves of arrivals (as closed loops send them); the
    fit, started from the committed costs and given only those arrivals and TTFTs, predicts that engine's
    first tokens under load."""
    start = load_calibration().cost
    true = replace(start, prefill_ms_per_token=start.prefill_ms_per_token * 1.4)
    rng = np.random.default_rng(7)
    points = []
    for c, every_s in ((16, 1.5), (64, 3.0)):
        arrivals = sorted(k * every_s + rng.uniform(0, 0.05) for k in range(6) for _ in range(c))
        ttfts = engine_ttfts(true, arrivals)
        points.append(
            Point(
                f"c{c}",
                "synthetic",
                c,
                1024,
                128,
                len(arrivals),
                fit=(),
                arrivals_s=tuple(arrivals),
                ttfts_ms=tuple(ttfts),
            )  # fmt: skip
        )
    before = [replay_arrivals(p, start, LIMITS)["ttft_p90_ms"] for p in points]
    fitted = fit(points, start, LIMITS)
    for p, was in zip(points, before, strict=True):
        measured = float(np.percentile(p.ttfts_ms, 90))
        got = replay_arrivals(p, fitted, LIMITS)["ttft_p90_ms"]
        # The start is 20-40% off; the fit's coordinate search stops within a few percent.
        assert abs(was / measured - 1) > 0.2, (p.label, was, measured)
        assert abs(got / measured - 1) < 0.1, (p.label, got, measured)
    # What the search minimises: nothing left for the true engine, and the fit's far below the start's.
    assert fit_loss(points, true, LIMITS) == pytest.approx(0.0, abs=1e-12)
    assert fit_loss(points, fitted, LIMITS) < 0.05 * fit_loss(points, start, LIMITS)


def test_step_logs_give_the_step_costs_and_the_points_the_request_overhead(tmp_path):
    """`--steps`: the step costs come from the engine's step log (a known engine's, exact), the request
    overhead from the points' TTFT; a log saved without the KV cache's size is refused and nothing written."""
    from autoscale.calibrate import main, replay_point
    from tests.unit.test_step_log import KV_TOKENS, TRUE, engine_log

    true = EngineCost(**TRUE, request_overhead_ms=25.0)
    limits = EngineLimits(256, 8192, 794_064, 100_000)  # main's defaults
    lone = Point("c1", "synthetic", 1, 1024, 128, 8, fit=("ttft_p50_ms",))
    lone = replace(lone, ttft_p50_ms=replay_point(lone, true, limits)["ttft_p50_ms"])
    points = tmp_path / "points.json"
    points.write_text(json.dumps([{k: getattr(lone, k) for k in ("label", "source", "concurrency",
        "prompt_tokens", "output_tokens", "requests", "ttft_p50_ms", "fit")}]))  # fmt: skip
    log = tmp_path / "steps_c1.json"
    log.write_text(
        json.dumps({"kv_cache_tokens": KV_TOKENS, "block_size": 16, "steps": engine_log(600, seed=8)})
    )
    out = tmp_path / "cal.json"
    assert main(["--points", str(points), "--steps", str(log), "--out", str(out)]) == 0
    got = load_calibration(out)
    assert asdict(got.cost) == pytest.approx(asdict(true), rel=0.02)
    assert {c.status for c in got.constants.values()} == {"measured"}
    assert got.name == load_calibration(DEFAULT_CALIBRATION).name  # --start's, unless --name says

    # The replay saves its step logs gzipped; they read the same, and --name says what was fitted.
    packed = tmp_path / "steps_c1.json.gz"
    packed.write_bytes(gzip.compress(log.read_bytes()))
    named = tmp_path / "named.json"
    argv = ["--points", str(points), "--steps", str(packed), "--name", "one H100", "--out", str(named)]
    assert main(argv) == 0
    assert load_calibration(named).cost == got.cost and load_calibration(named).name == "one H100"

    log.write_text(json.dumps(engine_log(600, seed=8)))
    out.unlink()
    packed.write_bytes(packed.read_bytes()[:-40])  # cut short
    for bad in (log, tmp_path / "missing.json", packed):
        with pytest.raises(SystemExit):
            main(["--points", str(points), "--steps", str(bad), "--out", str(out)])
        assert not out.exists()


def test_an_empty_name_is_refused_and_nothing_written(tmp_path, capsys):
    from autoscale.calibrate import main

    out = tmp_path / "cal.json"
    with pytest.raises(SystemExit):
        main(["--vllm-bench", "x.json", "--name", " ", "--out", str(out)])
    assert "--name: must not be empty" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.parametrize("content", ["", "not json", '[{"label": "c1"}]'])
def test_unreadable_points_name_the_flag_and_write_nothing(tmp_path, capsys, content):
    from autoscale.calibrate import main

    points, out = tmp_path / "points.json", tmp_path / "cal.json"
    points.write_text(content)
    with pytest.raises(SystemExit):
        main(["--points", str(points), "--out", str(out)])
    assert "--points:" in capsys.readouterr().err
    assert not out.exists()


def test_a_file_that_is_not_what_its_flag_reads_is_named_and_nothing_written(tmp_path, capsys):
    """A step log given as --vllm-bench (an easy glob slip), a ladder spec without its prompt length and
    a missing ladder file: usage errors naming the flag and the file, not tracebacks."""
    from autoscale.calibrate import main
    from tests.unit.test_step_log import KV_TOKENS, engine_log

    log, out = tmp_path / "steps_c1.json", tmp_path / "cal.json"
    log.write_text(json.dumps({"kv_cache_tokens": KV_TOKENS, "steps": engine_log(40, seed=1)}))
    for argv, said in (
        (["--vllm-bench", str(log)], f"--vllm-bench {log}: not a `vllm bench serve --save-result` file (no "),
        (["--ladder", str(log)], f"--ladder {log}: not PATH:PROMPT_TOKENS"),
        (["--ladder", f"{tmp_path}/missing.json:1024"], "--ladder"),
    ):
        with pytest.raises(SystemExit):
            main([*argv, "--out", str(out)])
        assert said in capsys.readouterr().err
        assert not out.exists()
