"""Workload profiles and arrival schedules: deterministic, and each profile has the property it exists for."""

from __future__ import annotations

import hashlib
import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from loadtests.workloads import (
    DEFAULT_MAX_TOKENS,
    PROFILES,
    Step,
    arrival_times,
    iter_requests,
    make_requests,
    parse_duration_s,
    parse_steps,
    render_prompt,
    shared_system_prompt,
    step_index_at,
)

REPO = Path(__file__).resolve().parents[2]


def digest(requests: list[dict]) -> str:
    return hashlib.sha256(json.dumps(requests, sort_keys=True).encode()).hexdigest()


# --------------------------------------------------------------------------------------------------------
# Determinism
# --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("profile", PROFILES)
def test_same_seed_same_requests_other_seed_or_stream_other_requests(profile):
    a = make_requests(profile, 12, seed=7)
    assert a == make_requests(profile, 12, seed=7)
    assert a != make_requests(profile, 12, seed=8)
    assert a != make_requests(profile, 12, seed=7, stream=1)


@pytest.mark.parametrize("profile", PROFILES)
def test_a_longer_run_replays_a_shorter_one_first(profile):
    assert make_requests(profile, 20, seed=3)[:9] == make_requests(profile, 9, seed=3)


def test_requests_do_not_depend_on_the_process_hash_seed():
    code = (
        "import hashlib, json; from loadtests.workloads import PROFILES, make_requests; "
        "print(hashlib.sha256(json.dumps([make_requests(p, 6, 11, stream=2) for p in PROFILES], "
        "sort_keys=True).encode()).hexdigest())"
    )
    outs = set()
    for hash_seed in ("0", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": hash_seed}
        run = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True)
        assert run.returncode == 0, run.stderr
        outs.add(run.stdout.strip())
    assert outs == {digest([make_requests(p, 6, 11, stream=2) for p in PROFILES])}


# --------------------------------------------------------------------------------------------------------
# Every profile
# --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("profile", PROFILES)
def test_request_shape(profile):
    for r in make_requests(profile, 15, seed=0):
        assert r["profile"] == profile
        assert r["messages"] and r["messages"][-1]["role"] == "user"
        assert all(m["role"] in ("system", "user", "assistant") and m["content"] for m in r["messages"])
        assert r["prompt"] == render_prompt(r["messages"])
        assert r["max_tokens"] == DEFAULT_MAX_TOKENS[profile]
        assert 0 <= r["seed"] < 2**31
        assert r["turn"] >= 1 and r["conversation"]
    assert len({r["id"] for r in make_requests(profile, 30, seed=0)}) == 30


@pytest.mark.parametrize("profile", PROFILES)
def test_max_tokens_override(profile):
    assert {r["max_tokens"] for r in make_requests(profile, 5, seed=0, max_tokens=32)} == {32}


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="unknown profile 'chatty'; expected one of random"):
        make_requests("chatty", 1, 0)
    with pytest.raises(ValueError, match="tokens_per_word must be > 0"):
        make_requests("random", 1, 0, tokens_per_word=0)
    with pytest.raises(ValueError, match="max_tokens must be >= 1"):
        make_requests("random", 1, 0, max_tokens=0)


# --------------------------------------------------------------------------------------------------------
# Profile properties
# --------------------------------------------------------------------------------------------------------


def test_random_prompts_have_the_set_length_and_share_no_prefix():
    reqs = make_requests("random", 40, seed=0, input_tokens=130, tokens_per_word=1.3)
    assert {r["prompt_words"] for r in reqs} == {100}
    first_words = {" ".join(r["messages"][0]["content"].split()[:3]) for r in reqs}
    assert len(first_words) == len(reqs)
    other_user = make_requests("random", 40, seed=0, stream=1, input_tokens=130)
    assert not {r["prompt"] for r in reqs} & {r["prompt"] for r in other_user}


def test_shared_prefix_is_really_shared_across_requests_seeds_and_streams():
    reqs = [
        r
        for seed in (0, 1)
        for stream in (0, 5)
        for r in make_requests("shared-prefix", 10, seed, stream=stream)
    ]
    systems = {r["messages"][0]["content"] for r in reqs}
    assert len(systems) == 1
    system = systems.pop()
    assert system == shared_system_prompt()
    assert 1400 <= len(system.split()) <= 1600  # ~2,000 tokens at 1.3 tokens/word
    # the user turns are short and unique
    users = [r["messages"][1]["content"] for r in reqs]
    assert len(set(users)) == len(users)
    assert max(len(u.split()) for u in users) < 60
    # the completions prompt shares the whole system prompt as a prefix too
    common = os.path.commonprefix([r["prompt"] for r in reqs])
    assert len(common) >= len(system)


def test_shared_prefix_with_several_tenants_draws_each_request_from_their_prompts():
    reqs = [
        r for stream in range(4) for r in make_requests("shared-prefix", 50, 0, stream=stream, prefix_count=8)
    ]
    systems = [r["messages"][0]["content"] for r in reqs]
    assert set(systems) == {shared_system_prompt(tenant=k) for k in range(8)}  # one text per tenant
    assert shared_system_prompt(tenant=0) == shared_system_prompt()  # tenant 0 is the default profile's
    # no tenant's prompt is a prefix of another's beyond their shared opening words
    opening = os.path.commonprefix(sorted(set(systems)))
    assert len(opening) < 80
    with pytest.raises(ValueError, match="prefix_count"):
        make_requests("shared-prefix", 1, 0, prefix_count=0)


