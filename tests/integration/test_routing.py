"""Prefix-affinity routing on real Ray Serve: two real vLLM CPU engines behind HAProxy and the router it asks.

The app (tests/integration/configs/routing.yaml) is deployed beside the session's apps by `headroom serve`
itself, as a user would. Which replica served a request is read from Serve's own access log of each replica
(the request id the client sent, which HAProxy keeps); the spills and the cache hits from the Prometheus
metrics of the router and of vLLM.
"""

from __future__ import annotations

import math
import re
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import httpx
import pytest
import ray
from ray import serve

from loadtests.workloads import make_requests
from serve_app.config import DEFAULT_CONFIG_DIR
from serve_app.serving.routing import LOAD_FACTOR
from tests.integration.conftest import HERE, overlay

pytestmark = pytest.mark.integration

REPO = HERE.parents[1]
APP = "routing"
MODEL = "tiny-qwen3-routed"
TINY_TOKENS_PER_WORD = 4.5  # the embedded model's toy tokenizer (loadtests/workloads.py)
HOT_REQUESTS = 16
# Serve's access log, written as a request ends:
# "<level> <date> <time,ms> <app>_<deployment> <replica id> <request id> -- POST <path> <status> <ms>ms".
ACCESS_LOG = f"{APP}_LLMServer "
ACCESS_LINE = re.compile(
    rf"(?P<ended>\d{{4}}-\d\d-\d\d \d\d:\d\d:\d\d,\d{{3}}) {APP}_LLMServer (?P<replica>\S+) "
    rf"(?P<rid>[0-9a-f]{{32}}) -- POST /\S* \d+ (?P<ms>[0-9.]+)ms"
)


@dataclass(frozen=True)
class Served:
    replica: str
    start_s: float  # on the replica's clock, as its access log says
    end_s: float


@pytest.fixture(scope="module")
def routed(cluster):
    cfg = overlay("routing.yaml")
    files = [
        DEFAULT_CONFIG_DIR / "base.yaml",
        DEFAULT_CONFIG_DIR / "local.yaml",
        HERE / "configs" / "routing.yaml",
    ]
    cmd = [sys.executable, "-m", "serve_app.cli.commands", "serve", "--no-blocking"]
    cmd += [arg for f in files for arg in ("--config", str(f))]
    cmd += ["--address", ray.get_runtime_context().gcs_address]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    yield cfg
    serve.delete(cfg.name)


def access_log_lines() -> Iterator[str]:
    """Serve's access-log lines of the app's replicas: in the replica's Serve log, or (once vLLM has set up
    its logging in the replica) in the Ray worker's stderr file."""
    [node] = [n for n in ray.nodes() if n["Alive"]]
    logs = Path(node["ObjectStoreSocketName"]).parents[1] / "logs"
    for path in [*logs.glob("serve/replica_*.log"), *logs.glob("worker-*.err")]:
        yield from (line for line in path.read_text(errors="replace").splitlines() if ACCESS_LOG in line)


def served_by(request_ids: list[str], timeout_s: float = 60) -> dict[str, Served]:
    """Where and when each request id was served, from the replicas' access logs (written as it ends)."""
    deadline = time.time() + timeout_s
    wanted, found = set(request_ids), {}
    while time.time() < deadline:
        for line in access_log_lines():
            m = ACCESS_LINE.search(line)
            if m and m["rid"] in wanted:
                end_s = datetime.strptime(m["ended"], "%Y-%m-%d %H:%M:%S,%f").timestamp()
                found[m["rid"]] = Served(m["replica"], end_s - float(m["ms"]) / 1000, end_s)
        if len(found) == len(wanted):
            return found
        time.sleep(1)
    missing = sorted(wanted - set(found))
    raise AssertionError(f"{len(missing)} request ids in no access log after {timeout_s} s: {missing[:5]}")


def prefix_cache_hits(cluster) -> Counter[str]:
    """vLLM's prefix-cache hits (tokens) of the app's engines, by replica id."""
    hits: Counter[str] = Counter()
    for labels, value in cluster.metrics().get("ray_vllm_prefix_cache_hits_total", []):
        if labels.get("model_name") == MODEL:
            hits[labels["ReplicaId"]] += int(value)
    return hits


def wait_for_hits(cluster, replicas: set[str], before: Counter[str], timeout_s: float = 60) -> None:
    """Ray exports metrics on an interval: poll until every replica in `replicas` counts new hits."""
    deadline = time.time() + timeout_s
    while True:
        now = prefix_cache_hits(cluster)
        if all(now[r] > before[r] for r in replicas):
            return
        assert time.time() < deadline, f"no new prefix-cache hits on some of {replicas}: {before} -> {now}"
        time.sleep(1)


