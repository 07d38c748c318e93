"""What a deployment exposes on the network: API keys, routes, request limits and overload refusal.

The ``security`` section of a headroom config. Keys themselves are never part of a config (it is rendered
into the Serve config, kept in rollout history and shown by ``headroom status``): the config names an
environment variable or a file, and each replica reads the keys from there when it starts.

Pure: pydantic only.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from pathlib import PurePosixPath

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from serve_app.config.errors import raise_if
from serve_app.config.vocabulary import (
    ENV_VAR_NAME_HINT,
    ENV_VAR_NAME_PATTERN,
    MetricsAccess,
    OptionalRouteGroup,
    OverloadStatus,
)

_SECTION_CONFIG = ConfigDict(extra="forbid", frozen=True, strict=True)

_KEY_IN_CONFIG = (
    "an API key itself is never accepted in a config: the config is rendered into the Serve config, "
    "kept in rollout history and shown by `headroom status`. Put the keys in an environment variable or "
    "a file on every node and name it: 'api_keys: {env: HEADROOM_API_KEYS}' or "
    "'api_keys: {file: /etc/headroom/api-keys}'"
)
# Names under which a key itself might be written into the config; each gets the message above.
_KEY_FIELD_NAMES = frozenset({"api_key", "key", "keys", "token", "tokens", "secret", "value", "values"})


def _refuse_key_fields(data: object) -> None:
    """Refuses a mapping that holds a key: under a key-like name, or as the value of api_keys itself."""
    if isinstance(data, Mapping):
        raise_if([(str(name), _KEY_IN_CONFIG) for name in data if name in _KEY_FIELD_NAMES])
        if isinstance(data.get("api_keys"), (str, list)):
            raise_if([("api_keys", _KEY_IN_CONFIG)])


class APIKeysSource(BaseModel):
    """Where each replica reads its API keys at start: an environment variable or a file, not the keys."""

    model_config = _SECTION_CONFIG

    env: str | None = Field(
        default=None,
        min_length=1,
        max_length=128,
        description=(
            "Name of an environment variable holding the keys, separated by commas. It must be set in "
            "the environment Ray's processes start with on every node (`ray start`, or the shell of "
            "`headroom serve`)."
        ),
    )
    file: str | None = Field(
        default=None,
        min_length=2,
        max_length=4096,
        description=(
            "Absolute path of a file holding the keys, one per line ('#' comments and blank lines are "
            "skipped). It must exist on every node that runs a replica."
        ),
    )

    @model_validator(mode="before")
    @classmethod
    def _no_key_fields(cls, data: object) -> object:
        _refuse_key_fields(data)
        return data

    @field_validator("env")
    @classmethod
    def _check_env(cls, value: str | None) -> str | None:
        if value is not None and not re.fullmatch(ENV_VAR_NAME_PATTERN, value):
            raise ValueError(
                f"must be {ENV_VAR_NAME_HINT}, got a value of {len(value)} characters (not shown, in case "
                f"it is a key); {_KEY_IN_CONFIG}"
            )
        return value

    @field_validator("file")
    @classmethod
    def _check_file(cls, value: str | None) -> str | None:
        if value is not None and not PurePosixPath(value).is_absolute():
            raise ValueError(
                f"must be an absolute path (replicas run in Ray's working directories), got a value of "
                f"{len(value)} characters (not shown, in case it is a key); {_KEY_IN_CONFIG}"
            )
        return value

    @model_validator(mode="after")
    def _exactly_one(self) -> APIKeysSource:
        if (self.env is None) == (self.file is None):
            given = "both" if self.env is not None else "neither"
            msg = f"give exactly one of env and file, got {given}"
            raise_if([("env", msg)])
        return self

    @property
    def where(self) -> str:
        """Where the keys come from, for messages (never the keys)."""
        return f"environment variable {self.env}" if self.env is not None else f"file {self.file}"


class RequestLimits(BaseModel):
    """Per-request limits, checked before the engine sees a request; a request over one gets a 400 (413 for
    the body) in OpenAI's error JSON naming the field."""

    model_config = _SECTION_CONFIG

    max_body_bytes: int = Field(
        default=4 * 1024 * 1024,
        ge=1024,
        le=1024 * 1024 * 1024,
        description=(
            "Largest request body in bytes; a larger one gets 413 before it is read in full. 4 MiB holds "
            "a 128k-token prompt as JSON text several times over."
        ),
    )
    max_n: int = Field(
        default=16,
        ge=1,
        le=1024,
        description="Most choices one request may ask for (n); each is a sequence in the engine.",
    )
    max_tokens: int | None = Field(
        default=None,
        ge=1,
        le=1_048_576,
        description=(
            "Most tokens one request may generate: max_tokens, max_completion_tokens or min_tokens above "
            "it get 400, and a request that sets none of them generates at most this many. null leaves "
            "vLLM's rule (up to model.max_model_len minus the prompt)."
        ),
    )
    max_prompt_tokens: int | None = Field(
        default=None,
        ge=1,
        le=1_048_576,
        description=(
            "Most prompt tokens (after the chat template) one request may send. null leaves vLLM's rule "
            "(model.max_model_len)."
        ),
    )
    max_logprobs: int = Field(
        default=20,
        ge=0,
        le=1024,
        description=(
            "Most log-probabilities per token a request may ask for (logprobs, top_logprobs, "
            "prompt_logprobs); 20 is vLLM's own default limit."
        ),
    )


