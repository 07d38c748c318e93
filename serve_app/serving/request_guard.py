"""The decisions of the replica's ASGI layer, free of ASGI: which routes answer, who may call them, which
request bodies pass the config's limits, how many sequences a request adds to the replica's queue.

Pure (standard library and the config only), so every rule is tested directly; serving/asgi.py applies
them to requests.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from serve_app.config.security import APIKeysSource, RequestLimits, SecuritySection

# The routes a config can open, below the app's route prefix: path -> methods (HEAD wherever GET is).
# Paths match exactly; vLLM's /metrics mount would also answer /metricsfoo.
GENERATION_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})
_GET = frozenset({"GET", "HEAD"})
_POST = frozenset({"POST"})
OPENAI_ROUTES: dict[str, frozenset[str]] = {
    "/v1/chat/completions": _POST,
    "/v1/completions": _POST,
    "/v1/models": _GET,
}
HEALTH_PATH = "/health"
METRICS_PATH = "/metrics"
OPTIONAL_ROUTES: dict[str, dict[str, frozenset[str]]] = {
    "tokenize": {"/tokenize": _POST, "/detokenize": _POST},
    "docs": {"/openapi.json": _GET, "/docs": _GET, "/docs/oauth2-redirect": _GET, "/redoc": _GET},
}


@dataclass(frozen=True)
class Route:
    """An open route: the methods it answers and whether it needs an API key (when keys are configured)."""

    methods: frozenset[str]
    needs_key: bool


def open_routes(security: SecuritySection) -> dict[str, Route]:
    """Every path the replica answers; all others get 404."""
    keyed = security.api_keys is not None
    routes = {path: Route(methods, keyed) for path, methods in OPENAI_ROUTES.items()}
    for group in security.optional_routes:
        routes.update({path: Route(methods, keyed) for path, methods in OPTIONAL_ROUTES[group].items()})
    routes[HEALTH_PATH] = Route(_GET, False)  # load balancers probe it without credentials
    routes[METRICS_PATH] = Route(_GET, keyed and security.metrics == "api_key")
    return routes


class RequestRefused(Exception):
    """A request the layer answers itself: status, message, the offending field (OpenAI's 'param')."""

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param


ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "RequestTooLargeError",
    429: "RateLimitError",
    503: "ServiceUnavailableError",
}


def openai_error_body(status: int, message: str, param: str | None = None) -> bytes:
    """The error JSON OpenAI clients parse, in the shape vLLM's own errors have (code = the status)."""
    error = {"message": message, "type": ERROR_TYPES.get(status, "Error"), "param": param, "code": status}
    return json.dumps({"error": error}).encode()


# --- API keys -------------------------------------------------------------------------------------------


def parse_api_keys(text: str, source: APIKeysSource) -> list[str]:
    """The keys in an environment variable's value (comma-separated) or a key file (one per line, '#'
    comments and blank lines skipped). Raises ValueError naming the source, never a key."""
    if source.env is not None:
        keys = [k.strip() for k in text.split(",")]
    else:
        keys = [line.strip() for line in text.splitlines() if not line.lstrip().startswith("#")]
    keys = [k for k in keys if k]
    if not keys:
        raise ValueError(
            f"security.api_keys: the {source.where} holds no keys; a replica with keys configured "
            "refuses to start without any"
        )
    return keys


def read_api_keys(source: APIKeysSource, environ: Mapping[str, str]) -> list[str]:
    """The keys from the configured environment variable or file, read where the replica runs. Raises
    ValueError saying what is missing (never a key), so that the replica fails to start."""
    if source.env is not None:
        text = environ.get(source.env)
        if text is None:
            raise ValueError(
                f"security.api_keys: environment variable {source.env} is not set where this replica runs; "
                "set it in the environment Ray starts with on every node (`ray start`, or the shell of "
                "`headroom serve`)"
            )
    else:
        try:
            text = Path(str(source.file)).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            raise ValueError(f"security.api_keys: cannot read the key file {source.file}: {err}") from None
    return parse_api_keys(text, source)


