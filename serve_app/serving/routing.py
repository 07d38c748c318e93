"""Prefix-affinity routing, decided without Ray: a request's routing key, the replica order for a key, the
router's estimate of each replica's load, and the bounded-load choice.

A replica's vLLM prefix cache only helps requests that reach it, so requests that share a prefix should
meet on one replica. Each request gets a key naming what it shares with others (`routing_key`); replicas
are ranked for a key by rendezvous (highest-random-weight) hashing (`rendezvous_order`): every router copy,
on any node and after any restart, ranks them alike without sharing state, a replica that leaves takes
only its own keys with it and a new one takes about 1/(N+1) of them. A key goes to the first replica in its
order that stays within its bounded share of the load (`choose_replica`), so one hot key (a shared system
prompt, one busy session) spills onto the next replicas in its order instead of overloading one.

Pure: no Ray, no vLLM; time is an input. The Ray glue (the RequestRouter and the router deployment HAProxy
asks) is serve_app/serving/prefix_router.py.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from serve_app.config.vocabulary import RoutingDecision

ROUTING_KEY_KWARG = "routing_key"
"""The keyword the router deployment passes a request's key under to `choose_replica`."""

OPENING_MAX_CHARS = 16_384
"""Chat keys hash at most this much of the conversation's opening (bounds the work per request)."""
PROMPT_PREFIX_CHARS = 256
"""Completions keys: the prompt's first characters (a few KV blocks), all a plain prompt offers."""
PROMPT_PREFIX_TOKENS = 64
"""Completions keys of a prompt given as token ids: its first ids."""

LOAD_FACTOR = 1.25
"""A replica may hold up to this multiple of the average load before its keys spill (bounded-load
consistent hashing, Mirrokni et al. 2018, with epsilon 0.25)."""
LOAD_SLACK = 3
"""...or up to this many requests above the least loaded replica, so that affinity survives light load,
where one request more is already far above the average. 3, not 2: the estimate can count a request twice
for up to TRANSIT_S, and with 2 that alone spilled turns of two clients sharing a replica
(tests/unit/test_routing.py, test_two_clients_on_one_replica_never_spill)."""
PROBE_INTERVAL_S = 0.1
"""How often, while requests arrive, the router asks replicas for their in-flight counts."""
PROBE_DEADLINE_S = 0.25
"""How long the router waits for a replica's count (its event loop also runs the engine's output); a late
answer keeps the previous estimate."""
TRANSIT_S = 0.01
"""A request the router sent this shortly before a probe may not be in the replica's count yet (HAProxy
and the replica's event loop still have it), so it stays in the estimate on top of the count. Short: one
that is in the count already is counted twice meanwhile, and spurious spills break the affinity that is
the point; one that takes longer is missing from the estimate until the next probe (PROBE_INTERVAL_S)."""


def routing_key(body: bytes, session_id: str | None) -> str | None:
    """What a request shares with others, from its JSON body and session header; None: nothing known.

    In order: the session header (the client says which requests belong together); the OpenAI `user`
    field; a chat's opening (its messages up to and including the first user message: stable across a
    conversation's turns, since each turn resends the history); a completion prompt's first characters or
    token ids. vLLM's `cache_salt` separates caches, so it separates keys too. A body that is not JSON (also
    one HAProxy truncated at its buffer size) has no key.
    """
    if session_id:
        return f"session:{session_id}"
    try:
        data = json.loads(body)
    except ValueError:  # also UnicodeDecodeError
        return None
    if not isinstance(data, dict):
        return None
    salt = data.get("cache_salt")
    salt_text = salt if isinstance(salt, str) else ""
    user = data.get("user")
    if isinstance(user, str) and user:
        return f"user:{salt_text}:{user}"
    text = _chat_opening(data.get("messages"))
    if text is None:
        text = _prompt_start(data.get("prompt"))
    return None if text is None else f"text:{salt_text}:{text}"


def _chat_opening(messages: Any) -> str | None:
    if not isinstance(messages, list) or not messages:
        return None
    parts: list[str] = []
    for message in messages:
        if not isinstance(message, dict):
            return None
        role = str(message.get("role", ""))
        parts.append(f"{role}\x1f{_content_text(message.get('content'))}")
        if role == "user":
            break
    return "\x1e".join(parts)[:OPENING_MAX_CHARS]


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: text, images, ...
        return "\x1d".join(_part_text(part) for part in content)
    return "" if content is None else json.dumps(content, sort_keys=True)


def _part_text(part: Any) -> str:
    text = part.get("text") if isinstance(part, dict) else None
    return text if isinstance(text, str) else json.dumps(part, sort_keys=True)


def _prompt_start(prompt: Any) -> str | None:
    if isinstance(prompt, str) and prompt:
        return prompt[:PROMPT_PREFIX_CHARS]
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return ",".join(map(str, prompt[:PROMPT_PREFIX_TOKENS]))
    return None  # absent, empty, or a batch of prompts (no single replica suits them all)


