"""The overhead benchmark's pure parts: prompt counts, seeds, `vllm bench serve`'s command line, medians
with their spread over rounds, the paired comparison, the targets, the time budget and the report."""

from __future__ import annotations

import os

import pytest

from loadtests import engine_logs, vllm_bench
from loadtests.engine_logs import EngineMemory, compare
from loadtests.overhead_client import our_prompts
from loadtests.overhead_matrix import (
    BARE,
    HEADROOM,
    OUR_CLIENT,
    VLLM_BENCH,
    VLLM_BENCH_OPEN,
    aggregate,
    cell_seed,
    cpu_per_token,
    identity_flags,
    next_round,
    parse_counts,
    parse_rates,
    prompt_count,
    spread,
    targets,
)
from loadtests.overhead_report import fmt, markdown
from loadtests.overhead_servers import ServerProcesses, app_name_for, parse_variant, set_compile_cache
from loadtests.vllm_bench import WORKLOADS, Workload


@pytest.mark.parametrize(
    ("text", "expected"),
    [("", {}), ("1:30", {1: 30}), ("1:30,64:320,128:640,256:1024", {1: 30, 64: 320, 128: 640, 256: 1024})],
)
def test_parse_counts(text, expected):
    assert parse_counts(text) == expected


@pytest.mark.parametrize("text", ["1", "1:", "a:3", "1:30,64"])
def test_parse_counts_refuses_what_is_not_c_colon_n(text):
    with pytest.raises(ValueError, match="CONCURRENCY:PROMPTS"):
        parse_counts(text)


@pytest.mark.parametrize(
    ("concurrency", "expected"),
    [(1, 30), (64, 320), (8, 40), (2, 30)],  # explicit counts win; else waves x c, at least min_prompts
)
def test_prompt_count(concurrency, expected):
    assert prompt_count(concurrency, {1: 30, 64: 320}, waves=5, min_prompts=30) == expected


def test_cell_seeds_differ_between_cells_and_rounds_and_repeat_exactly():
    seeds = {cell_seed(w, c, r) for w in WORKLOADS for c in (1, 64, 128, 256) for r in range(3)}
    assert len(seeds) == len(WORKLOADS) * 4 * 3
    assert cell_seed("short", 64, 2) == cell_seed("short", 64, 2)


def test_parse_rates():
    assert parse_rates("") == {} and parse_rates("64:20,128:22.5") == {64: 20.0, 128: 22.5}
    for text in ("64", "64:", "64:0", "a:3", "64:x"):
        with pytest.raises(ValueError, match="CONCURRENCY:REQUESTS_PER_S"):
            parse_rates(text)


def test_an_open_loop_run_gets_prompts_of_its_own():
    # The same prompts as the closed loop's would be found in the prefix cache.
    assert cell_seed("random-1024", 64, 0, VLLM_BENCH_OPEN) != cell_seed("random-1024", 64, 0)
    assert cell_seed("random-1024", 64, 0, VLLM_BENCH) == cell_seed("random-1024", 64, 0)


def test_a_second_door_to_an_engine_gets_prompts_of_its_own():
    # headroom's replica on its own port shares headroom's engine: with the same seed, the second of the
    # two to run found the first one's short prompts cached (seen on the H200, 2026-12-04).
    seeds = {cell_seed("short", 64, 0, VLLM_BENCH, door) for door in ("", "headroom-direct", "vllm+10ms")}
    assert len(seeds) == 3
    assert cell_seed("short", 64, 0, VLLM_BENCH, "") == cell_seed("short", 64, 0)


def test_starts_nearby_tells_a_whole_cycle_at_once_from_groups_and_poisson():
    import random

    rng = random.Random(0)
    t, poisson = 0.0, []
    for _ in range(5000):
        t += rng.expovariate(20.0)
        poisson.append(t)
    # 20/s over a 100 ms window: about 2 others
    assert vllm_bench.starts_nearby(poisson, None) == pytest.approx(2.0, abs=1.0)
    # 10 cycles of 64 starts within 64 ms, 2.5 s apart: nearly the whole cycle is near each start
    whole = [c * 2.5 + i * 0.001 for c in range(10) for i in range(64)]
    assert vllm_bench.starts_nearby(whole, None) >= 45
    # the same cycles as 8 groups of 8, a 190 ms prefill step apart: only the group and its neighbours'
    # edges; the spread of the gaps could not tell these two apart
    groups = [c * 2.5 + g * 0.19 + i * 0.001 for c in range(10) for g in range(8) for i in range(8)]
    assert vllm_bench.starts_nearby(groups, None) == 7
    # the first `concurrency` starts (sent at once) are left out; one start gives None
    assert vllm_bench.starts_nearby([0.0] * 64 + groups, 64) == 7
    assert vllm_bench.starts_nearby([0.0, 1.0], 1) is None


