"""Closed-loop streaming clients that keep every attempt, refusals included: what the overload and
failure drills (tests/integration/test_security_overload.py) and the overload benchmark
(loadtests/bench_security.py) measure TTFT, refusal latency and failures with.

A refused client waits the Retry-After it was given, as OpenAI's clients do (no jitter).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from loadtests.streaming_client import percentile, prompts


@dataclass
class Outcome:
    """One attempt: `request` is (user, sequence number), the same for the retries of a request."""

    request: tuple[int, int]
    max_tokens: int
    started_s: float  # time.monotonic() when sent
    status: int = 0  # the HTTP status (0: the connection failed)
    ttft_s: float | None = None  # to the first content token
    refused_in_s: float | None = None  # to the response, for a status other than 200
    retry_after: str | None = None
    error_json: bool = False  # a refusal's body was OpenAI's error JSON
    tokens: int = 0
    error: str = ""  # a transport error or an error event; for a refusal not in JSON, its body

    @property
    def closed_unanswered(self) -> bool:
        """HAProxy closed a kept-alive connection with no response, its sign that the request went out on a
        pooled connection the replica closed as it exited: the client is to send it again (OpenAI's clients
        do, by default)."""
        return self.status == 0 and "without sending a response" in self.error

    @property
    def completed(self) -> bool:
        return self.status == 200 and self.tokens == self.max_tokens and not self.error


async def one_stream(
    client: httpx.AsyncClient, url: str, model: str, prompt: str, max_tokens: int, request: tuple[int, int]
) -> Outcome:
    """A streamed completion of exactly max_tokens tokens."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    body["stream_options"] = {"include_usage": True}
    out = Outcome(request, max_tokens, time.monotonic())
    try:
        async with client.stream("POST", url, json=body) as r:
            out.status = r.status_code
            if r.status_code != 200:
                out.refused_in_s = time.monotonic() - out.started_s
                out.retry_after = r.headers.get("retry-after")
                text = await r.aread()
                out.error_json = text.startswith(b"{") and "error" in json.loads(text)
                if not out.error_json:  # whose refusal it was (Serve's, HAProxy's)
                    out.error = text[:120].decode(errors="replace")
                return out
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    out.error = str(event["error"])[:200]
                elif out.ttft_s is None and event.get("choices") and event["choices"][0].get("text"):
                    out.ttft_s = time.monotonic() - out.started_s
                if event.get("usage"):
                    out.tokens = event["usage"]["completion_tokens"]
    except httpx.HTTPError as err:
        out.error = f"{type(err).__name__}: {err}"
    return out


async def closed_loop(
    url: str,
    model: str,
    headers: dict,
    users: int,
    duration_s: float,
    max_tokens: int = 16,
    retries: int = 0,
    ramp_s: float = 0,
) -> list[Outcome]:
    """`users` clients, each sending its next stream when the last ends, for duration_s; client u starts
    u * ramp_s / users in. A refused client waits Retry-After first; with retries > 0, a refused request is
    sent again (the same request, the same `Outcome.request`), as is one HAProxy closed unanswered."""
    outcomes: list[Outcome] = []
    texts = prompts(users * 4000, words=12)
    limits = httpx.Limits(max_connections=users, max_keepalive_connections=users)
    async with httpx.AsyncClient(timeout=120, headers=headers, limits=limits) as client:
        deadline = time.monotonic() + duration_s

        async def user(u: int) -> None:
            await asyncio.sleep(u * ramp_s / users)
            i = 0
            while time.monotonic() < deadline:
                prompt = texts[(u * 4000 + i) % len(texts)]
                i += 1
                for _ in range(retries + 1):
                    out = await one_stream(client, url, model, prompt, max_tokens, (u, i))
                    outcomes.append(out)
                    if out.retry_after is None and not out.closed_unanswered:
                        break
                    await asyncio.sleep(float(out.retry_after or 0.5))  # 0.5 s: OpenAI's first retry

        await asyncio.gather(*(user(u) for u in range(users)))
    return outcomes


def by_request(outcomes: list[Outcome]) -> dict[tuple[int, int], list[Outcome]]:
    """Each request's attempts, in the order they were sent."""
    attempts: dict[tuple[int, int], list[Outcome]] = {}
    for o in outcomes:
        attempts.setdefault(o.request, []).append(o)
    return attempts


def stats_ms(values_s: list[float]) -> dict[str, float]:
    """Count, p50, p99 and max, in milliseconds, of values in seconds."""
    ms = [v * 1000 for v in values_s]
    if not ms:
        return {"n": 0}
    return {"n": len(ms), "p50": percentile(ms, 50), "p99": percentile(ms, 99), "max": max(ms)}


