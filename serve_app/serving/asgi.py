"""The ASGI layer headroom puts around vLLM's OpenAI app in each replica.

Pure ASGI rather than Starlette's BaseHTTPMiddleware, which adds a task and a queue per request.
"""

from __future__ import annotations

import json
import time

from starlette.routing import Match

from serve_app.serving.metrics import TIMED_PATHS, ServingMetrics, request_started_at


def openai_error_body(message: str, status: int, error_type: str) -> bytes:
    """The error JSON OpenAI clients parse (the shape vLLM's own errors have)."""
    return json.dumps(
        {"error": {"message": message, "type": error_type, "param": None, "code": status}}
    ).encode()


def _route_path(scope) -> str:
    """The path below the app's route prefix (Serve passes the prefix as root_path)."""
    path, root = scope["path"], scope.get("root_path", "")
    return path[len(root) :] if root and path.startswith(root) else path


class ReplicaASGI:
    """Times generation requests for headroom's metrics and answers unknown routes with OpenAI-style errors.

    Other attributes (Serve registers its back-pressure exception handlers through them) are the app's.
    """

    def __init__(self, app, metrics: ServingMetrics):
        self.app = app
        self.metrics = metrics

    def __getattr__(self, name):
        return getattr(self.app, name)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
        elif scope["method"] == "POST" and _route_path(scope) in TIMED_PATHS:
            await self._timed(scope, receive, send)
        elif (status := self._route_error(scope)) is not None:
            await self._send_error(send, scope, status)
        else:
            await self.app(scope, receive, send)

    def _route_error(self, scope) -> int | None:
        """404 when no route has the path, 405 when one has it for other methods; None when one matches.

        FastAPI would answer these with {"detail": ...}, which OpenAI clients cannot parse.
        """
        partial = False
        for route in self.app.router.routes:
            match, _ = route.matches(scope)
            if match is Match.FULL:
                return None
            partial = partial or match is Match.PARTIAL
        return 405 if partial else 404

    async def _send_error(self, send, scope, status: int) -> None:
        if status == 404:
            body = openai_error_body(f"No route for {scope['method']} {scope['path']}", 404, "NotFoundError")
        else:
            body = openai_error_body(
                f"{scope['method']} is not allowed on {scope['path']}", 405, "MethodNotAllowedError"
            )
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async def _timed(self, scope, receive, send):
        started = time.time()
        token = request_started_at.set(started)
        status = 500
        self.metrics.request_started()

        async def send_and_watch(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_watch)
        finally:
            request_started_at.reset(token)
            self.metrics.request_finished(started, status)