def test_with_latencies_keeps_each_requests_end_to_end_time_before_its_gaps_are_dropped():
    result = {"ttfts": [0.1, 0.2], "itls": [[0.01, 0.02], []], "start_times": [5.0, 6.0]}
    assert vllm_bench.with_latencies(result)["e2els"] == pytest.approx([0.13, 0.2])
    assert "e2els" not in vllm_bench.with_latencies({"ttfts": [0.1]})  # no gaps saved: nothing made up


def test_wait_before_each_request_delays_every_request_function_and_restores_them():
    import asyncio
    import time

    from vllm.benchmarks import serve

    original = dict(serve.ASYNC_REQUEST_FUNCS)
    with vllm_bench.wait_before_each_request(0.05):
        delayed = serve.ASYNC_REQUEST_FUNCS["openai"]
        assert delayed is not original["openai"]

    async def timed():
        calls = []

        async def fake(**kwargs):
            calls.append(time.perf_counter())
            return kwargs

        serve.ASYNC_REQUEST_FUNCS["fake"] = fake
        try:
            with vllm_bench.wait_before_each_request(0.05):
                wrapped = serve.ASYNC_REQUEST_FUNCS["fake"]
            started = time.perf_counter()
            assert await wrapped(request_func_input="x") == {"request_func_input": "x"}
            return calls[0] - started
        finally:
            del serve.ASYNC_REQUEST_FUNCS["fake"]

    assert asyncio.run(timed()) >= 0.045
    assert original == serve.ASYNC_REQUEST_FUNCS  # restored on leaving
    with vllm_bench.wait_before_each_request(0.0):
        assert original == serve.ASYNC_REQUEST_FUNCS  # no wait: untouched


def test_bench_args_open_loop_adds_the_rate_and_nothing_else():
    w = WORKLOADS["random-1024"]
    closed = vllm_bench.bench_args("http://h:1", "m", "/tok", w, 64, 320, 7, "/out", "r.json")
    opened = vllm_bench.bench_args("http://h:1", "m", "/tok", w, 64, 320, 7, "/out", "r.json", 20.0)
    assert opened == closed + ["--request-rate", "20"]


def test_bench_args_is_the_closed_loop_cell_vllm_would_run():
    w = WORKLOADS["random-1024"]
    args = vllm_bench.bench_args("http://h:1/app", "m", "/tok", w, 64, 320, 7, "/out", "r.json")

    def value(flag):
        return args[args.index(flag) + 1]

    assert value("--base-url") == "http://h:1/app" and value("--endpoint") == "/v1/completions"
    assert (value("--random-input-len"), value("--random-output-len")) == ("1024", "128")
    assert (value("--num-prompts"), value("--max-concurrency"), value("--seed")) == ("320", "64", "7")
    assert (value("--result-dir"), value("--result-filename")) == ("/out", "r.json")
    assert "--ignore-eos" in args and value("--temperature") == "0" and "--save-result" in args
    assert "--random-prefix-len" not in args  # no shared prefix, and no --request-rate: all queued at once
    assert "--request-rate" not in args


def test_bench_args_parse_with_vllms_own_parser():
    """The command line is what `vllm bench serve` accepts (the installed vLLM's parser)."""
    pytest.importorskip("vllm.benchmarks.serve")
    from vllm.benchmarks.serve import add_cli_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    args = vllm_bench.bench_args(
        "http://h:1", "m", "/tok", WORKLOADS["shared-prefix"], 4, 8, 3, "/o", "f.json"
    )
    parsed = parser.parse_args(args)
    assert (parsed.random_prefix_len, parsed.random_input_len, parsed.max_concurrency) == (1024, 64, 4)
    assert parsed.ignore_eos and parsed.save_result and parsed.temperature == 0
    assert parsed.save_detailed  # each request's start and TTFT (starts_nearby)