def test_shared_prefix_length_follows_tokens_per_word():
    short = make_requests("shared-prefix", 1, 0, prefix_tokens=1500, tokens_per_word=4.5)[0]
    assert abs(len(short["messages"][0]["content"].split()) - 1500 / 4.5) <= 2


def test_multi_turn_conversations_grow_turn_by_turn():
    reqs = make_requests("multi-turn", 60, seed=0)
    by_conv: dict[str, list[dict]] = {}
    for r in reqs:
        by_conv.setdefault(r["conversation"], []).append(r)
    complete = list(by_conv.values())[:-1]  # the last one may be cut off at n
    assert len(complete) >= 5
    for turns in complete:
        assert [r["turn"] for r in turns] == list(range(1, len(turns) + 1))
        assert 3 <= len(turns) <= 6
        for prev, cur in zip(turns, turns[1:], strict=False):
            # the next request resends the previous one's messages plus a reply and a new user turn
            assert cur["messages"][: len(prev["messages"])] == prev["messages"]
            assert [m["role"] for m in cur["messages"][len(prev["messages"]) :]] == ["assistant", "user"]
            assert cur["prompt_words"] > prev["prompt_words"]
            assert cur["prompt"].startswith(prev["prompt"][: -len("Assistant:")])


def test_structured_and_creative_differ_where_speculation_does():
    structured = make_requests("structured", 30, seed=0)
    creative = make_requests("creative", 30, seed=0)
    # structured: SQL, code and JSON in an even mix, greedy; creative: prose, sampled
    assert {r["kind"] for r in structured} == {"sql", "code", "json"}
    assert {r["kind"] for r in creative} == {"prose"}
    assert {r["temperature"] for r in structured} == {0.0}
    assert min(r["temperature"] for r in creative) >= 0.7
    markers = ("CREATE TABLE", "def ", '"order_id": ...')
    assert all(any(m in r["prompt"] for m in markers) for r in structured)
    assert not any(any(m in r["prompt"] for m in markers) for r in creative)
    # creative asks for longer, open-ended output
    assert DEFAULT_MAX_TOKENS["creative"] > DEFAULT_MAX_TOKENS["structured"]
    # structured prompts carry identifiers an answer repeats (what ngram drafting copies from)
    sql = next(r for r in structured if r["kind"] == "sql")
    assert "_id" in sql["prompt"]


# --------------------------------------------------------------------------------------------------------
# Steps and the open-loop arrival schedule
# --------------------------------------------------------------------------------------------------------


def test_parse_steps_and_durations():
    assert parse_steps("1:30,4:30s, 16:2m") == [Step(1, 30), Step(4, 30), Step(16, 120)]
    assert parse_steps("0.5:500ms") == [Step(0.5, 0.5)]
    assert parse_duration_s("1h") == 3600
    for bad, message in (
        ("", "no steps"),
        ("4", "expected VALUE:DURATION"),
        ("x:30", "expected a number"),
        ("4:soon", "bad duration"),
        ("4:0", "duration > 0"),
    ):
        with pytest.raises(ValueError, match=message):
            parse_steps(bad)


def test_step_index_at():
    steps = parse_steps("1:10,4:20")
    assert [step_index_at(steps, t) for t in (0, 9.99, 10, 29.99, 30, 100)] == [0, 0, 1, 1, None, None]


def test_arrivals_are_deterministic_and_poisson_at_burstiness_1():
    steps = [Step(20, 200)]
    a = arrival_times(steps, seed=1)
    assert a == arrival_times(steps, seed=1)
    assert a != arrival_times(steps, seed=2)
    n = len(a)
    assert abs(n - 4000) < 4 * math.sqrt(4000)
    gaps = [y.at_s - x.at_s for x, y in zip(a, a[1:], strict=False)]
    assert statistics.fmean(gaps) == pytest.approx(1 / 20, rel=0.05)
    assert statistics.pstdev(gaps) / statistics.fmean(gaps) == pytest.approx(
        1.0, abs=0.08
    )  # exponential: CV 1
    assert [x.index for x in a] == list(range(n))
    assert all(0 <= x.at_s < 200 for x in a)


def test_lower_burstiness_clumps_arrivals_at_the_same_mean_rate():
    a = arrival_times([Step(20, 200)], burstiness=0.25, seed=1)
    gaps = [y.at_s - x.at_s for x, y in zip(a, a[1:], strict=False)]
    assert statistics.fmean(gaps) == pytest.approx(1 / 20, rel=0.1)
    assert statistics.pstdev(gaps) / statistics.fmean(gaps) == pytest.approx(2.0, rel=0.15)  # 1/sqrt(0.25)


def test_rate_steps_and_pauses():
    a = arrival_times(parse_steps("10:50,0:10,40:50"), seed=0)
    per_step = [sum(1 for x in a if x.step_index == i) for i in range(3)]
    assert abs(per_step[0] - 500) < 4 * math.sqrt(500)
    assert per_step[1] == 0
    assert abs(per_step[2] - 2000) < 4 * math.sqrt(2000)
    assert all((0 <= x.at_s < 50) if x.step_index == 0 else (60 <= x.at_s < 110) for x in a)
    assert {x.rate_rps for x in a if x.step_index == 2} == {40}
    with pytest.raises(ValueError, match="burstiness must be > 0"):
        arrival_times([Step(1, 1)], burstiness=0)


def test_iter_requests_is_endless():
    stream = iter_requests("random", 0)
    assert len([next(stream) for _ in range(500)]) == 500
