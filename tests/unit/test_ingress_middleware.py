"""The middleware that turns off Ray Serve's per-request disconnect watcher in replicas, read by Ray's own
parser of the header, and reached through the cluster setting headroom ships."""

from __future__ import annotations

import asyncio

from ray import serve
from ray.serve._private.http_util import parse_disconnect_disabled_header
from ray.serve._private.utils import import_attr

from serve_app.serving import ingress_middleware as m
from serve_app.serving.serve_options import SERVE_CLUSTER_ENV


def passed_on(scope: dict) -> dict:
    """The scope the wrapped app gets."""
    seen: list[dict] = []

    async def app(scope, receive, send):
        seen.append(scope)

    asyncio.run(m.SkipServeDisconnectWatcher(app)(scope, None, None))
    return seen[0]


def test_http_requests_are_marked_so_that_serve_skips_its_watcher() -> None:
    scope = passed_on({"type": "http", "headers": [(b"host", b"x")]})
    headers = dict(scope["headers"])
    assert parse_disconnect_disabled_header(headers)
    assert headers[b"host"] == b"x"


def test_other_scopes_pass_unchanged() -> None:
    for kind in ("websocket", "lifespan"):
        assert passed_on({"type": kind, "headers": []})["headers"] == []


def test_only_replicas_get_the_middleware(monkeypatch) -> None:
    assert m.middlewares() == []  # not in a replica: Serve's proxy actor keeps its watcher
    monkeypatch.setattr(serve, "get_replica_context", lambda: object())
    (middleware,) = m.middlewares()
    assert middleware.cls is m.SkipServeDisconnectWatcher


def test_the_cluster_setting_names_the_callback() -> None:
    path = SERVE_CLUSTER_ENV["RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"]
    assert import_attr(path) is m.middlewares
