"""A small closed-loop streaming load generator for OpenAI-compatible servers, used by the benchmarks
(loadtests/bench_overhead.py, loadtests/gpu/scale.py, loadtests/vllm_bench_agreement.py) and the ladder's
warm-up.

Each of `concurrency` workers sends its next request as soon as the previous one finishes. Every request is
measured by loadtests/measure.py's StreamMeter (TTFT, TPOT, ITL as `vllm bench serve` defines them), and
summaries use its `percentile`. A benchmark must not average failures into its numbers, so a failed
request raises (`StreamError` for a stream that broke or carried no text, httpx's errors otherwise).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict, dataclass

import httpx

from loadtests.measure import API_PATHS, RequestResult, StreamMeter, percentile

__all__ = ["LoadSummary", "RequestResult", "StreamError", "one_request", "percentile", "prompts", "run_load"]


class StreamError(httpx.HTTPError):
    """The server answered 200 but the stream carried an error event or no generated text."""


@dataclass(frozen=True)
class LoadSummary:
    concurrency: int
    requests: int
    ttft_p50_ms: float
    ttft_p99_ms: float
    tpot_p50_ms: float
    e2e_p50_ms: float
    output_tokens_per_s: float
    duration_s: float

    def as_dict(self) -> dict:
        return asdict(self)


def prompts(n: int, words: int = 48) -> list[str]:
    """Deterministic distinct prompts of about the same length (distinct, so no prefix-cache reuse)."""
    vocab = "batch cache token replica latency queue prefix engine memory budget scale request".split()
    return [
        f"Request {i}: " + " ".join(vocab[(i * 7 + j * 3) % len(vocab)] for j in range(words))
        for i in range(n)
    ]


async def one_request(
    client: httpx.AsyncClient, url: str, model: str, prompt: str, max_tokens: int
) -> RequestResult:
    """One streaming completion of exactly `max_tokens` tokens (ignore_eos), measured."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
        "temperature": 0.0,
    }
    meter = StreamMeter("completions", time.perf_counter())
    async with client.stream("POST", url, json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():  # read to the end: the connection goes back to the pool
            meter.feed(line, time.perf_counter())
    result = meter.finish(time.perf_counter())
    if result.error is not None:
        raise StreamError(f"{url}: {result.error}")
    return result


async def run_load(
    base_url: str, model: str, concurrency: int, num_requests: int, max_tokens: int, prompt_words: int = 48
) -> tuple[LoadSummary, list[RequestResult]]:
    """Sends `num_requests` streaming completions with `concurrency` in flight; returns the summary."""
    url = base_url.rstrip("/") + API_PATHS["completions"]
    queue = list(prompts(num_requests, prompt_words))
    results: list[RequestResult] = []
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)

    async with httpx.AsyncClient(timeout=600, limits=limits) as client:

        async def worker() -> None:
            while queue:
                prompt = queue.pop()
                results.append(await one_request(client, url, model, prompt, max_tokens))

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        duration = time.perf_counter() - start

    ttfts = [r.ttft_s for r in results if r.ttft_s is not None]
    summary = LoadSummary(
        concurrency=concurrency,
        requests=len(results),
        ttft_p50_ms=percentile(ttfts, 50) * 1000,
        ttft_p99_ms=percentile(ttfts, 99) * 1000,
        tpot_p50_ms=percentile([r.tpot_s for r in results if r.tpot_s is not None], 50) * 1000,
        e2e_p50_ms=percentile([r.e2e_s for r in results], 50) * 1000,
        output_tokens_per_s=sum(r.output_tokens for r in results) / duration,
        duration_s=duration,
    )
    return summary, results
