"""Prefix-affinity routing decisions (serve_app/serving/routing.py): keys, rendezvous order, bounded load,
the router's load estimate. Pure: no Ray."""

from __future__ import annotations

import json
import math
import random
from collections import Counter
from typing import Any

import pytest

from loadtests.workloads import make_requests
from serve_app.config import ConfigError, deep_merge, load_env_config, parse_config
from serve_app.serving.routing import (
    LOAD_FACTOR,
    LOAD_SLACK,
    OPENING_MAX_CHARS,
    PROMPT_PREFIX_CHARS,
    TRANSIT_S,
    LoadBook,
    choose_replica,
    load_bound,
    rendezvous_order,
    routing_key,
)

REPLICAS = [f"r{i}" for i in range(4)]


def body(**fields: Any) -> bytes:
    return json.dumps({"model": "m", **fields}).encode()


def chat(*turns: tuple[str, str], **fields: Any) -> bytes:
    return body(messages=[{"role": role, "content": content} for role, content in turns], **fields)


def keys_of(profile: str, n: int) -> list[tuple[str, int, str | None]]:
    """(conversation, turn, key) for the first n requests of a workload profile, as Locust sends them."""
    return [
        (r["conversation"], r["turn"], routing_key(body(messages=r["messages"]), None))
        for r in make_requests(profile, n, seed=0)
    ]


# ------------------------------------------------------------------------------------------- routing_key


SYSTEM = ("system", "You are a helpful assistant.")


@pytest.mark.parametrize(
    ("name", "first", "second", "same"),
    [
        (
            "later turns keep the opening's key",
            chat(SYSTEM, ("user", "hi")),
            chat(SYSTEM, ("user", "hi"), ("assistant", "hello"), ("user", "more")),
            True,
        ),
        (
            "another first question is another conversation",
            chat(SYSTEM, ("user", "hi")),
            chat(SYSTEM, ("user", "bye")),
            False,
        ),
        (
            "a user-only opening",
            chat(("user", "hi")),
            chat(("user", "hi"), ("assistant", "x"), ("user", "y")),
            True,
        ),
        (
            "the user field groups a user's requests",
            chat(SYSTEM, ("user", "a"), user="u1"),
            chat(("user", "b"), user="u1"),
            True,
        ),
        (
            "different users",
            chat(SYSTEM, ("user", "a"), user="u1"),
            chat(SYSTEM, ("user", "a"), user="u2"),
            False,
        ),
        (
            "cache_salt separates caches, so keys",
            chat(SYSTEM, ("user", "a"), cache_salt="t1"),
            chat(SYSTEM, ("user", "a"), cache_salt="t2"),
            False,
        ),
        (
            "text parts count like plain content",
            chat(SYSTEM, ("user", "a b")),
            body(
                messages=[
                    {"role": "system", "content": [{"type": "text", "text": SYSTEM[1]}]},
                    {"role": "user", "content": "a b"},
                ]
            ),
            True,
        ),
        (
            "completions: the prompt's first characters",
            body(prompt="x" * PROMPT_PREFIX_CHARS + "tail one"),
            body(prompt="x" * PROMPT_PREFIX_CHARS + "tail two"),
            True,
        ),
        ("completions: different starts", body(prompt="alpha question"), body(prompt="beta question"), False),
        (
            "token-id prompts by their first ids",
            body(prompt=list(range(100))),
            body(prompt=[*range(64), 7, 7]),
            True,
        ),
        (
            "field order and spacing do not matter",
            chat(SYSTEM, ("user", "a")),
            json.dumps(
                {
                    "messages": [{"content": SYSTEM[1], "role": "system"}, {"content": "a", "role": "user"}],
                    "model": "m",
                },
                indent=2,
            ).encode(),
            True,
        ),
    ],  # fmt: skip
)
def test_keys_group_what_shares_a_prefix(name: str, first: bytes, second: bytes, same: bool) -> None:
    a, b = routing_key(first, None), routing_key(second, None)
    assert a is not None and b is not None
    assert (a == b) is same, name


@pytest.mark.parametrize(
    ("name", "raw"),
    [
        ("truncated by HAProxy's buffer", chat(SYSTEM, ("user", "x" * 100))[:60]),
        ("not JSON", b"hello"),
        ("not UTF-8", b"\xff\xfe{"),
        ("a JSON list", b"[1, 2]"),
        ("empty body", b""),
        ("no messages or prompt", body(input="embed me")),
        ("a batch of prompts", body(prompt=["a", "b"])),
        ("empty prompt", body(prompt="")),
        ("messages that are not objects", body(messages=["hi"])),
    ],
)
def test_requests_without_a_key(name: str, raw: bytes) -> None:
    assert routing_key(raw, None) is None, name


