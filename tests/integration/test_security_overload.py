"""Drills on the `secure` app (two replicas of max_num_seqs 4 that admit 4 sequences each: no queue):
overload at 4x the plan's safe concurrency, and an engine killed under load.

Runs after the other security tests (file order): the failure drill replaces one of the app's replicas.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import signal
import threading
import time

import pytest
from ray import serve

from autoscale.replica_stats import ARRIVAL_RATE_RPS, REFUSED_RATE_RPS
from loadtests.overload_client import Outcome, by_request, closed_loop, overload_drill
from loadtests.processes import serve_replicas
from tests.integration.conftest import engine_core_of

pytestmark = pytest.mark.integration

MODEL = "tiny-qwen3-secure"


def replica_rss_bytes() -> dict[int, int]:
    return {p.pid: p.memory_info().rss for p in serve_replicas("secure")}


WARMUP_S = 5  # the ramp, and the clients' first Retry-After, are left out of the statistics


@pytest.fixture
def quiet_collector():
    """The load generator shares this process with vLLM, torch and Ray's driver: a full garbage collection
    over their objects pauses it for hundreds of milliseconds, which it would count as server latency.
    Frozen, those objects are not scanned again."""
    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()


def test_overload_at_4x_safe_concurrency_is_refused_fast_and_admitted_requests_keep_their_ttft(
    secure, quiet_collector
):
    # The plan's safe concurrency: 2 replicas x max_num_seqs 4.
    safe = secure.cfg.engine.max_num_seqs * secure.cfg.deployment.num_replicas
    rss_before = replica_rss_bytes()
    rss_samples: list[dict[int, int]] = []
    reports: list[dict[str, float]] = []  # what the autoscaler reads from a replica (10 s windows)
    stop = threading.Event()

    def read_reports() -> None:  # a thread: Serve's handles block, which the drill's event loop must not
        handle = serve.get_app_handle("secure")
        while not stop.wait(5):
            reports.append(handle.record_autoscaling_stats.remote().result(timeout_s=10))

    reader = threading.Thread(target=read_reports, daemon=True)
    reader.start()
    try:
        drill = asyncio.run(
            overload_drill(
                secure.base_url, MODEL, secure.auth(), safe, set(rss_before), secure.prefix,
                every_5s=lambda: rss_samples.append(replica_rss_bytes()),
            )
        )  # fmt: skip
    finally:
        stop.set()
        reader.join(timeout=30)
    report = {**drill.report, "rss_mib": {p: [s[p] >> 20 for s in rss_samples if p in s] for p in rss_before}}
    print(f"\noverload drill, ms: {json.dumps(report, indent=1)}")
    baseline, every = drill.baseline, drill.overload
    admitted = [o for o in every if o.status == 200]
    refused = [o for o in every if o.status in (429, 503)]
    # At safe concurrency every request is served. A refusal there is HAProxy's least-connections count
    # lagging the replicas (overload_drill says how; 1 of 634 requests in one CI run): its client's one
    # retry after Retry-After is served, and such refusals stay rare.
    tries = by_request(baseline)
    assert all(t[-1].completed for t in tries.values()), [t for t in tries.values() if not t[-1].completed]
    refusals = [o for t in tries.values() for o in t[:-1]]
    assert all(o.status == 503 and o.retry_after == "1" and o.error_json for o in refusals), refusals
    assert len(tries) == report["requests at safe concurrency"], report
    assert len(refusals) == report["refused at safe concurrency"] <= len(tries) / 100, report
    assert all(o.status in (200, 429, 503) for o in every), [
        o for o in every if o.status not in (200, 429, 503)
    ][:3]
    assert all(o.completed for o in admitted), [o for o in admitted if not o.completed][:3]
    assert len(refused) > len(admitted) / 4  # 32 clients, room for 8: a refused client comes back after 1 s
    # The replicas count refused attempts beside arrivals, so the autoscaler counts a retried request once.
    assert max(r[REFUSED_RATE_RPS] for r in reports) > 0, reports
    assert all(r[REFUSED_RATE_RPS] <= r[ARRIVAL_RATE_RPS] for r in reports), reports
    plain = [o for o in refused if not (o.retry_after == "1" and o.error_json)]
    assert not plain, (len(plain), len(refused), plain[:3])
    # Refused in under 50 ms where the replica measures it (Ray Serve's request log). At the client the
    # tail is the machine's: the load generator, HAProxy and both engines share 2 CPUs (client p99 of
    # refusals 120-350 ms, of /health 50-120 ms, in the runs that set these bounds), so there only the
    # median is held to 50 ms.
    assert report["refusal, replica"]["p99"] < 50 and report["refusal, client"]["p50"] < 50, report
    # Admitted requests keep their TTFT: no queue forms in front of the engine. On 2 shared CPUs the 4x
    # load itself (24 refused clients coming back every second) slows everything by ~1.5x at the median
    # (31 -> 50 ms, 47 -> 71 ms measured). The tail (p99) is a speed target for a benchmark with repeats
    # (`python -m loadtests.bench_security --overload`), not for this test: in single runs here it came out
    # 2.1x and 4.2x of the safe concurrency's; it is printed above.
    ttft, base = report["ttft admitted at 4x"], report["ttft at safe concurrency"]
    assert ttft["p50"] <= 2 * base["p50"], report
    # No replica restarted, and none grew: the same processes, within 64 MiB of where they started.
    assert set(replica_rss_bytes()) == set(rss_before)
    for pid, before in rss_before.items():
        assert max(s[pid] for s in rss_samples) - before < 64 << 20, report["rss_mib"]


def test_an_engine_killed_under_load_fails_only_its_requests_in_flight_and_is_replaced(
    secure, quiet_collector
):
    """Four clients (one replica's safe concurrency, so that the survivor can carry them all) stream
    without pause; one replica's engine core is killed. The replica fails what it has in flight, answers
    what still reaches it with 503 + Retry-After, and exits; HAProxy then sends everything to the other
    replica, and Serve starts a replacement."""
    url = f"{secure.base_url}/v1/completions"
    replicas = serve_replicas("secure")
    assert len(replicas) == 2
    victim = replicas[0]
    core = engine_core_of(victim)
    exited_at: list[float] = []

    async def drill() -> tuple[list[Outcome], float]:
        load = asyncio.create_task(
            closed_loop(url, MODEL, secure.auth(), secure.cfg.engine.max_num_seqs, 30, retries=3)
        )
        await asyncio.sleep(10)
        killed_at = time.monotonic()
        os.kill(core.pid, signal.SIGKILL)
        await asyncio.to_thread(victim.wait, 30)
        exited_at.append(time.monotonic())
        return await load, killed_at

    outcomes, killed_at = asyncio.run(drill())
    attempts = by_request(outcomes)
    failed = [a for a in attempts.values() if not a[-1].completed]
    sent_after = [a for a in attempts.values() if a[0].started_s > exited_at[0]]
    retried = [a for a in attempts.values() if len(a) > 1]
    print(
        f"\nfailure drill: {len(attempts)} requests; replica exited {exited_at[0] - killed_at:.2f} s after "
        f"its engine was killed; {len(failed)} failed, {len(retried)} were refused (503 + Retry-After) or "
        f"closed unanswered and sent again, {len(sent_after)} were sent after the replica exited"
    )
    for a in failed + retried:
        print("  ", [(round(o.started_s - killed_at, 3), o.status, o.tokens, o.error[:80]) for o in a])
    # Only requests in flight on the killed replica failed: at most what it admits, all sent before it was
    # gone (those that reached it after its engine died got 503 + Retry-After, and their retries completed).
    assert 0 < len(failed) <= secure.cfg.engine.max_num_seqs, failed
    assert all(a[-1].started_s < exited_at[0] for a in failed), failed
    # Every request sent after the replica exited completed.
    assert all(a[-1].completed for a in sent_after)
    assert len(sent_after) > 20

    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        pids = {p.pid for p in serve_replicas("secure")}
        if (
            victim.pid not in pids
            and len(pids) == 2
            and serve.status().applications["secure"].status == "RUNNING"
        ):
            break
        time.sleep(2)
    else:
        pytest.fail("the killed replica was not replaced within 300 s")
    again = asyncio.run(closed_loop(url, MODEL, secure.auth(), 4, 5))
    assert again and all(o.completed for o in again)