def test_from_result_keeps_vllms_medians_under_our_names():
    result = {"median_ttft_ms": 40.0, "median_tpot_ms": 5.0, "output_throughput": 190.0, "completed": 30}
    ours = vllm_bench.from_result(result)
    assert (ours["ttft_p50_ms"], ours["tpot_p50_ms"], ours["output_tokens_per_s"]) == (40.0, 5.0, 190.0)
    assert ours["itl_p50_ms"] is None  # not in this result: None, not a guess
    assert ours["starts_within_50ms"] is None  # no per-request starts saved


def test_with_output_len():
    w = WORKLOADS["short"]
    assert w.with_output_len(None) is w
    assert w.with_output_len(16) == Workload("short", 50, 16, 0, w.description)


def test_our_prompts_are_distinct_per_round_and_share_the_cells_prefix():
    w = WORKLOADS["shared-prefix"]
    a, b = our_prompts(w, 3, seed=1), our_prompts(w, 3, seed=2)
    assert len(set(a)) == 3 and not set(a) & set(b)
    assert a[0].split()[:2] != b[0].split()[:2]  # rounds differ from the first words: no prefix reuse
    shared = os.path.commonprefix(a)
    assert len(shared.split()) >= w.prefix_len  # the cell's requests share the prefix
    assert all(len(p.split()) >= w.prefix_len + w.input_len for p in a)


def test_cpu_per_token():
    assert cpu_per_token({"frontend": 0.5, "engine": 2.0}, 1000) == {
        "frontend_cpu_us_per_token": 500.0,
        "engine_cpu_us_per_token": 2000.0,
    }
    assert cpu_per_token({"engine": 1.0}, 0) == {"engine_cpu_us_per_token": None}


def test_cpu_groups_name_the_ingress_only_where_a_server_has_one():
    replica, haproxy, engine = object(), object(), object()  # stand-ins: groups() only sorts them
    through_haproxy = ServerProcesses(frontend=[replica, haproxy], engine=[engine], ingress=[haproxy])
    assert through_haproxy.groups() == {
        "frontend": [replica, haproxy],
        "engine": [engine],
        "ingress": [haproxy],
    }
    bare = ServerProcesses(frontend=[replica], engine=[engine])
    assert bare.groups() == {"frontend": [replica], "engine": [engine]}


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ([3.0, 1.0, 2.0], {"median": 2.0, "min": 1.0, "max": 3.0, "n": 3}),
        ([4.0, 1.0], {"median": 2.5, "min": 1.0, "max": 4.0, "n": 2}),
        ([5.0, None], {"median": 5.0, "min": 5.0, "max": 5.0, "n": 1}),
        ([None], None),
        ([], None),
    ],
)
def test_spread(values, expected):
    assert spread(values) == expected


def m(server, r, ttft, tput, workload="random-1024", c=1, client=VLLM_BENCH, **extra):
    """One measurement: TTFT p50 and throughput as given, TPOT 5 ms."""
    return {"workload": workload, "concurrency": c, "client": client, "server": server, "round": r,
            "ttft_p50_ms": ttft, "tpot_p50_ms": 5.0, "output_tokens_per_s": tput, **extra}  # fmt: skip


def test_aggregate_pairs_rounds_and_gives_median_with_min_max():
    ms = [
        m(BARE, 0, 40.0, 200.0), m(HEADROOM, 0, 42.0, 190.0),
        m(BARE, 1, 50.0, 180.0), m(HEADROOM, 1, 51.0, 180.0),
        m(BARE, 2, 45.0, 100.0), m(HEADROOM, 2, 49.0, 99.0),
        m(HEADROOM, 3, 99.0, 1.0),  # a round bare never ran: in headroom's spread, not in any pair
    ]  # fmt: skip
    (row,) = aggregate(ms, [BARE, HEADROOM])
    assert row[BARE]["ttft_p50_ms"] == {"median": 45.0, "min": 40.0, "max": 50.0, "n": 3}
    assert row[HEADROOM]["ttft_p50_ms"]["n"] == 4
    cmp = row["comparison"][HEADROOM]
    assert cmp["ttft_p50_delta_ms"] == {"median": 2.0, "min": 1.0, "max": 4.0, "n": 3}
    assert cmp["throughput_ratio"] == {"median": 0.99, "min": 0.95, "max": 1.0, "n": 3}
    assert cmp["tpot_p50_ratio"]["median"] == 1.0
    assert cmp["engine_cpu_us_per_token_ratio"] is None  # not measured here