def test_session_header_wins_over_the_body() -> None:
    assert routing_key(chat(SYSTEM, ("user", "a"), user="u1"), "s-1") == "session:s-1"
    assert routing_key(b"not json", "s-1") == "session:s-1"
    assert routing_key(chat(SYSTEM, ("user", "a")), "") == routing_key(chat(SYSTEM, ("user", "a")), None)


def test_long_openings_are_cut() -> None:
    long = "w" * (OPENING_MAX_CHARS * 2)
    a = routing_key(chat(("system", long), ("user", "a")), None)
    b = routing_key(chat(("system", long), ("user", "b")), None)
    assert a == b and a is not None and len(a) < OPENING_MAX_CHARS + 16


def test_multi_turn_profile_keys_one_per_conversation() -> None:
    rows = keys_of("multi-turn", 40)
    by_conversation: dict[str, set[str | None]] = {}
    for conversation, _, key in rows:
        by_conversation.setdefault(conversation, set()).add(key)
    assert len(by_conversation) >= 5
    assert all(len(keys) == 1 and None not in keys for keys in by_conversation.values())
    assert len({next(iter(k)) for k in by_conversation.values()}) == len(by_conversation)


def test_shared_prefix_and_random_profiles_spread_by_request() -> None:
    # Every shared-prefix request opens with the same system prompt but its own ticket: each is its own
    # conversation, so load spreads (every replica caches the shared prompt once).
    for profile in ("shared-prefix", "random"):
        keys = [key for _, _, key in keys_of(profile, 20)]
        assert None not in keys and len(set(keys)) == 20, profile


# -------------------------------------------------------------------------------------- rendezvous order


def test_rendezvous_order_is_a_deterministic_permutation() -> None:
    order = rendezvous_order("k", REPLICAS)
    assert sorted(order) == REPLICAS
    assert rendezvous_order("k", list(reversed(REPLICAS))) == order
    firsts = Counter(rendezvous_order(f"key{i}", REPLICAS)[0] for i in range(4000))
    assert set(firsts) == set(REPLICAS) and min(firsts.values()) > 800  # about 1000 each


@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_removing_a_replica_moves_only_its_keys(n: int) -> None:
    replicas = [f"rep-{i}" for i in range(n)]
    keys = [f"conversation-{i}" for i in range(5000)]
    before = {k: rendezvous_order(k, replicas)[0] for k in keys}
    gone = replicas[1]
    after = {k: rendezvous_order(k, [r for r in replicas if r != gone])[0] for k in keys}
    moved = {k for k in keys if before[k] != after[k]}
    assert moved == {k for k in keys if before[k] == gone}
    # ...and they move to their own second choice, spread over the others.
    assert all(after[k] == rendezvous_order(k, replicas)[1] for k in moved)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