class OverloadSettings(BaseModel):
    """A bounded queue per replica: generation requests beyond what the engine runs at once plus a short
    queue are refused at once with Retry-After, instead of waiting without limit."""

    model_config = _SECTION_CONFIG

    queue_fraction: float = Field(
        default=0.25,
        ge=0,
        le=8,
        description=(
            "Requests a replica queues beyond the plan's max_num_seqs (its safe concurrency), as a "
            "fraction of it, rounded up: 0.25 with max_num_seqs 32 admits 32 + 8; 0 admits only what the "
            "engine runs at once. A queued request waits for a running one to finish, so its TTFT grows "
            "by up to a whole generation: a queue absorbs bursts at the cost of TTFT (docs/security.md)."
        ),
    )
    status: OverloadStatus = Field(
        default=503,
        description=(
            "Status of a refused request: 503 (server overloaded) or 429 (too many requests). OpenAI's "
            "clients retry both, after Retry-After."
        ),
    )
    retry_after_s: int = Field(
        default=1,
        ge=1,
        le=3600,
        description="Seconds a refused client is told to wait (the Retry-After header).",
    )

    def admission_bound(self, max_num_seqs: int) -> int:
        """The most sequences a replica admits at once: the plan's max_num_seqs plus its queue."""
        return max_num_seqs + math.ceil(self.queue_fraction * max_num_seqs)


class SecuritySection(BaseModel):
    """What a deployment exposes: API keys, which routes answer, request limits and overload refusal."""

    model_config = _SECTION_CONFIG

    api_keys: APIKeysSource | None = Field(
        default=None,
        description=(
            "Require 'Authorization: Bearer <key>' on every route but /health (and /metrics when "
            "metrics is 'open'), from the keys in this environment variable or file. null: no keys "
            "(only for a trusted network)."
        ),
    )
    metrics: MetricsAccess = Field(
        default="open",
        description=(
            "'open' lets anyone read /metrics (a Prometheus scraper without credentials); 'api_key' "
            "requires a key as the API does. Only matters when api_keys is set."
        ),
    )
    optional_routes: tuple[OptionalRouteGroup, ...] = Field(
        default=(),
        description=(
            "Routes of vLLM's app to open beside the OpenAI ones (chat/completions, completions, "
            "models, health, metrics): 'tokenize' (/tokenize, /detokenize), 'docs' (/openapi.json, "
            "/docs, /redoc). Every other route answers 404."
        ),
    )
    limits: RequestLimits = Field(
        default_factory=RequestLimits, description="Per-request limits on size, choices and tokens."
    )
    overload: OverloadSettings | None = Field(
        default_factory=OverloadSettings,
        description=(
            "Refuse generation requests beyond a bounded queue per replica with 503/429 and Retry-After. "
            "null: requests wait in Ray Serve without limit."
        ),
    )

    @model_validator(mode="before")
    @classmethod
    def _no_key_fields(cls, data: object) -> object:
        _refuse_key_fields(data)
        return data

    @field_validator("optional_routes", mode="before")
    @classmethod
    def _list_to_tuple(cls, value: object) -> object:
        # YAML gives a list; strict mode accepts only the declared tuple.
        return tuple(value) if isinstance(value, list) else value