def _weight(key: str, replica_id: str) -> int:
    digest = hashlib.blake2b(f"{key}\x00{replica_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def rendezvous_order(key: str, replica_ids: Iterable[str]) -> list[str]:
    """The replicas in `key`'s order of preference: by weight hash(key, replica), highest first."""
    return sorted(replica_ids, key=lambda r: (_weight(key, r), r), reverse=True)


def load_bound(loads: Iterable[int]) -> int:
    """The most requests any replica may hold after the next one is placed: LOAD_FACTOR times the average
    (that request included), or LOAD_SLACK above the least loaded replica, whichever is higher."""
    values = list(loads)
    average = (sum(values) + 1) / len(values)
    return max(math.ceil(LOAD_FACTOR * average), min(values) + LOAD_SLACK)


@dataclass(frozen=True)
class Choice:
    replica_id: str
    decision: RoutingDecision


def choose_replica(
    key: str | None, tie_break: str, loads: Mapping[str, int], capacities: Mapping[str, int]
) -> Choice:
    """The replica for a request with `key`, given each replica's in-flight requests and capacity.

    With a key: the first replica in the key's rendezvous order that stays within `load_bound` and below its
    capacity ("preferred" if that is the first one, else "spilled"). Without a key, or when every replica is
    full: the least loaded, ties ordered by `tie_break` (the request id), so they do not all land on one.
    """
    if not loads:
        raise ValueError("no replicas to choose from")
    if key is not None:
        bound = load_bound(loads.values())
        order = rendezvous_order(key, loads)
        for rank, replica in enumerate(order):
            if loads[replica] + 1 <= bound and loads[replica] < capacities[replica]:
                return Choice(replica, "preferred" if rank == 0 else "spilled")
    least = min(loads, key=lambda r: (loads[r], -_weight(tie_break, r), r))
    return Choice(least, "spilled" if key is not None else "no_key")


class LoadBook:
    """The router's estimate of each replica's in-flight requests: the replica's own count at the last probe
    that it answered, plus the requests the router sent it since, and those sent shortly before that probe
    (TRANSIT_S: on their way, perhaps not counted yet). The router never hears when a request ends (HAProxy
    forwards it), so it is the probes that bring counts back down. Time is an input (monotonic seconds)."""

    def __init__(self, probe_interval_s: float = PROBE_INTERVAL_S) -> None:
        self.probe_interval_s = probe_interval_s
        self._probed: dict[str, tuple[int, float]] = {}  # replica -> (count, when its probe was sent)
        self._picks: deque[tuple[float, str]] = deque()  # (when, replica), oldest first
        self._probe_sent_s: float | None = None  # the probe out, if any
        self._last_probe_s = -math.inf

    def _counted(self, replica: str, t_s: float) -> bool:
        """Whether a pick of `replica` at `t_s` is in its estimate (not surely in its probed count)."""
        return t_s >= self._probed.get(replica, (0, -math.inf))[1] - TRANSIT_S

    def loads(self, replica_ids: Iterable[str]) -> dict[str, int]:
        loads = {r: self._probed.get(r, (0, 0.0))[0] for r in replica_ids}
        for t_s, replica in self._picks:
            if replica in loads and self._counted(replica, t_s):
                loads[replica] += 1
        return loads

    def picked(self, replica_id: str, now_s: float) -> None:
        self._picks.append((now_s, replica_id))

    def should_probe(self, now_s: float) -> bool:
        return self._probe_sent_s is None and now_s - self._last_probe_s >= self.probe_interval_s

    def should_confirm(self, now_s: float) -> bool:
        """Whether a spill should wait for a (new or outstanding) probe: the estimate holds picks that a
        probe sent now would no longer count (older than TRANSIT_S: ended, or in the replica's count). At
        most one such probe per TRANSIT_S, since each drops the picks before it."""
        return any(t_s < now_s - TRANSIT_S and self._counted(r, t_s) for t_s, r in self._picks)

    @property
    def probe_out(self) -> bool:
        return self._probe_sent_s is not None

    def probe_started(self, now_s: float) -> None:
        self._probe_sent_s = self._last_probe_s = now_s

    def probe_finished(self, counts: Mapping[str, int | None]) -> None:
        """The probe's answers by replica (None: no answer in time, keep the estimate). Replicas that were
        not probed are gone and forgotten."""
        sent_s, self._probe_sent_s = self._probe_sent_s, None
        assert sent_s is not None, "probe_finished without probe_started"
        self._probed = {
            r: (count, sent_s) if count is not None else self._probed.get(r, (0, -math.inf))
            for r, count in counts.items()
        }
        self._picks = deque((t_s, r) for t_s, r in self._picks if r in counts and self._counted(r, t_s))
