"""The ASGI layer headroom puts around vLLM's OpenAI app in each replica.

It answers, before vLLM sees a request: routes that are not open (404), missing or wrong API keys (401),
wrong methods (405), bodies over the size limit (413, before they are read in full), bodies that are not
JSON or that break a request limit (400), and generation requests beyond the replica's bounded queue
(503/429 with Retry-After), all in OpenAI's error JSON; the rules are in serving/request_guard.py. It
times generation requests for headroom's metrics.

Pure ASGI rather than Starlette's BaseHTTPMiddleware, which adds a task and a queue per request. The body
of a POST is read and parsed once here and handed on as it came; responses pass through untouched.
"""

from __future__ import annotations

import contextvars
import time
from collections.abc import Mapping

from starlette.datastructures import Headers

from serve_app.config.security import SecuritySection
from serve_app.serving.metrics import ServingMetrics, request_started_at
from serve_app.serving.request_guard import (
    GENERATION_PATHS,
    AdmissionGate,
    RequestRefused,
    check_limits,
    field_caps,
    open_routes,
    openai_error_body,
    parse_json_body,
    sequences_asked,
)

try:  # vLLM >= 0.32
    from vllm.entrypoints.serve.middleware.authenticate import AuthenticationMiddleware
except ImportError:  # vLLM 0.26 - 0.31
    from vllm.entrypoints.serve.utils.server_utils import (  # type: ignore[no-redef]
        AuthenticationMiddleware,
    )

# The generation path of the current request, for the engine's prompt-length check (engine.py), which
# names the field: 'messages' for chat, 'prompt' for completions.
request_path: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "headroom_request_path", default=None
)


def _route_path(scope) -> str:
    """The path below the app's route prefix (Serve passes the prefix as root_path)."""
    path, root = scope["path"], scope.get("root_path", "")
    return path[len(root) :] if root and path.startswith(root) else path


class _ClientGone(Exception):
    """The client disconnected while its body was being read: there is no one to answer."""


async def _read_body(receive, limit: int) -> bytes:
    """The whole request body, or RequestRefused(413) as soon as it passes `limit` bytes."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise _ClientGone
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise RequestRefused(413, f"request body is over {limit} bytes (security.limits.max_body_bytes)")
        chunks.append(chunk)
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def _replay(body: bytes, receive):
    """A receive that hands the already-read body on, then the client's own messages (its disconnect)."""
    pending = True

    async def replay_receive():
        nonlocal pending
        if pending:
            pending = False
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay_receive


