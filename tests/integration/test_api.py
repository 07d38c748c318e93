"""The OpenAI API served by headroom on Ray Serve, through the official openai client."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

pytestmark = pytest.mark.integration

MODEL = "tiny-qwen3"
HELLO = [{"role": "user", "content": "Say hello to the batch scheduler."}]


def test_models_list(cluster):
    models = cluster.client().models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].max_model_len == 2048


def test_chat_completion(cluster):
    r = cluster.client().chat.completions.create(
        model=MODEL, messages=HELLO, max_tokens=16, extra_body={"ignore_eos": True}
    )
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 16
    assert r.usage.prompt_tokens > 5


def test_chat_completion_streaming(cluster):
    stream = cluster.client().chat.completions.create(
        model=MODEL,
        messages=HELLO,
        max_tokens=12,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert text
    assert finish == ["length"]
    assert chunks[-1].usage.completion_tokens == 12
    # Tokens arrive as separate events (no batching into one chunk): more content chunks than one.
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) > 3


def test_completion(cluster):
    r = cluster.client().completions.create(
        model=MODEL, prompt="SELECT name FROM users WHERE", max_tokens=10, extra_body={"ignore_eos": True}
    )
    assert r.object == "text_completion"
    assert r.choices[0].text
    assert r.usage.completion_tokens == 10


def test_completion_streaming(cluster):
    stream = cluster.client().completions.create(
        model=MODEL, prompt="def get_user(id):", max_tokens=10, stream=True, extra_body={"ignore_eos": True}
    )
    pieces = [c.choices[0].text for c in stream if c.choices]
    assert len([p for p in pieces if p]) >= 3
    assert "".join(pieces)


def test_health(cluster):
    import httpx

    assert httpx.get(f"{cluster.base_url}/health", timeout=10).status_code == 200


def test_sixteen_concurrent_requests_all_complete(cluster):
    client = cluster.client(timeout=300)

    def one(i: int):
        stream = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": f"Request number {i}: describe the queue."}],
            max_tokens=48,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        chunks = list(stream)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        return finish, chunks[-1].usage.completion_tokens

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(one, range(16)))
    assert results == [(["length"], 48)] * 16