# --- bodies ---------------------------------------------------------------------------------------------


def parse_json_body(body: bytes) -> Any:
    """The request body as JSON; invalid JSON and invalid UTF-8 get a 400 OpenAI clients can parse
    (FastAPI would answer invalid UTF-8 with its own {"detail": ...})."""
    try:
        return json.loads(body)
    except UnicodeDecodeError as err:
        raise RequestRefused(400, f"request body is not valid UTF-8 (byte {err.start})") from None
    except ValueError as err:
        raise RequestRefused(400, f"request body is not valid JSON: {err}") from None


def _int_field(body: Mapping[str, Any], name: str) -> int | None:
    value = body.get(name)
    # Wrong types are left to vLLM's own validation, which names them; bool is not a count.
    return value if isinstance(value, int) and not isinstance(value, bool) else None


_INT64_END = 1 << 63


def field_caps(limits: RequestLimits) -> dict[str, tuple[int, str]]:
    """Each capped request field -> (its limit, the setting that holds it)."""
    caps = {"n": (limits.max_n, "max_n"), "best_of": (limits.max_n, "max_n")}
    if limits.max_tokens is not None:
        for name in ("max_tokens", "max_completion_tokens", "min_tokens"):
            caps[name] = (limits.max_tokens, "max_tokens")
    # /v1/completions' logprobs is a count; chat's is a switch with the count in top_logprobs.
    for name in ("logprobs", "top_logprobs", "prompt_logprobs"):
        caps[name] = (limits.max_logprobs, "max_logprobs")
    return caps


def check_limits(body: Mapping[str, Any], caps: Mapping[str, tuple[int, str]]) -> None:
    """Raises RequestRefused(400) naming the first field of a generation request over its cap (see
    field_caps), or holding an integer beyond 64 bits (vLLM's sampling code fails on it with a 500).
    Fields of other types are left to vLLM's validation, which names them; one pass over the body."""
    for name, value in body.items():
        if type(value) is not int:  # not isinstance: a bool is not a count
            continue
        if not -_INT64_END <= value < _INT64_END:
            raise RequestRefused(400, f"{name} is outside the range of a 64-bit integer", str(name))
        cap = caps.get(name)
        if cap is not None and value > cap[0]:
            raise RequestRefused(
                400,
                f"{name} is {value}; this server accepts at most {cap[0]} (security.limits.{cap[1]})",
                name,
            )


def sequences_asked(body: Mapping[str, Any]) -> int:
    """Sequences a generation request puts into the engine: n (or best_of) per prompt, and a completion
    request may carry a list of prompts."""
    per_prompt = max(_int_field(body, "n") or 1, _int_field(body, "best_of") or 1, 1)
    prompt = body.get("prompt")
    prompts = len(prompt) if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) else 1
    return per_prompt * max(prompts, 1)


# --- admission ------------------------------------------------------------------------------------------


class AdmissionGate:
    """Sequences admitted at a replica, bounded: the plan's max_num_seqs run in the engine, the rest of the
    bound wait in its queue, and a request that would pass the bound is refused."""

    def __init__(self, bound: int):
        self.bound = bound
        self.admitted = 0

    def admit(self, sequences: int) -> bool:
        """Admits `sequences` if they fit under the bound. A request larger than the whole bound never fits
        and is refused for good (raises RequestRefused 400), not asked to come back."""
        if sequences > self.bound:
            raise RequestRefused(
                400,
                f"the request asks for {sequences} sequences (n x prompts); a replica of this deployment "
                f"admits at most {self.bound} at once",
                "n",
            )
        if self.admitted + sequences > self.bound:
            return False
        self.admitted += sequences
        return True

    def release(self, sequences: int) -> None:
        self.admitted -= sequences
