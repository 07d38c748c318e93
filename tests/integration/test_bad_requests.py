"""Bad requests get OpenAI-style error JSON with the right 4xx, and the server keeps serving."""

from __future__ import annotations

import httpx
import pytest

pytestmark = pytest.mark.integration

MODEL = "tiny-qwen3"
MSG = [{"role": "user", "content": "hi"}]

# (case, method, path, json body or raw bytes, expected status, words the message must contain)
BAD_REQUESTS = [
    (
        "negative max_tokens",
        "POST",
        "/v1/chat/completions",
        {"model": MODEL, "messages": MSG, "max_tokens": -1},
        400,
        ["max_tokens"],
    ),
    (
        "prompt over max_model_len",
        "POST",
        "/v1/completions",
        {"model": MODEL, "prompt": "token " * 3000, "max_tokens": 4},
        400,
        ["2048"],
    ),
    # OpenAI's API and vLLM answer an unknown model with 404 model-not-found; the client raises NotFoundError.
    ("unknown model", "POST", "/v1/chat/completions", {"model": "gpt-9", "messages": MSG}, 404, ["gpt-9"]),
    (
        "negative temperature",
        "POST",
        "/v1/chat/completions",
        {"model": MODEL, "messages": MSG, "temperature": -1},
        400,
        ["temperature"],
    ),
    (
        "top_p above 1",
        "POST",
        "/v1/chat/completions",
        {"model": MODEL, "messages": MSG, "top_p": 2.0},
        400,
        ["top_p"],
    ),
    ("missing messages", "POST", "/v1/chat/completions", {"model": MODEL}, 400, ["messages"]),
    (
        "messages not a list",
        "POST",
        "/v1/chat/completions",
        {"model": MODEL, "messages": "hello"},
        400,
        ["messages"],
    ),
    ("n is zero", "POST", "/v1/completions", {"model": MODEL, "prompt": "a", "n": 0}, 400, ["n"]),
    ("malformed JSON", "POST", "/v1/chat/completions", b'{"model": "tiny-qwen3", "messages": [', 400, []),
    (
        "max_tokens beyond context",
        "POST",
        "/v1/completions",
        {"model": MODEL, "prompt": "a b c", "max_tokens": 4096},
        400,
        ["max_tokens"],
    ),
    ("unknown route", "POST", "/v1/chat/complete", {"model": MODEL}, 404, ["/v1/chat/complete"]),
    ("wrong method", "GET", "/v1/chat/completions", None, 405, ["GET"]),
]


@pytest.mark.parametrize("case,method,path,body,status,words", BAD_REQUESTS, ids=[c[0] for c in BAD_REQUESTS])
def test_bad_request_gets_openai_error(cluster, case, method, path, body, status, words):
    kwargs = (
        {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) else {}
    )
    if isinstance(body, dict):
        kwargs = {"json": body}
    r = httpx.request(method, cluster.base_url + path, timeout=30, **kwargs)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["message"] and error["type"]
    assert error["code"] == status
    for word in words:
        assert word in error["message"], error["message"]


def test_server_keeps_serving_after_bad_requests(cluster):
    for _, method, path, body, *_ in BAD_REQUESTS:
        httpx.request(
            method, cluster.base_url + path, json=body if isinstance(body, dict) else None, timeout=30
        )
    r = cluster.client().chat.completions.create(model=MODEL, messages=MSG, max_tokens=4)
    assert r.choices[0].message.content is not None