def test_adding_a_replica_moves_about_one_in_n_plus_one(n: int) -> None:
    replicas = [f"rep-{i}" for i in range(n)]
    keys = [f"conversation-{i}" for i in range(6000)]
    before = {k: rendezvous_order(k, replicas)[0] for k in keys}
    after = {k: rendezvous_order(k, [*replicas, "new"])[0] for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert all(after[k] == "new" for k in moved)  # nothing shuffles between the old replicas
    expected = len(keys) / (n + 1)
    assert abs(len(moved) - expected) < 4 * math.sqrt(expected), (len(moved), expected)


# ------------------------------------------------------------------------------------------ bounded load


@pytest.mark.parametrize(
    ("loads", "bound"),
    [
        ([0, 0], LOAD_SLACK),  # light load: the slack decides
        ([1, 0], 3),
        ([10, 10], math.ceil(LOAD_FACTOR * 21 / 2)),  # 14: the factor decides
        ([30, 2], math.ceil(LOAD_FACTOR * 33 / 2)),
        ([5, 5, 5, 5], 8),
        ([40, 40], 51),
    ],
)
def test_load_bound(loads: list[int], bound: int) -> None:
    assert load_bound(loads) == bound


CAP = {r: 100 for r in REPLICAS}


def test_a_key_goes_to_its_first_replica_when_it_has_room() -> None:
    loads = dict.fromkeys(REPLICAS, 3)
    for i in range(50):
        key = f"k{i}"
        assert choose_replica(key, "t", loads, CAP).replica_id == rendezvous_order(key, REPLICAS)[0]
        assert choose_replica(key, "t", loads, CAP).decision == "preferred"


def test_a_key_spills_in_its_own_order_when_its_replica_is_over_its_share() -> None:
    order = rendezvous_order("hot", REPLICAS)
    loads = {order[0]: 9, order[1]: 9, order[2]: 1, order[3]: 0}  # bound: max(ceil(1.25*20/4)=7, 0+3) = 7
    choice = choose_replica("hot", "t", loads, CAP)
    assert (choice.replica_id, choice.decision) == (order[2], "spilled")


def test_light_load_keeps_affinity() -> None:
    # At concurrency 1 the router may still count its previous pick (no probe answer yet): one request
    # "in flight" on the preferred replica, none elsewhere, must not move the key.
    order = rendezvous_order("conv", REPLICAS[:2])
    choice = choose_replica("conv", "t", {order[0]: 1, order[1]: 0}, CAP)
    assert (choice.replica_id, choice.decision) == (order[0], "preferred")


def test_capacity_is_respected_and_all_full_takes_the_least_loaded() -> None:
    order = rendezvous_order("k", REPLICAS[:2])
    caps = {order[0]: 4, order[1]: 4}
    assert choose_replica("k", "t", {order[0]: 4, order[1]: 3}, caps).replica_id == order[1]
    choice = choose_replica("k", "t", {order[0]: 9, order[1]: 5}, caps)
    assert (choice.replica_id, choice.decision) == (order[1], "spilled")


def test_no_key_takes_the_least_loaded_and_spreads_ties() -> None:
    loads = {"r0": 2, "r1": 0, "r2": 0, "r3": 1}
    picks = Counter(choose_replica(None, f"req-{i}", loads, CAP).replica_id for i in range(400))
    assert set(picks) == {"r1", "r2"} and min(picks.values()) > 120
    assert choose_replica(None, "req-0", loads, CAP).decision == "no_key"


def test_no_replicas_is_an_error() -> None:
    with pytest.raises(ValueError, match="no replicas"):
        choose_replica("k", "t", {}, {})


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("hot_share", [1.0, 0.8, 0.5])
def test_skewed_keys_never_push_a_replica_past_its_bound(n: int, hot_share: float) -> None:
    """Requests pile up (none ends): after every placement, no replica holds more than the bound."""
    replicas = [f"rep-{i}" for i in range(n)]
    loads = dict.fromkeys(replicas, 0)
    caps = dict.fromkeys(replicas, 1000)
    for i in range(200):
        key = "hot" if i % 10 < round(10 * hot_share) else f"cold-{i}"
        bound = load_bound(loads.values())
        replica = choose_replica(key, f"t{i}", loads, caps).replica_id
        loads[replica] += 1
        assert loads[replica] <= bound
    total = sum(loads.values())
    assert max(loads.values()) <= max(math.ceil(LOAD_FACTOR * total / n), min(loads.values()) + LOAD_SLACK)


# -------------------------------------------------------------------------------------------- load book


def test_load_book_counts_picks_on_top_of_the_last_probe() -> None:
    book = LoadBook(probe_interval_s=0.1)
    assert book.should_probe(0.0)
    book.probe_started(0.0)
    assert not book.should_probe(0.5)  # one probe at a time
    book.picked("a", 0.01)
    book.picked("a", 0.02)
    book.picked("b", 0.02)
    assert book.loads(["a", "b", "c"]) == {"a": 2, "b": 1, "c": 0}
    book.probe_finished({"a": 5, "b": None, "c": 0})
    # a: its count, plus the picks sent after the probe (perhaps not in it); b: no answer, as it was.
    assert book.loads(["a", "b", "c"]) == {"a": 7, "b": 1, "c": 0}
    assert not book.should_probe(0.05) and book.should_probe(0.1)
    book.probe_started(1.0)
    book.picked("a", 1.01)
    book.probe_finished({"a": 5, "b": 0, "c": 0})
    # Picks long before the probe are in its count or have ended; the one after it may not be.
    assert book.loads(["a", "b", "c"]) == {"a": 6, "b": 0, "c": 0}


def test_picks_just_before_a_probe_still_count() -> None:
    """A request sent just before a probe may still be on its way (HAProxy, the replica's event loop)."""
    book = LoadBook()
    book.picked("a", 1.0 - TRANSIT_S / 2)
    book.picked("a", 1.0 - 2 * TRANSIT_S)
    book.probe_started(1.0)
    book.probe_finished({"a": 0})
    assert book.loads(["a"]) == {"a": 1}


def test_load_book_forgets_replicas_that_were_not_probed() -> None:
    book = LoadBook()
    book.probe_started(0.0)
    book.probe_finished({"a": 3, "b": 1})
    book.picked("b", 0.5)
    book.probe_started(1.0)
    book.probe_finished({"a": 0})  # b has left
    assert book.loads(["a", "b"]) == {"a": 0, "b": 0}


def test_probe_finished_needs_a_probe() -> None:
    with pytest.raises(AssertionError):
        LoadBook().probe_finished({"a": 0})


def test_a_spill_resting_on_picks_a_probe_would_drop_waits_for_one() -> None:
    book = LoadBook(probe_interval_s=0.1)
    book.probe_started(0.0)
    book.probe_finished({"a": 0, "b": 0})
    assert not book.should_confirm(0.5)  # nothing but probed counts
    book.picked("a", 0.5)
    assert not book.should_confirm(0.5 + TRANSIT_S / 2)  # a fresh probe would still count it
    assert book.should_confirm(0.5 + 2 * TRANSIT_S)
    book.probe_started(0.6)
    book.probe_finished({"a": 0, "b": 0})
    assert not book.should_confirm(0.6 + 2 * TRANSIT_S)  # that probe dropped it


# Requests come more than TRANSIT_S / LOAD_SLACK apart (an LLM request takes longer than that).
@pytest.mark.parametrize("gap_s", [1.2 * TRANSIT_S / LOAD_SLACK, 0.05, 0.1, 0.3])
def test_sequential_turns_stay_on_one_replica(gap_s: float) -> None:
    """Concurrency 1 (each request ended before the next): the router never hears of the ends, so its own
    picks pile up between probes, but a spill they would cause waits for a probe (as the router does), so
    a conversation's turns all go to one replica."""
    book = LoadBook(probe_interval_s=0.1)
    caps = {"a": 32, "b": 32}

    def probe(now_s: float) -> None:
        book.probe_started(now_s)
        book.probe_finished({"a": 0, "b": 0})

    chosen = []
    for turn in range(40):
        now_s = turn * gap_s
        if book.should_probe(now_s):
            probe(now_s)
        choice = choose_replica("conversation", f"t{turn}", book.loads(caps), caps)
        if choice.decision == "spilled" and book.should_confirm(now_s):
            probe(now_s)
            choice = choose_replica("conversation", f"t{turn}", book.loads(caps), caps)
        book.picked(choice.replica_id, now_s)
        chosen.append(choice.replica_id)
    assert chosen == [rendezvous_order("conversation", caps)[0]] * 40


def closed_loop_spills(clients: int, duration_s: tuple[float, float], seed: int) -> int:
    """`clients` closed-loop clients whose keys all prefer one of two replicas, 300 requests, each lasting
    a random time in `duration_s`, next one 2 ms after; probes every PROBE_INTERVAL_S answer each replica's
    true in-flight count, and a spill waits for one where the router would. The number of spills."""
    rng = random.Random(seed)
    caps = {"a": 32, "b": 32}
    key = next(k for k in (f"k{i}" for i in range(100)) if rendezvous_order(k, caps)[0] == "a")
    book, ends = LoadBook(), {"a": [0.0], "b": [0.0]}
    clock = [(rng.uniform(0, 0.05), c) for c in range(clients)]
    spills = 0

    def probe(now_s: float) -> None:
        book.probe_started(now_s)
        book.probe_finished({r: sum(end > now_s for end in ends[r]) for r in caps})

    for i in range(300):
        clock.sort()
        now_s, client = clock.pop(0)
        if book.should_probe(now_s):
            probe(now_s)
        choice = choose_replica(key, f"t{i}", book.loads(caps), caps)
        if choice.decision == "spilled" and book.should_confirm(now_s):
            probe(now_s)
            choice = choose_replica(key, f"t{i}", book.loads(caps), caps)
        book.picked(choice.replica_id, now_s)
        end_s = now_s + rng.uniform(*duration_s)
        ends[choice.replica_id].append(end_s)
        clock.append((end_s + 0.002, client))
        spills += choice.decision == "spilled"
    return spills


@pytest.mark.parametrize("duration_s", [(0.05, 0.15), (0.1, 0.4), (0.5, 1.5)])
@pytest.mark.parametrize("seed", [0, 1])
def test_two_clients_on_one_replica_never_spill(duration_s: tuple[float, float], seed: int) -> None:
    """Two conversations whose keys share a replica are well within its bounded share: every spill would be
    the estimate counting a request twice (TRANSIT_S) or a stale count, and LOAD_SLACK absorbs those."""
    assert closed_loop_spills(2, duration_s, seed) == 0


def test_a_hot_key_with_many_clients_does_spill() -> None:
    """Eight clients on one key: the bound moves some of them (so the check above can fail)."""
    assert closed_loop_spills(8, (0.1, 0.4), 0) > 30


# ------------------------------------------------------------------------------------------------ config


def config(**overlay: Any):
    return parse_config(deep_merge(load_env_config("local").model_dump(mode="json"), overlay))


def test_routing_defaults_to_least_loaded_and_accepts_prefix_affinity() -> None:
    assert config().deployment.routing == "least_loaded"
    assert config(deployment={"routing": "prefix_affinity"}).deployment.routing == "prefix_affinity"


def test_bad_routing_names_the_field_and_the_choices() -> None:
    with pytest.raises(ConfigError) as e:
        config(deployment={"routing": "prefix"})
    assert "deployment.routing" in str(e.value)
    assert "'least_loaded', 'prefix_affinity'" in str(e.value)