def replica_refusal_ms(pids: set[int], route_prefix: str, since: str) -> list[float]:
    """Each refusal's latency as the replica measured it: Ray Serve's request log in the replica workers'
    stderr ('... -- POST /secure 503 3.1ms'), lines stamped at or after `since` ('%Y-%m-%d %H:%M:%S'),
    from the session of the Ray cluster this process is connected to."""
    import ray

    logs = Path(ray._private.worker._global_node.get_session_dir_path()) / "logs"
    latencies = []
    for path in logs.glob("worker-*.err"):
        if int(path.stem.rsplit("-", 1)[1]) in pids:
            for line in path.read_text(errors="replace").splitlines():
                stamp = " ".join(line.split()[1:3])
                if f" -- POST {route_prefix} 503 " in line and stamp >= since:
                    latencies.append(float(line.rsplit(" ", 1)[1].removesuffix("ms")))
    return latencies


LAG_PROBE_S = 0.01  # how often the drill's client checks how late its own event loop wakes up


class LoopLag:
    """The load generator's own event-loop lag, by phase: a client TTFT includes the time this loop took to
    get to the response, so a tail here is the load generator's, not the server's."""

    def __init__(self) -> None:
        self.phase = "safe"
        self.seconds: dict[str, list[float]] = {"safe": [], "4x": []}

    async def run(self) -> None:
        while True:
            asked = time.monotonic()
            await asyncio.sleep(LAG_PROBE_S)
            self.seconds[self.phase].append(time.monotonic() - asked - LAG_PROBE_S)


@dataclass
class DrillResult:
    """An overload drill: the attempts at safe concurrency and at 4x it (warm-up left out), and a report of
    TTFT, refusal latency (at the client and at the replica) and /health latency, in milliseconds, and of
    the requests and refusals at safe concurrency, counted."""

    baseline: list[Outcome]
    overload: list[Outcome]
    report: dict


async def overload_drill(
    base_url: str,
    model: str,
    headers: dict,
    safe: int,
    replica_pids: set[int],
    route_prefix: str,
    overload_s: float = 60,
    baseline_s: float = 20,
    warmup_s: float = 5,
    every_5s=None,
) -> DrillResult:
    """`safe` clients for baseline_s, then 4 * safe clients for overload_s, ramped in and with the first
    warmup_s of each phase left out (the ramp and the clients' first Retry-After). `every_5s()` is called
    every 5 s during the overload (e.g. to sample memory); /health is probed every 100 ms meanwhile.

    At safe concurrency a refused client sends its request once more after Retry-After, as OpenAI's
    clients do: HAProxy's least-connections count of a replica lags the replica by the streams that have
    just ended there, so when a replica's whole batch ends together, one of its clients' next requests can
    go to the other replica, over its bound, while this one has room (docs/security.md, Overload)."""
    url = f"{base_url}/v1/completions"
    await closed_loop(url, model, headers, safe, warmup_s)
    lag = LoopLag()
    lag_task = asyncio.create_task(lag.run())
    start = time.monotonic()
    baseline = await closed_loop(url, model, headers, safe, baseline_s, retries=1, ramp_s=1)
    baseline = [o for o in baseline if o.started_s > start + 2]
    lag.phase = "4x"
    health_s: list[float] = []

    async def sample() -> None:
        while every_5s is not None:
            every_5s()
            await asyncio.sleep(5)

    async def probe() -> None:
        async with httpx.AsyncClient(timeout=30) as client:
            while True:
                sent = time.monotonic()
                await client.get(f"{base_url}/health")
                health_s.append(time.monotonic() - sent)
                await asyncio.sleep(0.1)

    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(time.time() + warmup_s))
    start = time.monotonic()
    helpers = [asyncio.create_task(sample()), asyncio.create_task(probe()), lag_task]
    try:
        every = await closed_loop(url, model, headers, 4 * safe, overload_s, ramp_s=2)
    finally:
        for task in helpers:
            task.cancel()
    over = [o for o in every if o.started_s > start + warmup_s]
    refused = [o for o in over if o.status in (429, 503)]
    report = {
        "ttft at safe concurrency": stats_ms([o.ttft_s for o in baseline if o.completed and o.ttft_s]),
        "requests at safe concurrency": len({o.request for o in baseline}),
        "refused at safe concurrency": sum(o.status in (429, 503) for o in baseline),
        "ttft admitted at 4x": stats_ms([o.ttft_s for o in over if o.completed and o.ttft_s]),
        "refusal, client": stats_ms([o.refused_in_s for o in refused if o.refused_in_s is not None]),
        "refusal, replica": stats_ms(
            [v / 1000 for v in replica_refusal_ms(replica_pids, route_prefix, since)]
        ),
        "health, client": stats_ms(health_s[int(warmup_s * 10) :]),
        "client loop lag at safe concurrency": stats_ms(lag.seconds["safe"]),
        "client loop lag at 4x": stats_ms(lag.seconds["4x"][int(warmup_s / LAG_PROBE_S) :]),
    }
    return DrillResult(baseline, every, report)