def test_aggregate_keeps_cells_and_clients_apart_and_sorted():
    ms = [
        m(BARE, 0, 10.0, 1.0, c=64), m(HEADROOM, 0, 11.0, 1.0, c=64),
        m(BARE, 0, 1.0, 1.0, c=1), m(HEADROOM, 0, 2.0, 1.0, c=1),
        m(BARE, 0, 3.0, 1.0, c=1, client=OUR_CLIENT), m(HEADROOM, 0, 5.0, 1.0, c=1, client=OUR_CLIENT),
    ]  # fmt: skip
    rows = aggregate(ms, [BARE, HEADROOM])
    assert [(r["client"], r["concurrency"]) for r in rows] == [
        (OUR_CLIENT, 1),
        (VLLM_BENCH, 1),
        (VLLM_BENCH, 64),
    ]
    assert [r["comparison"][HEADROOM]["ttft_p50_delta_ms"]["median"] for r in rows] == [2.0, 1.0, 1.0]


def test_targets_judge_concurrency_1_and_the_next_two():
    ms = [m(BARE, 0, 40.0, 100.0, c=1), m(HEADROOM, 0, 42.5, 100.0, c=1)]  # +2.5 ms: met
    ms += [m(BARE, 0, 700.0, 3300.0, c=64), m(HEADROOM, 0, 760.0, 3200.0, c=64)]  # 97%, TTFT +8.6%
    ms += [m(BARE, 0, 900.0, 3400.0, c=128), m(HEADROOM, 0, 900.0, 3390.0, c=128)]  # 99.7%
    ms += [m(BARE, 0, 1.0, 1.0, c=256), m(HEADROOM, 0, 1.0, 0.5, c=256)]  # not judged
    result = targets(aggregate(ms, [BARE, HEADROOM]))
    assert result == {
        "random-1024: TTFT p50 added at c=1 <= 3 ms": True,
        "random-1024: throughput at c=64 >= 98% of bare": False,
        "random-1024: throughput at c=128 >= 98% of bare": True,
        "random-1024: TTFT p50 at c=64 within 5% of bare": False,
    }


def test_a_matrix_without_concurrency_1_gets_no_added_ms_target():
    # The 3 ms target is for c=1; a run of c=64 alone is judged on throughput and the TTFT ratio.
    ms = [m(BARE, 0, 800.0, 3180.0, c=64), m(HEADROOM, 0, 880.0, 3120.0, c=64)]  # 98.1%, TTFT +10%
    assert targets(aggregate(ms, [BARE, HEADROOM])) == {
        "random-1024: throughput at c=64 >= 98% of bare": True,
        "random-1024: TTFT p50 at c=64 within 5% of bare": False,
    }


def test_against_vllm_defaults_only_throughput_is_judged_at_every_concurrency():
    # Against vLLM's defaults only throughput is a target: the 4x TTFT is reported, not judged here.
    ms = [m(BARE, 0, 800.0, 3760.0, c=256), m(HEADROOM, 0, 3300.0, 3740.0, c=256)]  # 99.5%
    ms += [m(BARE, 0, 700.0, 3300.0, c=64), m(HEADROOM, 0, 700.0, 3200.0, c=64)]  # 97%
    assert targets(aggregate(ms, [BARE, HEADROOM]), against_vllm_defaults=True) == {
        "random-1024: throughput at c=64 >= 98% of bare vLLM with its defaults": False,
        "random-1024: throughput at c=256 >= 98% of bare vLLM with its defaults": True,
    }


def test_targets_say_not_measured_rather_than_guess():
    ms = [m(BARE, 0, 40.0, 100.0, c=1), m(HEADROOM, 1, 42.0, 100.0, c=1)]  # never in the same round
    assert targets(aggregate(ms, [BARE, HEADROOM])) == {"random-1024: TTFT p50 added at c=1 <= 3 ms": None}


