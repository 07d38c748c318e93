"""The measurement core: one SSE parser, one definition of TTFT/TPOT/ITL, one percentile.

Every load generator here measures through `StreamMeter`: the Locust users (loadtests/locustfile.py, hence
the ladder and the rollout's smoke gate) and the asyncio streaming client behind the benchmarks
(loadtests/streaming_client.py). Every summary takes its percentiles from `percentile` (numpy's
linear interpolation): loadtests/raw_stats.py, the streaming client, the ladder.

Definitions, as `vllm bench serve` defines them (vllm/benchmarks/serve.py):
- TTFT: from just before the request is sent to the first streamed chunk that carries generated output.
  Completions: any chunk with a choice, whose text may be empty (a token that decodes to no text: vLLM
  sends a chunk per step's tokens, and `vllm bench serve` counts it). Chat: a delta with content, reasoning
  or tool calls; vLLM's first chat chunk, the role with empty content, does not count (`vllm bench serve`
  counts it).
- e2e: from the same start to the end of the stream (`data: [DONE]`, or the body's end).
- output tokens: `usage.completion_tokens` of the server's final chunk (`stream_options.include_usage`);
  a server that sends no usage falls back to the number of chunks with output (`tokens_from: "chunks"`).
- TPOT: (e2e - TTFT) / (output tokens - 1), for requests with at least 2 output tokens.
- ITL: gaps between consecutive chunks with output, per request their mean and max. With speculative
  decoding one chunk can carry several tokens, so gaps can exceed TPOT.

Pure: the caller reads the stream and passes each line with its own clock's reading, so the definitions
are tested with a fake clock, and sync (Locust) and async (httpx) clients share them.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import numpy as np

Api = Literal["chat", "completions"]
API_PATHS: dict[str, str] = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
EMPTY_RESPONSE = "empty response: no chunk with generated output"
# A ladder step's first seconds hold the previous step's requests still draining and the new users
# ramping: its statistics (the Locust shape's SLO check, the ladder's report) count only requests sent
# after them.
STEP_WARMUP_S = 2.0


def percentile(values: Iterable[float], q: float) -> float:
    """The q-th percentile (q in [0, 100]), linearly interpolated between order statistics (numpy's
    default, and what `vllm bench serve` reports); NaN for no values."""
    data = np.asarray(list(values), dtype=float)
    return float(np.percentile(data, q)) if data.size else float("nan")


def tpot_s(e2e_s: float, ttft_s: float | None, output_tokens: int) -> float | None:
    """Time per output token after the first: (e2e - TTFT) / (tokens - 1); None below 2 tokens."""
    if ttft_s is None or output_tokens < 2:
        return None
    return (e2e_s - ttft_s) / (output_tokens - 1)


def carries_output(event: Mapping[str, Any], api: str) -> bool:
    """Whether a streamed event carries generated output (the first such event is the first token)."""
    choices = event.get("choices") or []
    if not choices:
        return False
    choice = choices[0]
    if api == "completions":
        return "text" in choice
    delta = choice.get("delta") or {}
    return bool(
        delta.get("content")
        or delta.get("reasoning_content")
        or delta.get("reasoning")
        or delta.get("tool_calls")
    )


@dataclass(frozen=True)
class RequestResult:
    """One streamed request, measured. Times in seconds; `error` is None for a success."""

    ttft_s: float | None
    tpot_s: float | None
    e2e_s: float
    output_tokens: int
    itl_mean_s: float | None = None
    itl_max_s: float | None = None
    chunks: int = 0
    prompt_tokens: int | None = None
    tokens_from: Literal["usage", "chunks"] = "usage"
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class StreamMeter:
    """Times one streamed OpenAI response: `feed` each line of the body as it arrives with the clock's
    reading, then `finish` at the end of the stream. `sent_at` is the same clock just before sending."""

    def __init__(self, api: str, sent_at: float):
        self.api = api
        self.sent_at = sent_at
        self.first_at: float | None = None
        self.last_at: float | None = None
        self.gaps_sum_s = 0.0
        self.gaps_max_s = 0.0
        self.chunks = 0
        self.usage: dict[str, Any] = {}
        self.stream_error: str | None = None
        self.ended_at: float | None = None

    def feed(self, line: bytes | str, now: float) -> bool:
        """One line of the SSE body; False once the stream has ended (`[DONE]` or an error event), after
        which further lines are ignored: a client may drain the body to keep its connection."""
        if self.ended_at is not None:
            return False
        text = line.decode() if isinstance(line, bytes) else line
        if not text.startswith("data:"):
            return True  # blank separators, comments, other SSE fields
        data = text[5:].strip()
        if data == "[DONE]":
            self.ended_at = now
            return False
        event = json.loads(data)
        if event.get("error"):
            err = event["error"]
            self.stream_error = f"stream error: {err.get('message', err) if isinstance(err, dict) else err}"
            self.ended_at = now
            return False
        if carries_output(event, self.api):
            if self.first_at is not None and self.last_at is not None:
                gap = now - self.last_at
                self.gaps_sum_s += gap
                self.gaps_max_s = max(self.gaps_max_s, gap)
            else:
                self.first_at = now
            self.last_at = now
            self.chunks += 1
        if event.get("usage"):
            self.usage = event["usage"]
        return True

    @property
    def error(self) -> str | None:
        """What was wrong with the stream itself: an error event, or no generated output at all."""
        if self.stream_error is not None:
            return self.stream_error
        return EMPTY_RESPONSE if self.first_at is None else None

    def finish(self, end: float, transport_error: str | None = None) -> RequestResult:
        """The request's measurements; e2e ends at `[DONE]` when it came, else at `end` (a body that just
        closes). `transport_error` (HTTP status, broken connection) wins over the stream's own error."""
        completion = self.usage.get("completion_tokens")
        tokens = int(completion if completion is not None else self.chunks)
        e2e = (self.ended_at if self.ended_at is not None else end) - self.sent_at
        ttft = self.first_at - self.sent_at if self.first_at is not None else None
        gapped = self.chunks > 1
        return RequestResult(
            ttft_s=ttft,
            tpot_s=tpot_s(e2e, ttft, tokens),
            e2e_s=e2e,
            output_tokens=tokens,
            itl_mean_s=self.gaps_sum_s / (self.chunks - 1) if gapped else None,
            itl_max_s=self.gaps_max_s if gapped else None,
            chunks=self.chunks,
            prompt_tokens=self.usage.get("prompt_tokens"),
            tokens_from="usage" if completion is not None else "chunks",
            error=transport_error or self.error,
        )


