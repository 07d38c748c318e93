"""`vllm bench serve`, vLLM's own load generator, as the reference client of headroom's benchmarks.

Run in-process (the CPU build of vLLM has no `vllm` console script): `run(argv)` parses the arguments with
vLLM's own parser and returns the JSON it saved. `bench_args` builds the command line for one closed-loop
cell (all requests queued at once, `concurrency` in flight), so every benchmark asks it the same way, and
the report can print the exact command (`vllm bench serve ` + the arguments).

Workloads are shaped as the random dataset makes them: token counts, not words.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
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
# text per request); each request's start, TTFT and lengths stay, and its latency is kept as `e2els`.
DETAIL_DROPPED = ("itls", "generated_texts")

# The window of `starts_nearby`: a few decode steps of an 8B model on an H200 (about 8 ms each), well under
# one 8,192-token prefill step (about 190 ms), so requests sent on the same few completions count together.
NEARBY_S = 0.05


def from_result(result: Mapping[str, Any]) -> dict[str, Any]:
    return {ours: result.get(theirs) for ours, theirs in VLLM_BENCH_FIELDS.items()} | {
        "starts_within_50ms": starts_nearby(result.get("start_times") or [], result.get("max_concurrency"))
    }


def starts_nearby(
    start_times: list[float], concurrency: int | None, window_s: float = NEARBY_S
) -> float | None:
    """How bunched the requests' starts were: the median, over requests, of how many other requests
    started within `window_s` either side of it, leaving out the first `concurrency` (sent at once in a
    closed loop). Poisson arrivals at 20/s give about 2. A closed loop whose requests finish in the same few
    engine steps sends the next ones together: up to concurrency - 1. None with fewer than two starts.

    Not the spread of the gaps between starts: a loop whose cycles come in groups (a few requests in one
    decode step, the next a prefill step later) has gaps as uneven as one whose whole cycle starts at once,
    and the two serve very different first-token times."""
    starts = sorted(start_times)[concurrency or 0 :]
    if len(starts) < 2:
        return None
    counts = [
        bisect.bisect_right(starts, s + window_s) - bisect.bisect_left(starts, s - window_s) - 1
        for s in starts
    ]
    return float(statistics.median(counts))


def with_latencies(result: dict[str, Any]) -> dict[str, Any]:
    """The result with each request's end-to-end latency (`e2els`, seconds: its TTFT plus its inter-token
    gaps), computed before `itls` is dropped, so that a request's end can be paired with the next start."""
    ttfts, itls = result.get("ttfts"), result.get("itls")
    if ttfts is None or itls is None or "e2els" in result:
        return result
    return result | {"e2els": [t + sum(gaps) for t, gaps in zip(ttfts, itls, strict=True)]}


@contextlib.contextmanager
def wait_before_each_request(delay_s: float):
    """A context in which `vllm bench serve` waits `delay_s` before sending each request, inside its
    concurrency slot: a closed loop whose turnaround (a request's end to the next one's start at the server)
    is longer by that much, the rest of the path unchanged. TTFT is still timed from the send."""
    if delay_s <= 0:
        yield
        return
    from vllm.benchmarks import serve

    funcs = serve.ASYNC_REQUEST_FUNCS
    saved = dict(funcs)

    def delayed(func):
        async def request_after_delay(*args, **kwargs):
            await asyncio.sleep(delay_s)
            return await func(*args, **kwargs)

        return request_after_delay

    funcs.update({name: delayed(func) for name, func in saved.items()})
    try:
        yield
    finally:
        funcs.clear()
        funcs.update(saved)


def run(argv: list[str], delay_s: float = 0.0) -> dict[str, Any]:
    """Runs `vllm bench serve ARGV` in this process and returns its saved result (argv must save one);
    with `delay_s`, each request is sent that much after its slot frees (wait_before_each_request)."""
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    args = parser.parse_args(argv)
    with wait_before_each_request(delay_s):
        main(args)
    path = Path(args.result_dir) / args.result_filename
    result = json.loads(path.read_text())
    if any(k in result for k in DETAIL_DROPPED):
        result = {k: v for k, v in with_latencies(result).items() if k not in DETAIL_DROPPED}
        path.write_text(json.dumps(result))
    return result
