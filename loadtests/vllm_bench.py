"""`vllm bench serve`, vLLM's own load generator, as the reference client of headroom's benchmarks.

Run in-process (the CPU build of vLLM has no `vllm` console script): `run(argv)` parses the arguments with
vLLM's own parser and returns the JSON it saved. `bench_args` builds the command line for one closed-loop
cell (all requests queued at once, `concurrency` in flight), so every benchmark asks it the same way, and
the report can print the exact command (`vllm bench serve ` + the arguments).

Workloads are shaped as the random dataset makes them: token counts, not words.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Workload:
    """Request shape: a random prompt of `input_len` tokens after a `prefix_len`-token prefix that every
    request of a cell shares, and `output_len` generated tokens (EOS ignored)."""

    name: str
    input_len: int
    output_len: int
    prefix_len: int = 0
    description: str = ""

    def with_output_len(self, output_len: int | None) -> Workload:
        if output_len is None:
            return self
        return Workload(self.name, self.input_len, output_len, self.prefix_len, self.description)


WORKLOADS = {
    w.name: w
    for w in (
        Workload("random-1024", 1024, 128, 0, "random 1024-token prompts, 128 output tokens (the issue's)"),
        Workload("short", 50, 128, 0, "random ~50-token prompts, 128 output tokens"),
        Workload(
            "shared-prefix", 64, 128, 1024, "a 1024-token prefix shared by the cell's requests + 64 unique"
        ),
    )
}


def bench_args(
    base_url: str,
    model: str,
    tokenizer: str,
    workload: Workload,
    concurrency: int,
    num_prompts: int,
    seed: int,
    result_dir: str,
    result_filename: str,
    request_rate: float | None = None,
) -> list[str]:
    """`vllm bench serve`'s arguments for one cell: closed loop at `concurrency` (all requests queued at
    once, `concurrency` in flight), streaming completions, greedy, EOS ignored, results saved as JSON
    with each request's timings. With `request_rate`: open loop, Poisson arrivals at that rate (drawn from
    the seed, so every server gets the same schedule), at most `concurrency` in flight."""
    args = [
        "--backend", "openai", "--endpoint", "/v1/completions", "--base-url", base_url,
        "--model", model, "--tokenizer", tokenizer,
        "--dataset-name", "random", "--random-input-len", str(workload.input_len),
        "--random-output-len", str(workload.output_len),
        "--num-prompts", str(num_prompts), "--max-concurrency", str(concurrency),
        "--ignore-eos", "--temperature", "0", "--seed", str(seed),
        "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,95,99",
        "--disable-tqdm", "--save-result", "--save-detailed",
        "--result-dir", result_dir, "--result-filename", result_filename,
    ]  # fmt: skip
    if request_rate is not None:
        args += ["--request-rate", f"{request_rate:g}"]
    if workload.prefix_len:
        args += ["--random-prefix-len", str(workload.prefix_len)]
    return args


# The fields kept from `vllm bench serve`'s result JSON, under our names.
VLLM_BENCH_FIELDS = {
    "ttft_p50_ms": "median_ttft_ms",
    "ttft_p99_ms": "p99_ttft_ms",
    "tpot_p50_ms": "median_tpot_ms",
    "itl_p50_ms": "median_itl_ms",
    "e2e_p50_ms": "median_e2el_ms",
    "output_tokens_per_s": "output_throughput",
    "requests_per_s": "request_throughput",
    "duration_s": "duration",
    "completed": "completed",
    "total_output_tokens": "total_output_tokens",
}


# Per-request lists of a detailed result that are dropped from the saved file (its size: 128 numbers or a
# text per request); each request's start, TTFT, latency and lengths stay.
DETAIL_DROPPED = ("itls", "generated_texts")


def from_result(result: Mapping[str, Any]) -> dict[str, Any]:
    return {ours: result.get(theirs) for ours, theirs in VLLM_BENCH_FIELDS.items()} | {
        "start_gap_cv": start_gap_cv(result.get("start_times") or [], result.get("max_concurrency"))
    }


def start_gap_cv(start_times: list[float], concurrency: int | None) -> float | None:
    """How bunched the requests' starts were: the coefficient of variation of the gaps between successive
    starts, after the first `concurrency` (sent at once in a closed loop). About 1 for Poisson arrivals;
    above it, starts come in waves (a closed loop whose requests finish together sends the next ones
    together); below it, evenly spread. None with fewer than three gaps."""
    starts = sorted(start_times)[concurrency or 0 :]
    gaps = [b - a for a, b in zip(starts, starts[1:], strict=False)]
    if len(gaps) < 3:
        return None
    mean = statistics.fmean(gaps)
    return statistics.pstdev(gaps) / mean if mean > 0 else None


def run(argv: list[str]) -> dict[str, Any]:
    """Runs `vllm bench serve ARGV` in this process and returns its saved result (argv must save one)."""
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    args = parser.parse_args(argv)
    main(args)
    path = Path(args.result_dir) / args.result_filename
    result = json.loads(path.read_text())
    if any(k in result for k in DETAIL_DROPPED):
        result = {k: v for k, v in result.items() if k not in DETAIL_DROPPED}
        path.write_text(json.dumps(result))
    return result
