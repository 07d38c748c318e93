"""The Ray cluster through its dashboard: the address, Ray's token authentication, and the HTTP calls.

The dashboard executes whatever Serve config it is sent, so this is the control path to protect. headroom
authenticates exactly as Ray's own dashboard clients do (`serve deploy`'s ServeSubmissionClient, `ray job
submit`): with RAY_AUTH_MODE=token, Ray's token loader reads $RAY_AUTH_TOKEN, else the file named by
$RAY_AUTH_TOKEN_PATH, else ~/.ray/auth_token, and Ray builds the `authorization` header; without it no token
is sent, so a token never goes to an address it was not meant for. The token is held only in the request
headers: no message, log line, rendered config or history record carries it.
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Callable, Mapping
from typing import Any, Protocol
from urllib.parse import urlsplit

from serve_app.rollout.errors import RolloutError, to_stderr

DEFAULT_DASHBOARD_ADDRESS = "http://127.0.0.1:8265"

TOKEN_PLACES = (
    "the cluster's token in $RAY_AUTH_TOKEN, in a file named by $RAY_AUTH_TOKEN_PATH, or in "
    "~/.ray/auth_token (`ray get-auth-token` prints it on the head node)"
)
TOKEN_SETTINGS = f"set RAY_AUTH_MODE=token and put {TOKEN_PLACES}"
# The API key the readiness probe and the smoke load send to an app with security.api_keys: the variable the
# openai client and loadtests' Locust users read.
API_KEY_ENV = "OPENAI_API_KEY"
TOKEN_AUTH_DOCS = "https://docs.ray.io/en/latest/ray-security/token-auth.html"


def default_address(environ: Mapping[str, str] = os.environ) -> tuple[str, str]:
    """(address, where it came from): $RAY_ADDRESS, else the local dashboard."""
    if environ.get("RAY_ADDRESS"):
        return environ["RAY_ADDRESS"], "$RAY_ADDRESS"
    return DEFAULT_DASHBOARD_ADDRESS, "the default"


def dashboard_url(address: str, source: str = "--address") -> str:
    """The Ray dashboard's HTTP address (what `serve deploy` talks to), normalized; pure.

    Refuses, naming the problem: no scheme (host:port), a Ray Client address (ray://), another scheme,
    no host, a port that is not a number in 1-65535, or a path/query after the port.
    """
    text = address.strip()
    hint = "the Ray dashboard's HTTP address, e.g. http://<head-node>:8265 (what `serve deploy` uses)"
    if not text:
        raise RolloutError(f"{source} is empty: give {hint}")
    if "@" in text:  # not echoed: what stands before the @ is a credential
        raise RolloutError(
            f"{source} holds a user name or password (user:secret@host), which would be printed and "
            f"recorded; give {hint}. For Ray's token authentication, {TOKEN_SETTINGS}"
        )
    if "://" not in text:
        host = text.split("/")[0].rsplit(":", 1)[0] or "<head-node>"
        extra = ""
        if text.endswith((":6379", ":10001")):
            extra = " (6379 is the GCS port and 10001 the Ray Client port; the dashboard listens on 8265)"
        raise RolloutError(
            f"{source} {address!r} has no scheme{extra}: give {hint}, here probably http://{host}:8265"
        )
    parts = urlsplit(text)
    scheme = parts.scheme.lower()
    if scheme == "ray":
        raise RolloutError(
            f"{source} {address!r} is a Ray Client address; rollouts use the dashboard's REST API: "
            f"give {hint}"
        )
    if scheme not in ("http", "https"):
        raise RolloutError(f"{source} {address!r}: scheme {parts.scheme!r} is not supported; give {hint}")
    if not parts.hostname:
        raise RolloutError(f"{source} {address!r} has no host name; give {hint}")
    try:
        port = parts.port
    except ValueError:
        raise RolloutError(
            f"{source} {address!r}: the port must be a number in 1-65535; give {hint}"
        ) from None
    if port == 0:
        raise RolloutError(f"{source} {address!r}: the port must be a number in 1-65535; give {hint}")
    if parts.path.strip("/") or parts.query or parts.fragment:
        raise RolloutError(f"{source} {address!r}: give the dashboard's address without a path; {hint}")
    return f"{scheme}://{parts.netloc}"


# --------------------------------------------------------------------------------------------------------
# Ray's token authentication
# --------------------------------------------------------------------------------------------------------


def dashboard_auth_headers() -> dict[str, str]:
    """The header carrying Ray's auth token, from Ray's own functions: none unless RAY_AUTH_MODE=token.

    Token mode with no token to load (nothing set, or $RAY_AUTH_TOKEN_PATH naming a missing or empty file)
    raises RolloutError naming what to set, before any request is sent.
    """
    from ray._private.authentication.authentication_token_setup import ensure_token_if_auth_enabled
    from ray._private.authentication.http_token_authentication import get_auth_headers_if_auth_enabled
    from ray.exceptions import AuthenticationError

    try:
        ensure_token_if_auth_enabled(None, create_token_if_missing=False)
        return {str(k): str(v) for k, v in get_auth_headers_if_auth_enabled({}).items()}
    except AuthenticationError as err:  # Ray's message names the variable or file, never the token
        raise RolloutError(
            f"RAY_AUTH_MODE=token, but no token could be loaded ({err.message}): put {TOKEN_PLACES}"
        ) from None


def is_local_address(address: str) -> bool:
    """Whether a dashboard URL names this machine (localhost or a loopback IP); any other name is remote."""
    host = urlsplit(address).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def open_dashboard_warning(address: str, auth_mode: str | None) -> str | None:
    """The warning for a dashboard beyond this machine that runs without token authentication (pure)."""
    if auth_mode != "disabled" or is_local_address(address):
        return None
    return (
        f"warning: the Ray dashboard at {address} answers without a token (Ray token authentication is off): "
        "anyone who can reach it can run code on the cluster. Start the cluster with RAY_AUTH_MODE=token "
        f"({TOKEN_AUTH_DOCS})"
    )


# --------------------------------------------------------------------------------------------------------
# The Ray/HTTP calls
# --------------------------------------------------------------------------------------------------------


class ClusterAPI(Protocol):
    address: str

    def details(self) -> dict[str, Any]: ...
    def deploy(self, body: Mapping[str, Any]) -> None: ...
    def gpus_per_node(self) -> list[int]: ...
    def probe(self, base_url: str, model: str | None) -> str | None: ...


class ServeCluster:
    """A Ray cluster through its dashboard: Serve's REST API (ServeSubmissionClient, as `serve deploy`) and
    the state API. Construction loads Ray's token (when RAY_AUTH_MODE=token), checks with a short timeout
    that a Ray dashboard answers there and accepts it, and warns once (`warn`, default stderr) when a
    dashboard beyond this machine runs without token authentication."""

    def __init__(
        self, address: str, connect_timeout_s: float = 10.0, warn: Callable[[str], None] = to_stderr
    ) -> None:
        from ray.dashboard.modules.serve.sdk import ServeSubmissionClient

        self.address = address
        self._headers = dashboard_auth_headers()
        self._check_dashboard(connect_timeout_s)
        warning = open_dashboard_warning(address, self.auth_mode(connect_timeout_s))
        if warning is not None:
            warn(warning)
        try:
            self._client = ServeSubmissionClient(address, headers=dict(self._headers))
        except (ConnectionError, RuntimeError, ValueError) as err:
            raise RolloutError(f"the Ray dashboard at {address}: {err}") from None

    def _check_dashboard(self, timeout_s: float) -> None:
        """A Ray dashboard answers at the address and takes the token sent (or needs none)."""
        import httpx

        url = f"{self.address}/api/ray/version"
        try:
            response = httpx.get(url, headers=self._headers, timeout=timeout_s)
        except httpx.HTTPError as err:
            raise RolloutError(
                f"cannot reach the Ray dashboard at {self.address} ({type(err).__name__}: {err}); check the "
                "address (http://<head-node>:8265) and that the cluster is up"
            ) from None
        if response.status_code == 401:
            raise RolloutError(
                f"the Ray dashboard at {self.address} requires a token (Ray token authentication) and none "
                f"was sent: {TOKEN_SETTINGS}"
            )
        if response.status_code == 403:
            raise RolloutError(
                f"the Ray dashboard at {self.address} rejected the token sent (Ray token authentication): "
                "the one Ray loaded (from $RAY_AUTH_TOKEN, else $RAY_AUTH_TOKEN_PATH, else "
                "~/.ray/auth_token) is not this cluster's; `ray get-auth-token` on the head node prints it"
            )
        if response.status_code != 200 or "ray_version" not in response.text:
            raise RolloutError(
                f"{self.address} answered {response.status_code} to /api/ray/version: not a Ray dashboard"
            )

    def auth_mode(self, timeout_s: float = 10.0) -> str | None:
        """The dashboard's authentication mode, 'token' or 'disabled' (Ray's public /api/authentication_mode);
        None when it does not say."""
        import httpx

        try:
            response = httpx.get(f"{self.address}/api/authentication_mode", timeout=timeout_s)
            mode = response.json()["authentication_mode"] if response.status_code == 200 else None
        except (httpx.HTTPError, ValueError, KeyError, TypeError):
            return None
        return str(mode) if mode is not None else None

    def details(self) -> dict[str, Any]:
        from ray.exceptions import AuthenticationError

        try:
            return dict(self._client.get_serve_details())
        except (ConnectionError, RuntimeError, AuthenticationError) as err:
            raise RolloutError(f"reading Serve's state from {self.address}: {err}") from None

    def deploy(self, body: Mapping[str, Any]) -> None:
        from ray.exceptions import AuthenticationError

        try:
            self._client.deploy_applications(dict(body))
        except (ConnectionError, RuntimeError, AuthenticationError) as err:
            raise RolloutError(f"Serve refused the deploy at {self.address}: {err}") from None

    def gpus_per_node(self) -> list[int]:
        """GPUs of each alive node, from the state API (GET /api/v0/nodes)."""
        import httpx

        try:
            response = httpx.get(
                f"{self.address}/api/v0/nodes", params={"limit": 10000}, headers=self._headers, timeout=30
            )
            response.raise_for_status()
            nodes = response.json()["data"]["result"]["result"]
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as err:
            raise RolloutError(f"listing the nodes of {self.address}: {err}") from None
        return [
            int((n.get("resources_total") or {}).get("GPU", 0)) for n in nodes if n.get("state") == "ALIVE"
        ]

    def probe(self, base_url: str, model: str | None) -> str | None:
        """None when {base_url}/v1/models answers 200 (listing `model`), else what is wrong. This is Serve's
        HTTP port, not the dashboard: no Ray token is sent there, but the app's API key is, from
        $OPENAI_API_KEY (as the openai client and the smoke load read it) when the app requires keys."""
        import httpx

        key = os.environ.get(API_KEY_ENV)
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        try:
            response = httpx.get(f"{base_url}/v1/models", headers=headers, timeout=10)
        except httpx.HTTPError as err:
            return f"{base_url}/v1/models: {type(err).__name__}: {err}"
        if response.status_code == 401:
            return (
                f"{base_url}/v1/models answered 401: the app requires an API key (security.api_keys); set "
                f"{API_KEY_ENV} to one of its keys for the readiness probe and the smoke load"
                + (" (the one set was refused)" if key else "")
            )
        if response.status_code != 200:
            return f"{base_url}/v1/models answered {response.status_code}"
        if model is not None:
            ids = [m.get("id") for m in response.json().get("data", [])]
            if model not in ids:
                return f"{base_url}/v1/models lists {ids}, not {model!r}"
        return None
