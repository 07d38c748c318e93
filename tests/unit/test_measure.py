"""The measurement core: TTFT, TPOT, ITL and e2e from a streamed body with a fake clock; the percentile."""

from __future__ import annotations

import json
import math

import pytest

from loadtests.measure import (
    EMPTY_RESPONSE,
    StepLatencies,
    StreamMeter,
    after_warmup,
    percentile,
    tpot_s,
)


def chat(content: str, **extra) -> str:
    return "data: " + json.dumps({"choices": [{"index": 0, "delta": {"content": content}}], **extra})


def completion(text: str) -> str:
    return "data: " + json.dumps({"choices": [{"index": 0, "text": text}]})


USAGE = "data: " + json.dumps({"choices": [], "usage": {"prompt_tokens": 17, "completion_tokens": 5}})


def feed(meter: StreamMeter, timed_lines: list[tuple[float, str]]) -> None:
    for now, line in timed_lines:
        if not meter.feed(line, now):
            break


def test_chat_stream_as_vllm_bench_serve_defines_it():
    meter = StreamMeter("chat", sent_at=10.0)
    feed(
        meter,
        [
            (10.05, chat("")),  # vLLM's role chunk: no text, not the first token
            (10.20, chat("a")),
            (10.21, ""),  # SSE separator
            (10.25, chat("b")),
            (10.40, chat("cde")),  # speculative decoding: several tokens in one chunk
            (10.41, USAGE),
            (10.42, "data: [DONE]"),
            (99.0, chat("after the end")),
        ],
    )
    r = meter.finish(end=10.50)  # [DONE] at 10.42 ends e2e, not when the body closed
    assert r.ok and r.tokens_from == "usage"
    assert r.ttft_s == pytest.approx(0.20)
    assert r.e2e_s == pytest.approx(0.42)
    assert r.output_tokens == 5 and r.prompt_tokens == 17 and r.chunks == 3
    assert r.tpot_s == pytest.approx((0.42 - 0.20) / 4)
    assert r.itl_mean_s == pytest.approx(0.10) and r.itl_max_s == pytest.approx(0.15)


def test_completions_without_usage_count_chunks():
    meter = StreamMeter("completions", sent_at=0.0)
    feed(meter, [(0.1, completion("x")), (0.2, completion("y")), (0.3, completion(""))])
    r = meter.finish(end=0.35)  # the body just closed: no [DONE]
    # The empty-text chunk is a token too (one that decodes to no text), as vllm bench serve counts it.
    assert (r.output_tokens, r.tokens_from, r.e2e_s) == (3, "chunks", pytest.approx(0.35))
    assert r.tpot_s == pytest.approx(0.125)


def test_a_completion_whose_tokens_decode_to_no_text_is_timed_not_failed():
    # Seen with the embedded random-weights model: 32 tokens, every chunk's text empty.
    meter = StreamMeter("completions", sent_at=0.0)
    usage = "data: " + json.dumps({"choices": [], "usage": {"completion_tokens": 2, "prompt_tokens": 5}})
    feed(meter, [(0.1, completion("")), (0.2, completion("")), (0.25, usage), (0.3, "data: [DONE]")])
    r = meter.finish(end=0.4)
    assert r.ok and r.ttft_s == pytest.approx(0.1) and (r.output_tokens, r.tokens_from) == (2, "usage")


def test_errors():
    meter = StreamMeter("chat", 0.0)
    feed(meter, [(0.1, chat("a")), (0.2, "data: " + json.dumps({"error": {"message": "engine dead"}}))])
    assert meter.finish(0.3).error == "stream error: engine dead"
    empty = StreamMeter("chat", 0.0)
    feed(empty, [(0.1, chat("")), (0.2, "data: [DONE]")])
    r = empty.finish(0.3)
    assert r.error == EMPTY_RESPONSE and r.ttft_s is None and r.tpot_s is None
    assert StreamMeter("chat", 0.0).finish(0.1, "HTTP 503: busy").error == "HTTP 503: busy"


def test_tpot_needs_two_tokens():
    assert tpot_s(1.0, 0.2, 5) == pytest.approx(0.2)
    assert tpot_s(1.0, 0.2, 1) is None and tpot_s(1.0, None, 5) is None


@pytest.mark.parametrize(("q", "expected"), [(0, 1.0), (50, 5.5), (95, 9.55), (100, 10.0)])
def test_percentile_is_linear_between_order_statistics(q, expected):
    assert percentile([7, 1, 10, 3, 2, 9, 4, 8, 6, 5], q) == pytest.approx(expected)
    assert math.isnan(percentile([], 50)) and percentile(iter([4.2]), 99) == 4.2


def test_warmup_keeps_requests_sent_after_the_first_seconds():
    assert after_warmup([5.0, 6.9, 7.0, 9.0], 2.0) == [False, False, True, True]
    assert after_warmup([5.0], 0.0) == [True]


def test_a_step_breaches_on_its_requests_after_the_warm_up():
    steps = StepLatencies()
    assert not steps.breached(0, 100)  # nothing finished yet: not a breach
    steps.add(0, 10.0, 0.500)  # in the warm-up: does not count
    for i in range(20):
        steps.add(0, 12.0 + i / 10, 0.050)
    assert not steps.breached(0, 100)
    steps.add(0, 14.5, 0.400)
    steps.add(0, 14.6, 0.400)
    assert steps.breached(0, 100)  # 2 of 22 above: the p95 is
    steps.add(1, 20.0, None)
    steps.add(1, 23.0, None)
    assert steps.breached(1, 100)  # every counted request failed