@pytest.mark.parametrize(
    ("time_left", "swap_due", "expected"),
    [
        (500, True, "swap"),  # 100 s restart + 200 s round fit
        (250, True, "round"),  # the swap does not fit, a round on the same GPUs does
        (250, False, "round"),
        (150, True, "stop"),
        (150, False, "stop"),
    ],
)
def test_next_round(time_left, swap_due, expected):
    assert next_round(time_left, round_s=200, restart_s=100, swap_due=swap_due) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("fast:OMP_NUM_THREADS=1", ("fast", {"OMP_NUM_THREADS": "1"})),
        ("quiet-log:A=1,B=", ("quiet-log", {"A": "1", "B": ""})),
        ("none:", ("none", {})),
    ],
)
def test_parse_variant(text, expected):
    assert parse_variant(text) == expected


@pytest.mark.parametrize("text", ["", ":A=1", "a b:A=1", "x:A", "x:=1"])
def test_parse_variant_refuses_malformed(text):
    with pytest.raises(ValueError, match="variant"):
        parse_variant(text)


def test_app_names():
    assert (app_name_for(""), app_name_for("/fast")) == ("headroom", "headroom-fast")


def test_fmt():
    assert fmt(None, 1) == "-"
    assert fmt({"median": 1.25, "min": 1.0, "max": 2.0, "n": 1}, 1) == "1.2"
    assert fmt({"median": 1234.5, "min": 1000.0, "max": 2000.0, "n": 3}, 0) == "1,234 [1,000, 2,000]"


def test_markdown_report_has_every_cell_target_and_the_command():
    ms = [m(BARE, r, 40.0 + r, 100.0) for r in range(3)] + [m(HEADROOM, r, 42.0 + r, 99.0) for r in range(3)]
    rows = aggregate(ms, [BARE, HEADROOM])
    report = {
        "machine": "x86_64, 2 CPUs",
        "versions": {"vllm": "0.32.0", "ray": "2.60.0", "python": "3.11"},
        "model": "tiny-qwen3",
        "engine_flags": ["--model", "/m"],
        "bare_engine_flags": ["--model", "/m"],
        "layout": "both servers up at once",
        "variants": {},
        "workloads": {"random-1024": vars(WORKLOADS["random-1024"])},
        "prompts": {"random-1024 c=1": 30},
        "rounds_planned": 3,
        "rounds_done": 3,
        "elapsed_s": 100.0,
        "notes": [],
        "results": rows,
        "targets": {HEADROOM: targets(rows)},
        "starts": [{"server": BARE, "gpu": None, "ready_s": 60.0}],
        "memory": [],
        "memory_predicted_for": "1 node(s) x 1 H100-80GB, 79.2 GiB (the GPU this machine has)",
        "command": "python -m loadtests.bench_overhead --env local",
        "vllm_bench_commands": {"vllm random-1024 c=1": "vllm bench serve --seed 1"},
    }
    text = markdown(report)
    assert "| 1 | headroom | 2.0 [2.0, 2.0] |" in text  # TTFT added, paired per round
    assert "random-1024: TTFT p50 added at c=1 <= 3 ms: met" in text
    assert "`python -m loadtests.bench_overhead --env local`" in text
    assert "`vllm bench serve --seed 1`" in text
    assert "inside and outside the engine" not in text  # no engine timing was read

    timed = [
        {**x, "engine_ttft_p50_ms": 30.0 + i, "prefix_cache_hit_pct": float(i)} for i, x in enumerate(ms)
    ]
    report["results"] = aggregate(timed, [BARE, HEADROOM])
    text = markdown(report)
    assert "inside and outside the engine" in text and "| prefix-cache hits % |" in text
    # client TTFT p50, engine TTFT p50, loop lag (none), prefix-cache hits: median [min, max] over 3 rounds
    assert "| 1 | headroom | 43.0 [42.0, 44.0] | 34.0 [33.0, 35.0] | - | - | 4.0 [3.0, 5.0] |" in text

    # How each engine got its compiled graphs stands beside its memory, and the run's cache setting on top.
    logged = EngineMemory("vllm serve", 350_000, 15.27, 50.0, 1.2, "12-04 21:40:30", engine_logs.LOADED)
    report["memory"] = [compare({"kv_cache_tokens": 349_000, "weights_gib": 15.27}, logged)]
    report["compile_cache"] = "off"
    text = markdown(report)
    assert "torch.compile cache: off (every engine compiled its own graphs)" in text
    assert "| vllm serve | 349,000 | 350,000 | -0.29% | 15.27 / 15.27 | loaded from cache |" in text
    assert "prediction for 1 node(s) x 1 H100-80GB, 79.2 GiB (the GPU this machine has), against" in text

    # An open-loop run is a section of its own and is not judged by the closed loop's targets.
    opened = [{**x, "client": VLLM_BENCH_OPEN, "ttft_p50_ms": 500.0} for x in ms]
    rows = aggregate(ms + opened, [BARE, HEADROOM])
    assert targets(rows) == targets(aggregate(ms, [BARE, HEADROOM]))
    report["results"] = rows
    assert "open loop (Poisson arrivals" in markdown(report)


