"""An engine that dies takes its replica down so Ray Serve replaces it; other replicas are unaffected.

It kills the `draft` app's engine, then waits until Serve has replaced the replica, so the tests after it find
the app serving again.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import openai
import psutil
import pytest
from ray import serve

from loadtests.processes import serve_replicas
from tests.integration.conftest import engine_core_of

pytestmark = pytest.mark.integration


def wait_until_replaced(app: str, old: psutil.Process, timeout_s: float = 300) -> None:
    """Waits until the old replica process is gone and Serve reports one replica of the app, a new one, as
    RUNNING (a replacement that exists but is still starting does not count: requests would find none)."""
    deadline = time.time() + timeout_s
    seen = ""
    while time.time() < deadline:
        new = [p for p in serve_replicas(app) if p.pid != old.pid]
        states = {
            getattr(state, "value", state): count
            for deployment in serve.status().applications[app].deployments.values()
            for state, count in deployment.replica_states.items()
        }
        seen = f"old alive: {old.is_running()}, new: {len(new)}, replica states: {states}"
        if not old.is_running() and len(new) == 1 and states == {"RUNNING": 1}:
            return
        time.sleep(2)
    pytest.fail(f"{app} replica was not replaced within {timeout_s:.0f} s ({seen})")


def assert_serves_again(cluster, prefix: str, model: str, timeout_s: float = 120) -> None:
    """Waits until a completion through the app's route succeeds; fails with the answers seen meanwhile (a
    replica Serve already reports RUNNING may still miss from HAProxy's table for a moment). Its short prompt
    is the request that once killed every new CPU engine with a draft model (serving/cpu_worker.py)."""
    client = cluster.client(prefix).with_options(max_retries=0, timeout=60)
    deadline, seen = time.time() + timeout_s, []
    while time.time() < deadline:
        try:
            r = client.completions.create(model=model, prompt="back", max_tokens=4)
        except openai.APIError as err:
            seen.append(f"{type(err).__name__}: {err}"[:200])
            time.sleep(2)
            continue
        assert r.usage.completion_tokens == 4
        return
    pytest.fail(f"{prefix} did not serve again within {timeout_s:.0f} s: {seen[-3:]} ({len(seen)} failures)")


def ignores_sigchld(pid: int) -> bool:
    with open(f"/proc/{pid}/status") as f:
        ignored = next(int(line.split()[1], 16) for line in f if line.startswith("SigIgn:"))
    return bool(ignored & (1 << (signal.SIGCHLD - 1)))


def test_replicas_and_engines_keep_sigchld(cluster):
    """Ray's raylet-subreaper switch makes its workers ignore SIGCHLD, and a replica's engine core inherits
    that: it loses its children's exit codes, and vLLM's usage report on a GPU then leaves py-cpuinfo
    spinning a CPU core for as long as the engine runs (results/gpu/2026-12-01b/diag). headroom's cluster
    settings leave that switch off."""
    [replica] = serve_replicas("main")
    assert not ignores_sigchld(replica.pid)
    assert not ignores_sigchld(engine_core_of(replica).pid)


def test_dead_engine_fails_in_flight_request_and_serve_replaces_the_replica(cluster):
    [replica] = serve_replicas("draft")
    core = engine_core_of(replica)

    result: dict = {}

    def long_request():
        result["response"] = httpx.post(
            f"{cluster.base_url}/draft/v1/completions",
            json={"model": "tiny-qwen3-drafted", "prompt": "long", "max_tokens": 1900, "ignore_eos": True},
            headers=cluster.auth("/draft"),
            timeout=120,
        )

    in_flight = threading.Thread(target=long_request)
    in_flight.start()
    time.sleep(1.0)
    os.kill(core.pid, signal.SIGKILL)
    in_flight.join(timeout=120)

    response = result["response"]
    assert 500 <= response.status_code < 600, response.text
    assert response.json()["error"]["message"]

    # The other app's replica is unaffected.
    r = cluster.client().chat.completions.create(
        model="tiny-qwen3", messages=[{"role": "user", "content": "still there?"}], max_tokens=4
    )
    assert r.choices[0].finish_reason in ("length", "stop")

    # The replica exits with its engine; Serve replaces it, and the app serves again.
    wait_until_replaced("draft", replica)
    assert_serves_again(cluster, "/draft", "tiny-qwen3-drafted")


def test_hard_killed_replica_leaves_no_engine_behind(cluster):
    """A replica killed with SIGKILL cannot stop its engine; the raylet must kill it with the replica's
    process group, or the orphan would keep holding the accelerator's memory from the replacement."""
    [replica] = serve_replicas("draft")
    core = engine_core_of(replica)
    os.kill(replica.pid, signal.SIGKILL)
    try:
        core.wait(timeout=30)
    except psutil.TimeoutExpired:
        core.kill()
        pytest.fail("the engine core outlived its killed replica by 30 s")
    wait_until_replaced("draft", replica)
