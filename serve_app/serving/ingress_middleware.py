"""The middleware headroom gives Ray Serve's HTTP servers, through Serve's hook for it
(RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH, in serve_options.SERVE_CLUSTER_ENV).

In a replica's own HTTP server (direct ingress) it marks each request `x-request-disconnect-disabled: ?1`,
Serve's per-request switch for its disconnect watcher: without it Serve runs the app as a task beside a
second task that reads the client's messages until the disconnect, and waits on both. vLLM's handlers watch
for the disconnect themselves (`with_cancellation`) and abort the request in the engine, so the watcher only
adds two tasks and a queue to every request (40-70 us of the replica's CPU per request on the CPU box,
results/serve_request). Serve's proxy actor (HAProxy's backup when no replica is up) keeps its watcher: it
is what cancels the request it forwards.
"""

from __future__ import annotations

from ray import serve
from ray.serve._private.constants import SERVE_HTTP_REQUEST_DISCONNECT_DISABLED_HEADER
from ray.serve.exceptions import RayServeException
from starlette.middleware import Middleware

NO_DISCONNECT_WATCHER = (SERVE_HTTP_REQUEST_DISCONNECT_DISABLED_HEADER.encode(), b"?1")


class SkipServeDisconnectWatcher:
    """Adds Serve's no-disconnect-watcher header to every HTTP request's scope."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            scope["headers"] = [*scope["headers"], NO_DISCONNECT_WATCHER]
        await self.app(scope, receive, send)


def _in_replica() -> bool:
    try:
        serve.get_replica_context()
    except RayServeException:
        return False
    return True


def middlewares() -> list[Middleware]:
    """Called by Serve in each process that starts an HTTP server: replicas get the middleware."""
    return [Middleware(SkipServeDisconnectWatcher)] if _in_replica() else []