def test_identity_flags_keep_the_model_and_context_and_drop_engine_settings():
    flags = ["--model", "/m", "--served-model-name", "q", "--dtype", "auto", "--max-model-len", "8192",
             "--load-format", "dummy", "--max-num-seqs", "96", "--enable-prefix-caching",
             "--gpu-memory-utilization", "0.9"]  # fmt: skip
    assert identity_flags(flags) == [
        "--model", "/m", "--served-model-name", "q", "--max-model-len", "8192", "--load-format", "dummy"
    ]  # fmt: skip


def test_bench_command_line_defaults_and_refusals(capsys):
    from loadtests.bench_overhead import matrix, parse_args

    args = parse_args(["--env", "local", "--concurrency", "1", "8", "--num-prompts", "1:10", "--waves", "3"])
    assert (args.bare_flags, args.rounds, args.workloads, args.bare_turnaround_ms) == (
        "same",
        3,
        ["random-1024", "short", "shared-prefix"],
        [],
    )
    assert parse_args(["--bare-turnaround-ms", "10", "32.5"]).bare_turnaround_ms == [10.0, 32.5]
    assert args.engine_timing and not parse_args(["--no-engine-timing"]).engine_timing
    # Both servers' engines compile their own graphs unless asked otherwise; the switch is vLLM's env.
    assert args.compile_cache == "off" and parse_args(["--compile-cache", "on"]).compile_cache == "on"
    env = {"VLLM_DISABLE_COMPILE_CACHE": "1"}
    set_compile_cache(env, on=True)
    assert env == {}
    set_compile_cache(env, on=False)
    assert env == {"VLLM_DISABLE_COMPILE_CACHE": "1"}
    cells = matrix(args)
    assert [(c.workload.name, c.concurrency, c.num_prompts) for c in cells[:2]] == [
        ("random-1024", 1, 10),
        ("random-1024", 8, 30),  # 3 waves of 8, at least min_prompts (30)
    ]
    for argv, message in (
        (["--concurrent"], "--concurrent needs --gpus with two GPUs"),
        (["--gpus", "0", "--variant", "x:A=1"], "--variant needs a GPU of its own for each app"),
        (["--share-gpu"], "--share-gpu needs --gpus with one GPU"),
        (["--gpus", "0", "--share-gpu", "--swap-gpus"], "and no --swap-gpus"),
        (["--bare-flags", "defaults"], "invalid choice"),
        (["--gpus", "0", "1", "--concurrent", "--direct"], "--direct loads headroom's one engine"),
        (["--gpus", "0", "--direct"], "on one GPU only with --share-gpu"),
        (["--open-loop", "64:fast"], "CONCURRENCY:REQUESTS_PER_S"),
        (["--bare-turnaround-ms", "0"], "a wait in milliseconds, above 0 and at most 10000"),
        (["--bare-turnaround-ms", "ten"], "a wait in milliseconds"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            parse_args(argv)
        assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_diag_command_line_defaults_span_the_graph_ceiling():
    from loadtests.overhead_diag import parse_args

    lengths = parse_args([]).lengths  # prompt tokens, on both sides of vLLM's 512-token graph ceiling
    below, above = [n for n in lengths if n <= 512], [n for n in lengths if n > 512]
    assert min(below) <= 64 and max(below) >= 400 and min(above) <= 640 and max(above) >= 1024


def test_diag_profiles_the_loaded_cell_it_is_given(capsys):
    from loadtests.overhead_diag import parse_args

    assert parse_args([]).load_profile == ("random-1024", 64, 128)
    assert parse_args(["--load-profile", "short:256:1280"]).load_profile == ("short", 256, 1280)
    assert parse_args(["--load-profile", "none"]).load_profile is None
    for bad in ("long:64:128", "short:0:10", "short:64"):
        with pytest.raises(SystemExit):
            parse_args(["--load-profile", bad])
        assert "expected WORKLOAD:C:N" in capsys.readouterr().err


def test_only_targets_that_share_an_engine_with_another_are_second_doors(tmp_path):
    from loadtests.bench_overhead import HEADROOM_DIRECT, Target
    from loadtests.overhead_servers import BareVllm, HeadroomServer

    bare = BareVllm(BARE, "http://127.0.0.1:1", None, tmp_path / "v.log")
    ours = HeadroomServer(HEADROOM, "http://127.0.0.1:2", None, tmp_path / "h.log")
    doors = [
        Target(BARE, bare),
        Target(HEADROOM, ours),
        Target("headroom-x", ours, "/x"),  # a variant: an app and engine of its own
        Target(HEADROOM_DIRECT, ours, direct=True),
        Target(f"{BARE}+10ms", bare, turnaround_ms=10.0),
    ]
    assert [t.second_door for t in doors] == ["", "", "", HEADROOM_DIRECT, f"{BARE}+10ms"]


def test_a_run_starts_without_an_earlier_runs_logs_and_raw_results(tmp_path):
    from loadtests.bench_overhead import clear_earlier_run

    raw = tmp_path / "raw"
    raw.mkdir()
    earlier = [raw / "vllm-short-c64-r0.json", tmp_path / "vllm_serve.log", tmp_path / "client-vllm.log"]
    kept = [tmp_path / "overhead.log", tmp_path / "notes.txt"]  # the caller's own output stays
    for p in earlier + kept:
        p.write_text("earlier")
    clear_earlier_run(tmp_path, raw)
    assert not any(p.exists() for p in earlier) and all(p.exists() for p in kept) and raw.is_dir()


def test_memory_is_predicted_for_the_gpu_the_machine_has(monkeypatch):
    """An H200 config on an H100 machine: the engines size their KV cache from the H100's memory, so that
    is what the prediction is for, and the report says so; a GPU the catalogue lacks: the config's."""
    from loadtests import machine
    from serve_app.config import load_config_files
    from serve_app.planning.from_config import plan_config

    cfg = load_config_files("configs/base.yaml", "loadtests/gpu/qwen3-8b.yaml", "loadtests/gpu/half-gpu.yaml")
    monkeypatch.setattr(machine, "gpu_names", lambda: ["NVIDIA H100 80GB HBM3"])
    cluster, said = machine.cluster_here(cfg)
    assert said == "1 node(s) x 1 H100-80GB, 79.2 GiB (the GPU this machine has, not the config's)"
    # The memory model at 0.45 of an H100: vLLM logged 137,264 tokens (results/gpu/2026-12-07/overhead-c256*).
    assert plan_config(cfg, cluster).kv_cache_tokens_per_replica == 137_360

    monkeypatch.setattr(machine, "gpu_names", lambda: ["NVIDIA Example X1"])
    cluster, said = machine.cluster_here(cfg, gpus_per_node=2)
    assert said == "1 node(s) x 2 H200, 139.8 GiB (the config's)" and cluster.gpus_per_node == 2
    # The config's own GPU: its memory as the config gives it (what torch measured), not the catalogue's.
    monkeypatch.setattr(machine, "gpu_names", lambda: ["NVIDIA H200"])
    cfg = load_config_files("configs/base.yaml", "loadtests/gpu/qwen3-8b.yaml")
    cfg = cfg.model_copy(update={"resources": cfg.resources.model_copy(update={"gpu_memory_gib": 140.0})})
    cluster, said = machine.cluster_here(cfg)
    assert said == "1 node(s) x 1 H200, 140.0 GiB (the config's, which this machine has)"
