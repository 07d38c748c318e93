"""Locust load shapes for LLM serving: a concurrency ladder and an open-loop arrival rate.

`HeadroomShape` is the one concrete shape; loadtests/locustfile.py imports it, so Locust uses it, and it
picks its behaviour from the command line (or the environment variables in brackets):

- `--ladder 1:30,4:30,16:30` [HEADROOM_LADDER]: a closed-loop concurrency ladder, `users:duration` steps
  (durations in s, or with a unit: 30s, 2m). Each user sends its next request as soon as its last one
  ends, so the step's value is the number of requests in flight. New users start within a second of
  the step's start; the test stops after the last step (in-flight requests finish: the locustfile
  sets a graceful --stop-timeout). Requests are labelled with their step ("c=4") in the raw file.
  With `--stop-ttft-p95-ms X` [HEADROOM_STOP_TTFT_P95_MS] the test ends at the first step that breaches
  X: the TTFT p95 of the step's successful requests sent after its own first STEP_WARMUP_S seconds is
  above X, or every request of the step failed. It is checked from STEP_WARMUP_S / 2 into the next step,
  so the next step's few requests fall inside its warm-up and count in no step's statistics. A step with
  no finished request yet does not stop the test. Single process only (the users report to the shape
  through the environment).
- `--arrival-rate 2:60` or `1:30,2:30,4:30` [HEADROOM_ARRIVAL_RATE]: open loop, `requests/s:duration`
  steps, Poisson arrivals, or burstier with `--burstiness 0.25` [HEADROOM_BURSTINESS] (gamma
  inter-arrival gaps of shape `burstiness`, as `vllm bench serve --burstiness`; 1 = Poisson).
- neither: Locust's own -u/-r/-t (the shape sets `use_common_options`), a plain closed loop.

-t caps the test in every mode. (Locust arms its own -t timer only after a shape has ended, so the shape
applies it; the shape checks once a second, so a run can last up to a second longer.)

Open loop, the design choice. Locust users are long-lived closed loops, and Locust cannot start a user
per request. `constant_pacing` gives each user a fixed period, so arrivals are evenly spaced per user
(not Poisson), and once a request outlasts the period the user falls back to a closed loop: the arrival
rate drops exactly when the server slows down, and no queue builds (coordinated omission). Instead one
arrival schedule is generated up front from the seed (`workloads.arrival_times`) and shared by a pool
of `--max-in-flight` users (default 64) [HEADROOM_MAX_IN_FLIGHT]: each free user claims the next
arrival, its `wait_time` sleeps until the arrival's time, and it sends. The schedule, and which prompt
each arrival carries (the seed's shared request stream, arrival k = request k), does not depend on how
the server responds, so a slow server makes requests pile up in its queue as they would in production.
The trade-off: the pool caps the number in flight. When every user is busy at an arrival's time, that
arrival leaves late, when a user frees up; each record keeps `scheduled_s` and `send_lag_s` and
`raw_stats` reports the share sent more than 10 ms late (`late_fraction`). If it is not ~0, raise
--max-in-flight (each idle user costs one greenlet and one keep-alive connection, nothing else). By
Little's law the pool must exceed rate x e2e latency at the worst step. The schedule lives in each
process that runs users, so open loop is for single-process runs (distributed workers would each replay
the whole schedule; the locustfile refuses that).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from locust import LoadTestShape

try:
    from loadtests.measure import STEP_WARMUP_S
    from loadtests.workloads import Step, ladder_label, parse_steps, step_index_at
except ImportError:  # copied next to its sibling modules, outside the package
    from measure import STEP_WARMUP_S  # type: ignore[no-redef]
    from workloads import Step, ladder_label, parse_steps, step_index_at  # type: ignore[no-redef]

DEFAULT_MAX_IN_FLIGHT = 64
OPEN_LOOP_GRACE_S = 2.0  # the schedule's clock starts when the first user claims an arrival: a little later
MAX_SPAWN_RATE = 100.0  # users/s; Locust warns above this


def add_arguments(parser: Any) -> None:
    """The shape's Locust command-line options; the locustfile's init_command_line_parser calls this."""
    group = parser.add_argument_group("headroom load shape")
    group.add_argument(
        "--ladder",
        default=None,
        env_var="HEADROOM_LADDER",
        help="Closed-loop concurrency ladder, users:duration steps, e.g. 1:30,4:30,16:30 (durations s or 2m)",
    )
    group.add_argument(
        "--stop-ttft-p95-ms",
        type=float,
        default=None,
        env_var="HEADROOM_STOP_TTFT_P95_MS",
        help="Ladder: end the test at the first step whose TTFT p95 exceeds this (ms)",
    )
    group.add_argument(
        "--arrival-rate",
        default=None,
        env_var="HEADROOM_ARRIVAL_RATE",
        help="Open-loop arrivals, requests/s:duration steps, e.g. 2:60 or 1:30,2:30,4:30",
    )
    group.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        env_var="HEADROOM_BURSTINESS",
        help="Open loop: gamma shape of inter-arrival gaps; 1 = Poisson, < 1 burstier (vllm bench serve's)",
    )
    group.add_argument(
        "--max-in-flight",
        type=int,
        default=DEFAULT_MAX_IN_FLIGHT,
        env_var="HEADROOM_MAX_IN_FLIGHT",
        help="Open loop: the user pool, the most requests in flight; late sends are recorded",
    )


def _option(shape: LoadTestShape, name: str, env: str, default: Any = None) -> Any:
    options = getattr(getattr(shape.runner, "environment", None), "parsed_options", None)
    value = getattr(options, name, None) if options is not None else None
    return value if value is not None else os.environ.get(env, default)


def ladder_tick(steps: Sequence[Step], run_time_s: float) -> tuple[int, float] | None:
    """(users, spawn rate) for the step running at run_time_s; None after the last step."""
    i = step_index_at(steps, run_time_s)
    if i is None:
        return None
    users = int(round(steps[i].value))
    return users, min(float(max(users, 1)), MAX_SPAWN_RATE)


def rate_label(rate_rps: float) -> str:
    return f"rate={rate_rps:g}"


def open_loop_tick(steps: Sequence[Step], run_time_s: float, pool: int) -> tuple[int, float] | None:
    """The whole pool for the schedule's duration (plus a grace), then None."""
    if run_time_s >= sum(s.duration_s for s in steps) + OPEN_LOOP_GRACE_S:
        return None
    return pool, min(float(pool), MAX_SPAWN_RATE)


