"""Starting or joining a Ray cluster from a driver process (the CLI, the benchmarks, the test session)."""

from __future__ import annotations

import signal
from typing import Any

import ray


def init_ray_driver(**ray_init_kwargs: Any) -> None:
    """`ray.init(**ray_init_kwargs)`, keeping the subprocess exit codes. Every driver starts Ray here.

    With Ray's raylet-subreaper switch in the environment (RAY_kill_child_processes_on_worker_exit_with_
    raylet_subreaper, which headroom's clusters leave off but some platforms set), Ray's core worker sets
    SIGCHLD to SIG_IGN in every process it runs in, the driver included, so that children are reaped on
    their own. A driver that then runs a subprocess (Locust, a CLI under test) would lose its exit status:
    waitpid finds no child and Python's subprocess reports 0 for whatever the child returned. The default
    disposition gives the driver its children's exit codes back, whatever the environment."""
    ray.init(**ray_init_kwargs)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
