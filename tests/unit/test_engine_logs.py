"""Reading vLLM's memory lines out of engine logs, and comparing them with the planner."""

from __future__ import annotations

import gzip
from pathlib import Path

from loadtests import engine_logs

LOGS = Path(__file__).resolve().parents[1] / "data" / "memory_points" / "logs"


def lines(name: str) -> list[str]:
    return gzip.open(LOGS / name, "rt", errors="replace").read().splitlines()


def test_single_gpu_engine_log():
    [engine] = engine_logs.parse({"a": lines("q8b_fp8kv_t2048.log.gz")}, "vllm serve")
    assert engine.kv_cache_tokens == 1_589_408
    assert engine.weights_gib == 15.27 and engine.kv_cache_gib == 109.14
    assert engine.activation_peak_gib == 1.19
    assert engine.torch_compile == engine_logs.COMPILED  # the first engine on that machine compiled


def test_how_each_engine_got_its_compiled_graphs():
    """A second engine on the machine loads what the first compiled (the 2026-12-04 overhead runs: bare vLLM
    compiled, headroom's engine loaded); one started again in the same file is read on its own."""
    fresh = [
        "(EngineCore pid=1) INFO 12-04 21:40:10 [b.py:3] Compiling a graph for compile range (1, 8192) "
        "takes 12.23 s",
        "(EngineCore pid=1) INFO 12-04 21:40:30 [kv_cache_utils.py:1] GPU KV cache size: 350,000 tokens",
    ]
    cached = [
        "(EngineCore pid=2) INFO 12-04 21:42:01 [d.py:3] Directly load AOT compilation from path /c",
        "(EngineCore pid=2) INFO 12-04 21:42:02 [backends.py:296] Directly load the compiled graph(s) for "
        "compile range (1, 8192) from the cache, took 1.20 s",
        "(EngineCore pid=2) INFO 12-04 21:42:20 [kv_cache_utils.py:1] GPU KV cache size: 350,016 tokens",
        "(EngineCore pid=3) INFO 12-04 21:50:20 [kv_cache_utils.py:1] GPU KV cache size: 350,016 tokens",
    ]
    engines = engine_logs.parse({"bare": fresh, "replica": cached}, "x")
    assert [e.torch_compile for e in engines] == [engine_logs.COMPILED, engine_logs.LOADED, None]


def test_tensor_parallel_ranks_log_their_shards():
    [engine] = engine_logs.parse({"a": lines("q8b_tp2_nofuse.log.gz")}, "replica")
    assert engine.kv_cache_tokens == 1_710_640 and engine.weights_gib == 7.64


def test_engines_starting_at_once_keep_their_own_weights():
    """Two replicas on two GPUs start together: each KV line takes the weights of its own log file."""
    a = ["(EngineCore pid=1) INFO 11-30 00:01:00 [m:1] Model loading took 15.27 GiB and 3 seconds",
         "(EngineCore pid=1) INFO 11-30 00:01:50 [k:1] GPU KV cache size: 794,704 tokens"]  # fmt: skip
    b = ["(EngineCore pid=2) INFO 11-30 00:01:02 [m:1] Model loading took 1.12 GiB and 1 seconds",
         "(EngineCore pid=2) INFO 11-30 00:01:53 [k:1] GPU KV cache size: 1,162,352 tokens"]  # fmt: skip
    engines = engine_logs.parse({"replica-b": b, "replica-a": a}, "ray")
    assert [(e.kv_cache_tokens, e.weights_gib) for e in engines] == [(794_704, 15.27), (1_162_352, 1.12)]


def test_tensor_parallel_ranks_in_their_own_worker_logs():
    """With vLLM's Ray executor each rank is a Ray worker with its own log; the engine's file has the KV."""
    engine = ["(EngineCore pid=6) INFO 11-30 00:05:40 [k:1] GPU KV cache size: 1,710,640 tokens"]
    rank0 = ["(RayWorkerWrapper pid=7) INFO 11-30 00:05:00 [m:1] Model loading took 7.64 GiB and 2 seconds"]
    rank1 = ["(RayWorkerWrapper pid=8) INFO 11-30 00:05:01 [m:1] Model loading took 7.64 GiB and 2 seconds"]
    [memory] = engine_logs.parse({"e": engine, "r0": rank0, "r1": rank1}, "ray")
    assert (memory.kv_cache_tokens, memory.weights_gib) == (1_710_640, 7.64)


def test_compare_reports_errors_and_the_targets():
    logged = engine_logs.EngineMemory("x", 794_704, 15.27, 109.14, 1.19, "11-30 00:00:00")
    row = engine_logs.compare({"kv_cache_tokens": 794_064, "weights_gib": 15.266}, logged)
    assert row["kv_within_2pct"] and abs(row["kv_error"] + 0.0008) < 1e-4
    assert row["weights_error"] == 0.0 and row["weights_within_1pct"]  # within vLLM's 0.01 GiB rounding
    off = engine_logs.compare({"kv_cache_tokens": 700_000, "weights_gib": 16.0}, logged)
    assert not off["kv_within_2pct"] and not off["weights_within_1pct"]


def test_each_engine_is_compared_with_its_own_layout():
    expected = {"TP=1": {"kv_cache_tokens": 794_064, "weights_gib": 15.27},
                "TP=2": {"kv_cache_tokens": 1_700_384, "weights_gib": 7.64}}  # fmt: skip
    tp1 = engine_logs.EngineMemory("r", 797_680, 15.27, None, None, "11-30 00:00:00")
    tp2 = engine_logs.EngineMemory("r", 1_709_952, 7.64, None, None, "11-30 00:01:00")
    rows = engine_logs.compare_each(expected, [tp1, tp2])
    assert [(r["layout"], r["kv_within_2pct"], r["weights_within_1pct"]) for r in rows] == [
        ("TP=1", True, True),
        ("TP=2", True, True),
    ]