def after_warmup(starts_s: list[float], warmup_s: float) -> list[bool]:
    """Which requests count: those sent at least `warmup_s` after the group's first send."""
    if not starts_s or warmup_s <= 0:
        return [True] * len(starts_s)
    t0 = min(starts_s)
    return [s >= t0 + warmup_s for s in starts_s]


@dataclass
class StepLatencies:
    """What each ladder step's finished requests measured, (send time, TTFT or None for a failure): the
    Locust users add to it, the ladder shape asks whether a step breached its TTFT bound."""

    samples: dict[int, list[tuple[float, float | None]]] = field(default_factory=dict)

    def add(self, step_index: int, start_s: float, ttft_s: float | None) -> None:
        self.samples.setdefault(step_index, []).append((start_s, ttft_s))

    def breached(self, step_index: int, ttft_p95_ms: float) -> bool:
        """Whether the step breached: TTFT p95 after its warm-up above the bound, or every request failed.
        False while nothing has finished (unknown is not a breach)."""
        rows = self.samples.get(step_index, [])
        keep = after_warmup([start for start, _ in rows], STEP_WARMUP_S)
        counted = [ttft for (_, ttft), counts in zip(rows, keep, strict=True) if counts]
        if not counted:
            return False
        ok = [ttft for ttft in counted if ttft is not None]
        return not ok or percentile(ok, 95) * 1000 > ttft_p95_ms