def chat(client, messages, *, session: str | None = None, max_tokens: int = 4) -> str:
    """One chat completion with a fresh request id (returned), through the official client."""
    rid = uuid.uuid4().hex
    headers = {"x-request-id": rid, **({"x-session-id": session} if session else {})}
    r = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=max_tokens, extra_headers=headers,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert r.usage.completion_tokens == max_tokens
    return rid


def test_conversations_and_sessions_return_to_their_replica(cluster, routed):
    """Multi-turn conversations (keyed by their opening) and shared-prefix tickets in sessions (keyed by the
    session header), two at a time, each thread sending its turns in order. Two in flight never put a
    replica over its bounded share (LOAD_SLACK), so every turn that moves is a routing error, not a spill;
    with four, keys that happen to share a replica rightly spill."""
    client = cluster.client(f"/{APP}", timeout=300)
    turns = [
        r
        for r in make_requests("multi-turn", 24, seed=7, tokens_per_word=TINY_TOKENS_PER_WORD)
        if r["turn"] <= 3
    ]
    conversations: dict[str, list[dict]] = {}
    for r in turns:
        conversations.setdefault(r["conversation"], []).append(r)
    tickets = make_requests(
        "shared-prefix", 12, seed=7, tokens_per_word=TINY_TOKENS_PER_WORD, prefix_tokens=600
    )
    sessions = {f"session-{i}": tickets[i::4] for i in range(4)}
    sent: dict[str, list[str]] = {}
    lock = threading.Lock()
    hits_before = prefix_cache_hits(cluster)

    def run(name: str, requests: list[dict], session: str | None) -> None:
        ids = [chat(client, r["messages"], session=session) for r in requests]
        with lock:
            sent[name] = ids

    with ThreadPoolExecutor(2) as pool:
        jobs = [pool.submit(run, c, rs, None) for c, rs in conversations.items() if len(rs) > 1]
        jobs += [pool.submit(run, s, rs, s) for s, rs in sessions.items()]
        for job in jobs:
            job.result()
    assert len(sent) >= 8
    where = {rid: s.replica for rid, s in served_by([rid for ids in sent.values() for rid in ids]).items()}
    later = [where[rid] == where[ids[0]] for ids in sent.values() for rid in ids[1:]]
    assert len(later) >= 12
    assert sum(later) / len(later) >= 0.9, {name: [where[r] for r in ids] for name, ids in sent.items()}
    # ...where vLLM found their earlier turns cached: its own prefix-cache counters, per replica.
    wait_for_hits(cluster, {where[rid] for ids in sent.values() for rid in ids[1:]}, hits_before)


def test_a_hot_session_spills_but_stays_within_its_bounded_share(cluster, routed):
    """One session sends 16 long requests, 100 ms apart, all in flight together: unbounded affinity would
    put all 16 on one replica; the bound lets one replica hold LOAD_FACTOR times its share at most."""
    client = cluster.client(f"/{APP}", timeout=300)
    messages = [{"role": "user", "content": "Write a long story about a very busy replica."}]
    spilled_before = cluster.metric_sum(
        "ray_headroom_routing_decisions_total", application=APP, decision="spilled"
    )

    def one(i: int) -> str:
        time.sleep(0.1 * i)  # one at a time, so that each decision sees the ones before
        return chat(client, messages, session="hot", max_tokens=600)

    with ThreadPoolExecutor(HOT_REQUESTS) as pool:
        ids = list(pool.map(one, range(HOT_REQUESTS)))
    served = served_by(ids).values()
    # The bound is on requests in flight at once: the check means something only if all 16 were.
    assert max(s.start_s for s in served) < min(s.end_s for s in served), "requests did not all overlap"
    counts = Counter(s.replica for s in served)
    decisions = {
        d: cluster.metric_sum("ray_headroom_routing_decisions_total", application=APP, decision=d)
        for d in ("preferred", "spilled")
    }
    assert len(counts) == 2, (counts, decisions)  # it spilled...
    assert max(counts.values()) <= math.ceil(LOAD_FACTOR * HOT_REQUESTS / 2) + 1, (
        counts,
        decisions,
    )  # ...within the bound
    cluster.wait_for_metric(
        "ray_headroom_routing_decisions_total", spilled_before + 1, application=APP, decision="spilled"
    )


def test_gets_skip_the_router_and_oversized_bodies_still_reach_a_replica(cluster, routed):
    base = f"{cluster.base_url}/{APP}"
    assert httpx.get(f"{base}/v1/models", timeout=30).json()["data"][0]["id"] == MODEL
    # Over HAProxy's 256 KiB routing buffer: the router sees it cut short (routed by load), the replica
    # gets all of it, and vLLM answers with its own OpenAI error (the prompt exceeds the context).
    big = {"model": MODEL, "messages": [{"role": "user", "content": "word " * 80_000}], "max_tokens": 4}
    r = httpx.post(f"{base}/v1/chat/completions", json=big, timeout=120)
    assert r.status_code == 400, r.text[:500]
    assert r.json()["error"]["message"]
