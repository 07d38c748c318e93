"""A small closed-loop streaming load generator for OpenAI-compatible servers, used by the benchmarks.

Each of `concurrency` workers sends its next request as soon as the previous one finishes. Per request it
records TTFT (send -> first content token), TPOT ((e2e - TTFT) / (output tokens - 1), as `vllm bench
serve` defines it), end-to-end latency and output tokens (from the server's usage record).
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from dataclasses import asdict, dataclass

import httpx


@dataclass(frozen=True)
class RequestResult:
    ttft_s: float
    tpot_s: float | None
    e2e_s: float
    output_tokens: int


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


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), q in [0, 100]."""
    data = sorted(values)
    if not data:
        return float("nan")
    pos = (len(data) - 1) * q / 100
    lo, hi = int(pos), min(int(pos) + 1, len(data) - 1)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


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
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
        "temperature": 0.0,
    }
    start = time.perf_counter()
    first = None
    tokens = 0
    async with client.stream("POST", url, json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if first is None and event.get("choices") and event["choices"][0].get("text"):
                first = time.perf_counter()
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    end = time.perf_counter()
    first = first if first is not None else end
    tpot = (end - first) / (tokens - 1) if tokens > 1 else None
    return RequestResult(first - start, tpot, end - start, tokens)


async def run_load(
    base_url: str, model: str, concurrency: int, num_requests: int, max_tokens: int, prompt_words: int = 48
) -> tuple[LoadSummary, list[RequestResult]]:
    """Sends `num_requests` streaming completions with `concurrency` in flight; returns the summary."""
    url = base_url.rstrip("/") + "/v1/completions"
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

    tpots = [r.tpot_s for r in results if r.tpot_s is not None]
    summary = LoadSummary(
        concurrency=concurrency,
        requests=len(results),
        ttft_p50_ms=percentile([r.ttft_s for r in results], 50) * 1000,
        ttft_p99_ms=percentile([r.ttft_s for r in results], 99) * 1000,
        tpot_p50_ms=statistics.median(tpots) * 1000 if tpots else float("nan"),
        e2e_p50_ms=percentile([r.e2e_s for r in results], 50) * 1000,
        output_tokens_per_s=sum(r.output_tokens for r in results) / duration,
        duration_s=duration,
    )
    return summary, results