class ReplicaASGI:
    """vLLM's app behind the replica's route allow-list, API keys, request limits and bounded queue.

    Other attributes (Serve registers its back-pressure exception handlers through them) are the app's.
    """

    def __init__(
        self,
        app,
        metrics: ServingMetrics,
        security: SecuritySection,
        api_keys: list[str] | None = None,
        admission_bound: int | None = None,
    ):
        self.app = app
        self.metrics = metrics
        self.routes = open_routes(security)
        # vLLM's own check: SHA-256 of each key, compared in constant time against every key.
        self.verifier = AuthenticationMiddleware(None, api_keys) if api_keys else None
        self.max_body_bytes = security.limits.max_body_bytes
        self.caps = field_caps(security.limits)
        overload = security.overload
        self.overload_status = overload.status if overload is not None else 503
        self.retry_after_s = str(overload.retry_after_s if overload is not None else 1).encode()
        self.gate = AdmissionGate(admission_bound) if admission_bound is not None else None
        self.engine_dead = False
        self.generating = 0

    def __getattr__(self, name):
        return getattr(self.app, name)

    async def __call__(self, scope, receive, send):
        if scope["type"] == "websocket":  # no websocket route is open
            await receive()
            await send({"type": "websocket.close", "code": 1008})
            return
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path, method = _route_path(scope), scope["method"]
        try:
            if self.engine_dead:
                raise RequestRefused(
                    503, "this replica's engine has stopped and the replica is being replaced"
                )
            route = self.routes.get(path)
            if route is None:
                raise RequestRefused(404, f"No route for {method} {scope['path']}")
            if route.needs_key and not self.verifier.verify_token(Headers(scope=scope)):
                raise RequestRefused(401, "a valid API key is required: send 'Authorization: Bearer <key>'")
            if method not in route.methods:
                raise RequestRefused(405, f"{method} is not allowed on {scope['path']}")
            if path in GENERATION_PATHS:
                await self._generate(scope, receive, send, path)
            elif method == "POST":
                body = await self._body(scope, receive)
                parse_json_body(body)  # only so that a body that is not JSON gets OpenAI's error JSON
                await self.app(scope, _replay(body, receive), send)
            else:
                await self.app(scope, receive, send)
        except RequestRefused as refused:
            await self._refuse(send, refused)
        except _ClientGone:
            pass

    async def _body(self, scope, receive) -> bytes:
        """The body, refused with 413 from its Content-Length before any of it is read, when it has one."""
        limit = self.max_body_bytes
        for name, value in scope["headers"]:
            if name == b"content-length" and value.isdigit() and int(value) > limit:
                raise RequestRefused(
                    413, f"request body is over {limit} bytes (security.limits.max_body_bytes)"
                )
        return await _read_body(receive, limit)

    async def _refuse(self, send, refused: RequestRefused) -> None:
        body = openai_error_body(refused.status, refused.message, refused.param)
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        if refused.status in (429, 503):
            headers.append((b"retry-after", self.retry_after_s))
        if refused.status == 401:
            headers.append((b"www-authenticate", b"Bearer"))
        if refused.status == 413 or self.engine_dead:
            # 413: the rest of the body is not read. A dying replica: HAProxy must not send it more requests
            # on this connection (a new one fails once the replica has exited, and HAProxy retries that).
            headers.append((b"connection", b"close"))
        await send({"type": "http.response.start", "status": refused.status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async def _generate(self, scope, receive, send, path: str) -> None:
        """A generation request, timed for headroom's metrics: body, limits and admission checked, then
        vLLM."""
        started = time.time()
        token = request_started_at.set(started)
        status = 500
        held = 0  # sequences this request holds at the admission gate
        self.metrics.request_started()
        self.generating += 1

        def send_and_watch(message):
            # Runs for every streamed chunk: it hands back send's awaitable instead of awaiting it in a
            # coroutine of its own (one frame less per chunk; the caller awaits it).
            nonlocal status, held
            if message["type"] == "http.response.start":
                status = message["status"]
            elif held and not message.get("more_body", False):
                # The response's last message: the engine has finished its sequences. They leave the gate
                # before it goes out, so that a client that sends its next request as soon as this one
                # ends never finds its finished request still counted and is refused for it.
                self.gate.release(held)
                held = 0
            return send(message)

        try:
            body = await self._body(scope, receive)
            request = parse_json_body(body)
            sequences = 1
            if isinstance(request, Mapping):  # vLLM answers other JSON itself
                check_limits(request, self.caps)
                sequences = sequences_asked(request)
            if self.gate is not None:
                if not self.gate.admit(sequences):
                    self.metrics.request_refused()
                    raise RequestRefused(
                        self.overload_status,
                        f"this replica is at its queue limit ({self.gate.bound} sequences); retry after "
                        "the seconds in the Retry-After header",
                    )
                held = sequences
            path_token = request_path.set(path)
            try:
                await self.app(scope, _replay(body, receive), send_and_watch)
            finally:
                request_path.reset(path_token)
        except RequestRefused as refused:
            await self._refuse(send_and_watch, refused)
        except _ClientGone:
            status = 499  # the client left while sending its body (nginx's and Ray's code for it)
        finally:
            if held:  # no last message went out: an error, or the client left
                self.gate.release(held)
            self.generating -= 1
            request_started_at.reset(token)
            self.metrics.request_finished(started, status)
