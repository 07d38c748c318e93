"""The replica's ASGI layer (serving/asgi.py) in front of a stand-in app, driven with raw ASGI messages.

vLLM's app itself, behind the layer, is exercised by tests/integration/test_security.py; here the stand-in
records what reached it, so each refusal is shown to happen before the app (and before the body is read).
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from autoscale import replica_stats as report_keys
from autoscale.replica_stats import ReplicaStatsWindow
from serve_app.config.security import APIKeysSource, RequestLimits, SecuritySection
from serve_app.serving.asgi import ReplicaASGI
from serve_app.serving.metrics import ServingMetrics

KEYS = ["key-one", "key-two"]
SECURITY = SecuritySection(
    api_keys=APIKeysSource(env="KEYS"),
    metrics="api_key",
    limits=RequestLimits(max_body_bytes=1024, max_n=2, max_tokens=8),
)


class StandIn:
    """The inner app: answers 200 with the body it read; `hold` keeps generation requests open."""

    def __init__(self):
        self.calls: list[tuple[str, bytes]] = []
        self.hold: asyncio.Event | None = None

    async def __call__(self, scope, receive, send):
        message = await receive()
        self.calls.append((scope["path"], message.get("body", b"")))
        if self.hold is not None:
            await self.hold.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": message.get("body", b"")})


def layer(security=SECURITY, keys=KEYS, bound=None) -> tuple[ReplicaASGI, StandIn]:
    inner = StandIn()
    metrics = ServingMetrics({"application": "unit"}, ReplicaStatsWindow(10))
    return ReplicaASGI(inner, metrics, security, keys, bound), inner


async def call(app, method, path, body=b"", headers=(), chunks=None, key="key-one", on_send=None):
    """Sends one request; returns (status, headers, body, how many times the layer called receive).
    `on_send(message)` runs as each message is sent."""
    pieces = list(chunks) if chunks is not None else [body]
    hdrs = [(k.encode(), v.encode()) for k, v in headers]
    if key is not None:
        hdrs.append((b"authorization", f"Bearer {key}".encode()))
    if chunks is None:
        hdrs.append((b"content-length", str(len(body)).encode()))
    scope = {"type": "http", "method": method, "path": path, "root_path": "", "headers": hdrs}
    received = 0

    async def receive():
        nonlocal received
        received += 1
        if received <= len(pieces):
            return {"type": "http.request", "body": pieces[received - 1], "more_body": received < len(pieces)}
        await asyncio.sleep(3600)  # the client stays connected

    sent: list[dict] = []

    async def send(message):
        sent.append(message)
        if on_send is not None:
            on_send(message)

    await app(scope, receive, send)
    start = next(m for m in sent if m["type"] == "http.response.start")
    text = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return start["status"], dict(start["headers"]), text, received


def run(coro):
    return asyncio.run(coro)


def error_of(body: bytes) -> dict:
    return json.loads(body)["error"]


CHAT = "/v1/chat/completions"

# (case, request kwargs, status, param named, whether the app saw it)
CASES = [
    ("allowed and keyed", dict(method="POST", path=CHAT, body=b'{"n": 2}'), 200, None, True),
    ("second key", dict(method="POST", path=CHAT, body=b"{}", key="key-two"), 200, None, True),
    ("no key", dict(method="POST", path=CHAT, body=b"{}", key=None), 401, None, False),
    ("wrong key", dict(method="POST", path=CHAT, body=b"{}", key="key-three"), 401, None, False),
    ("health without key", dict(method="GET", path="/health", key=None), 200, None, True),
    ("metrics behind key", dict(method="GET", path="/metrics", key=None), 401, None, False),
    ("metrics prefix is not metrics", dict(method="GET", path="/metricsfoo"), 404, None, False),
    ("admin route", dict(method="POST", path="/scale_elastic_ep", body=b"{}"), 404, None, False),
    ("unopened tokenize", dict(method="POST", path="/tokenize", body=b"{}"), 404, None, False),
    ("trailing slash", dict(method="GET", path="/v1/models/"), 404, None, False),
    ("wrong method", dict(method="GET", path=CHAT), 405, None, False),
    ("invalid UTF-8", dict(method="POST", path=CHAT, body=b'{"a": "\xff"}'), 400, None, False),
    ("invalid JSON", dict(method="POST", path=CHAT, body=b'{"model": '), 400, None, False),
    ("n over", dict(method="POST", path=CHAT, body=b'{"n": 3}'), 400, "n", False),
    ("max_tokens over", dict(method="POST", path=CHAT, body=b'{"max_tokens": 9}'), 400, "max_tokens", False),
    ("JSON that is not an object goes to vLLM", dict(method="POST", path=CHAT, body=b"[1]"), 200, None, True),
]


@pytest.mark.parametrize("case,request_kwargs,status,param,reached", CASES, ids=[c[0] for c in CASES])
def test_each_request_is_answered_by_the_layer_or_passed_on(case, request_kwargs, status, param, reached):
    app, inner = layer()
    got, headers, body, _ = run(call(app, **request_kwargs))
    assert got == status, body
    assert bool(inner.calls) is reached
    if status >= 400:
        error = error_of(body)
        assert (error["code"], error["param"]) == (status, param)
        assert headers[b"content-type"] == b"application/json"
    if status == 401:
        assert headers[b"www-authenticate"] == b"Bearer"


def test_without_keys_configured_no_route_asks_for_one():
    app, _ = layer(SecuritySection(), keys=None)
    assert run(call(app, "GET", "/metrics", key=None))[0] == 200
    assert run(call(app, "POST", CHAT, b"{}", key=None))[0] == 200


def test_the_body_reaches_the_app_as_sent_across_chunks():
    app, inner = layer()
    status, _, body, _ = run(call(app, "POST", CHAT, chunks=[b'{"messages": ', b"[]", b"}"]))
    assert status == 200 and body == b'{"messages": []}'
    assert inner.calls == [(CHAT, b'{"messages": []}')]


def test_an_oversized_body_is_refused_from_its_length_before_any_of_it_is_read():
    app, inner = layer()
    status, headers, body, received = run(call(app, "POST", CHAT, b"x" * 2000))
    assert status == 413 and received == 0 and not inner.calls
    assert headers[b"connection"] == b"close"
    assert "max_body_bytes" in error_of(body)["message"]


def test_a_chunked_body_is_refused_once_it_passes_the_limit_without_reading_the_rest():
    app, inner = layer()
    status, _, _, received = run(call(app, "POST", CHAT, chunks=[b"x" * 600] * 10))
    assert status == 413 and received == 2 and not inner.calls


def test_a_full_queue_refuses_with_retry_after_and_admits_again_once_a_request_ends():
    async def scenario():
        app, inner = layer(bound=3)
        inner.hold = asyncio.Event()
        held = [
            asyncio.create_task(call(app, "POST", CHAT, b'{"n": 2}')),
            asyncio.create_task(call(app, "POST", CHAT, b"{}")),
        ]
        while len(inner.calls) < 2:
            await asyncio.sleep(0)
        refused = await call(app, "POST", CHAT, b"{}")
        inner.hold.set()
        done = await asyncio.gather(*held)
        again = await call(app, "POST", CHAT, b'{"n": 2}')
        return refused, done, again, app.metrics.window.report(time.time())

    (status, headers, body, _), done, again, report = run(scenario())
    assert status == 503 and headers[b"retry-after"] == b"1"
    assert error_of(body)["type"] == "ServiceUnavailableError"
    assert [d[0] for d in done] == [200, 200] and again[0] == 200
    # The autoscaler sees four arrivals over its 10 s window, one of them refused (a client may retry it).
    assert (report[report_keys.ARRIVAL_RATE_RPS], report[report_keys.REFUSED_RATE_RPS]) == (0.4, 0.1)


def test_a_stream_frees_its_sequences_before_its_last_message_goes_out():
    """A client may send its next request the moment its stream ends; were the finished request still
    counted then, a replica at its bound would refuse that client for its own request (it did, at the
    overload drill's safe concurrency)."""
    app, _ = layer(bound=2)

    async def streaming(scope, receive, send):
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for chunk in (b"data: 1\n\n", b"data: [DONE]\n\n"):
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    app.app = streaming
    admitted_as_sent: list[int] = []
    run(call(app, "POST", CHAT, b'{"n": 2}', on_send=lambda _: admitted_as_sent.append(app.gate.admitted)))
    assert admitted_as_sent == [2, 2, 2, 0] and app.gate.admitted == 0


def test_a_request_that_fails_before_its_last_message_frees_its_sequences_once():
    app, _ = layer(bound=2)

    async def failing(scope, receive, send):
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"data: 1\n\n", "more_body": True})
        raise RuntimeError("engine died mid-stream")

    app.app = failing
    with pytest.raises(RuntimeError):
        run(call(app, "POST", CHAT, b"{}"))
    assert app.gate.admitted == 0 and app.generating == 0


def test_a_client_that_leaves_while_sending_its_body_gets_no_answer_and_the_app_no_call():
    app, inner = layer()
    messages = [
        {"type": "http.request", "body": b'{"messages"', "more_body": True},
        {"type": "http.disconnect"},
    ]
    sent: list[dict] = []

    async def receive():
        return messages.pop(0)

    async def send(message):
        sent.append(message)

    scope = {
        "type": "http",
        "method": "POST",
        "path": CHAT,
        "root_path": "",
        "headers": [(b"authorization", b"Bearer key-one")],
    }
    run(app(scope, receive, send))
    assert sent == [] and inner.calls == [] and app.generating == 0
