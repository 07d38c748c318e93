"""A dead engine core is noticed by the replica's health check even when vLLM's monitor thread is not.

vLLM's MPClientEngineMonitor thread can die in a race (psutil.NoSuchProcess from its process-tree kill),
which left requests hanging and the replica healthy in a CI run. This reproduces that state with vLLM's
real BackgroundResources and a real engine-core-like process that has exited, and no monitor thread.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import signal
import time

import pytest
from vllm.v1.engine.core_client import BackgroundResources
from vllm.v1.engine.exceptions import EngineDeadError

from serve_app.serving.engine import InstrumentedAsyncLLM


class ProcManager:
    def __init__(self, processes):
        self.processes = processes


class Client:
    """The part of vLLM's MPClient the health check uses: its resources and shutdown()."""

    def __init__(self, resources):
        self.resources, self.shutdowns = resources, 0

    def shutdown(self, timeout=None):
        self.shutdowns += 1
        self.resources.engine_dead = True


def engine_with(process) -> InstrumentedAsyncLLM:
    engine = object.__new__(InstrumentedAsyncLLM)  # no engine start: only the health check is under test
    engine.engine_core = Client(BackgroundResources(ctx=None, engine_manager=ProcManager([process])))
    engine.output_handler = None
    return engine


@pytest.mark.parametrize("auto_reaped", [False, True])
def test_an_ended_engine_core_fails_the_health_check_and_shuts_the_client_down(auto_reaped):
    """auto_reaped: SIGCHLD ignored, as in a Ray worker under Ray's raylet-subreaper switch: the exit code is
    never collected."""
    previous = signal.signal(signal.SIGCHLD, signal.SIG_IGN if auto_reaped else signal.SIG_DFL)
    try:
        core = multiprocessing.get_context("spawn").Process(target=int, name="EngineCore_DP0")
        core.start()
        core.join()
    finally:
        signal.signal(signal.SIGCHLD, previous)
    engine = engine_with(core)
    assert engine.ended_engine_cores() == {"EngineCore_DP0": None if auto_reaped else 0}
    with pytest.raises(EngineDeadError):
        asyncio.run(engine.check_health())
    assert engine.engine_core.shutdowns == 1
    with pytest.raises(EngineDeadError):  # once dead, it stays dead and is not shut down twice
        asyncio.run(engine.check_health())
    assert engine.engine_core.shutdowns == 1


def test_a_running_engine_core_is_healthy():
    core = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(120,), name="core")
    core.start()
    try:
        engine = engine_with(core)
        assert engine.ended_engine_cores() == {}
        asyncio.run(engine.check_health())
        assert engine.engine_core.shutdowns == 0
    finally:
        core.kill()
        core.join()