class LadderShape(LoadTestShape):
    """Closed-loop concurrency ladder. Subclass with `steps = "1:30,4:30"`, or set --ladder."""

    abstract = True
    steps: str | None = None

    def ladder_steps(self) -> list[Step]:
        if not hasattr(self, "_steps"):
            spec = self.steps or _option(self, "ladder", "HEADROOM_LADDER")
            if not spec:
                raise ValueError("LadderShape needs steps: set --ladder 1:30,4:30 or HEADROOM_LADDER")
            self._steps = parse_steps(spec)
        return self._steps

    def tick(self) -> tuple[int, float] | None:
        steps, run_time_s = self.ladder_steps(), self.get_run_time()
        if self._breached_before(steps, run_time_s):
            return None
        return ladder_tick(steps, run_time_s)

    def _breached_before(self, steps: Sequence[Step], run_time_s: float) -> bool:
        """With --stop-ttft-p95-ms: whether the step before the running one breached it. Checked from half
        the warm-up into the running step (the earlier step's requests have mostly finished), so that a
        stop (Locust ticks once a second) comes before the running step's warm-up ends: its requests
        then count in no step."""
        bound = _option(self, "stop_ttft_p95_ms", "HEADROOM_STOP_TTFT_P95_MS")
        latencies = getattr(getattr(self.runner, "environment", None), "step_latencies", None)
        i = step_index_at(steps, max(0.0, run_time_s - STEP_WARMUP_S / 2))
        if bound is None or latencies is None or not i:
            return False
        return bool(latencies.breached(i - 1, float(bound)))

    def current_step(self) -> tuple[int, str] | None:
        """(index, label) of the step running now, for the raw file. After the last step (the test is
        stopping) it is still the last one: its users are still running."""
        steps = self.ladder_steps()
        i = step_index_at(steps, self.get_run_time())
        i = len(steps) - 1 if i is None else i
        return i, ladder_label(steps[i].value)


class OpenLoopShape(LoadTestShape):
    """Keeps the open-loop user pool alive while the arrival schedule runs (the users do the pacing)."""

    abstract = True
    rates: str | None = None
    max_in_flight: int | None = None

    def rate_steps(self) -> list[Step]:
        if not hasattr(self, "_rates"):
            spec = self.rates or _option(self, "arrival_rate", "HEADROOM_ARRIVAL_RATE")
            if not spec:
                raise ValueError(
                    "OpenLoopShape needs rates: set --arrival-rate 2:60 or HEADROOM_ARRIVAL_RATE"
                )
            self._rates = parse_steps(spec)
        return self._rates

    def pool(self) -> int:
        value = self.max_in_flight or _option(
            self, "max_in_flight", "HEADROOM_MAX_IN_FLIGHT", DEFAULT_MAX_IN_FLIGHT
        )
        return int(value)

    def tick(self) -> tuple[int, float] | None:
        return open_loop_tick(self.rate_steps(), self.get_run_time(), self.pool())

    def current_step(self) -> tuple[int, str] | None:
        return None  # each open-loop request carries its arrival's step


class HeadroomShape(LadderShape, OpenLoopShape):
    """A ladder with --ladder, open loop with --arrival-rate, else Locust's -u/-r/-t unchanged."""

    abstract = False
    use_common_options = True

    def mode(self) -> str:
        ladder = _option(self, "ladder", "HEADROOM_LADDER")
        rates = _option(self, "arrival_rate", "HEADROOM_ARRIVAL_RATE")
        if ladder and rates:
            raise ValueError("--ladder and --arrival-rate exclude each other: choose closed or open loop")
        return "ladder" if ladder else "open-loop" if rates else "common"

    def tick(self) -> tuple[int, float] | None:
        options = self.runner.environment.parsed_options if self.runner is not None else None
        # Locust arms -t only after a shape ends, so the shape applies it: the whole test, in every mode.
        run_time_s = getattr(options, "run_time", None)
        if run_time_s and self.get_run_time() >= run_time_s:
            return None
        mode = self.mode()
        if mode == "ladder":
            return LadderShape.tick(self)
        if mode == "open-loop":
            return OpenLoopShape.tick(self)
        users = int(getattr(options, "num_users", None) or 1)
        rate = float(getattr(options, "spawn_rate", None) or 1)
        return users, rate

    def current_step(self) -> tuple[int, str] | None:
        return LadderShape.current_step(self) if self.mode() == "ladder" else None
