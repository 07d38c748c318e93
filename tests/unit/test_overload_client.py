"""The overload drill's measuring helpers (pure: no server)."""

import asyncio
import time

from loadtests.overload_client import LoopLag, Outcome, by_request, stats_ms


def test_loop_lag_is_kept_by_phase_and_sees_a_blocked_loop():
    async def drill() -> LoopLag:
        lag = LoopLag()
        task = asyncio.create_task(lag.run())
        await asyncio.sleep(0.05)
        lag.phase = "4x"
        await asyncio.sleep(0.02)
        time.sleep(0.1)  # the loop blocked: the probe wakes up ~100 ms late
        await asyncio.sleep(0.02)
        task.cancel()
        return lag

    lag = asyncio.run(drill())
    assert lag.seconds["safe"] and lag.seconds["4x"]
    assert max(lag.seconds["4x"]) >= 0.08


def test_stats_ms():
    assert stats_ms([]) == {"n": 0}
    assert stats_ms([0.001, 0.002, 0.003]) == {"n": 3, "p50": 2.0, "p99": 2.98, "max": 3.0}


def test_by_request_keeps_each_requests_attempts_in_order():
    refused = Outcome((0, 1), 16, 1.0, status=503, retry_after="1")
    retried = Outcome((0, 1), 16, 2.0, status=200, tokens=16)
    other = Outcome((1, 1), 16, 1.5, status=200, tokens=16)
    attempts = by_request([refused, other, retried])
    assert attempts == {(0, 1): [refused, retried], (1, 1): [other]}
    assert [a[-1].completed for a in attempts.values()] == [True, True]
