"""`headroom rollout`: validate, plan, render, deploy through Serve's REST API, wait until ready, smoke-test
against the config's SLO, and keep the new version or roll back to the one that ran before.

`rollout` deploys through the dashboard's REST API (``PUT /api/serve/applications/``, exactly what
`serve deploy` sends). That call declares the *whole* set of declaratively deployed applications, so the
cluster's other applications are sent back unchanged with ours replaced, and Serve's running HTTP, gRPC
and proxy settings are kept (serve_state.deploy_body). Every rendered config is kept under the state
directory with a history (history.py).

The decisions (what to render, what differs, what the update will do, whether the app is ready, whether the
smoke load passed the SLO) are pure functions in the sibling modules; this module runs them in order. The
Ray/HTTP calls live in the ClusterAPI (`connect`, default dashboard.ServeCluster), the load in the injected
smoke runner. `rollout()` validates every input (config, address, plan, Ray token) before its first network
call, and deploys nothing before the cluster has been read.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from serve_app.config import DEFAULT_CONFIG_DIR, HeadroomConfig
from serve_app.planning.from_config import planning_cluster
from serve_app.rollout.changes import FieldChange, field_changes, format_changes
from serve_app.rollout.dashboard import ClusterAPI, ServeCluster, dashboard_url, default_address
from serve_app.rollout.errors import RolloutError, to_stderr
from serve_app.rollout.history import append_history, env_dir, previous_rendered, stamp, state_dir
from serve_app.rollout.rendering import (
    DEPLOYMENT_NAME,
    Rendered,
    Target,
    deployment_entry,
    load_target,
    render_target,
)
from serve_app.rollout.serve_state import (
    AppHealth,
    app_meta,
    assess_app,
    check_conflicts,
    deploy_body,
    live_app_config,
    serve_base_url,
    served_name,
    update_kind,
)
from serve_app.rollout.smoke_gate import GateResult, SmokeOptions, SmokeRunner, gate


@dataclass
class RolloutResult:
    """What a rollout did. outcome: succeeded | rolled_back | rollback_failed | failed | dry_run."""

    outcome: str
    label: str
    app: str
    config_hash: str
    previous_hash: str | None
    update: str
    message: str
    rendered_path: str | None = None
    gate: GateResult | None = None
    timings_s: dict[str, float] = field(default_factory=dict)
    record: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.outcome in ("succeeded", "dry_run")


@dataclass(frozen=True)
class Prepared:
    """A validated rollout, before anything changes: the rendered config and what the cluster runs now."""

    target: Target
    rendered: Rendered
    address: str
    details: dict[str, Any]
    previous: dict[str, Any] | None
    previous_hash: str | None
    update: str
    base_url: str

    @property
    def cfg(self) -> HeadroomConfig:
        return self.target.cfg


@dataclass(frozen=True)
class Waiting:
    """How long a version may take to become ready (or to go), and how often Serve's state is read."""

    timeout_s: float
    poll_s: float


def prepare(
    env: str | None,
    address: str | None,
    *,
    config_files: Sequence[str | Path] | None = None,
    config_dir: str | Path = DEFAULT_CONFIG_DIR,
    connect: Callable[[str], ClusterAPI] = ServeCluster,
) -> tuple[Prepared, ClusterAPI]:
    """Every check before a deploy. First those that need no network (config, address, a CPU plan), then
    the cluster is read (reachable? a GPU plan on its nodes; an app in the way?); nothing is changed."""
    target = load_target(env, config_files, config_dir)
    cfg = target.cfg
    given, source = (address, "--address") if address else default_address()
    url = dashboard_url(given, source)
    rendered = render_target(target, planning_cluster(cfg)) if cfg.resources.accelerator == "cpu" else None
    api = connect(url)
    if rendered is None:
        rendered = render_target(target, planning_cluster(cfg, live_gpus_per_node=api.gpus_per_node()))
    details = api.details()
    check_conflicts(details, rendered.app)
    previous = live_app_config(details, cfg.name)
    prepared = Prepared(
        target=target,
        rendered=rendered,
        address=url,
        details=details,
        previous=previous,
        previous_hash=app_meta(previous).get("config_hash"),
        update=update_kind(previous, rendered.app),
        base_url=serve_base_url(details, url, cfg.route_prefix),
    )
    return prepared, api


def describe(prep: Prepared) -> list[str]:
    """The first lines a rollout prints: what, where, what runs now, and how Serve will update it."""
    running = prep.previous_hash or (
        "nothing" if prep.previous is None else "a config headroom did not render"
    )
    return [
        f"rollout {prep.target.label}: app {prep.cfg.name!r}, config {prep.rendered.config_hash} "
        f"on {prep.address}",
        f"  now running: {running}",
        f"  update:      {prep.update}",
        f"  rolling:     {prep.rendered.surge_note}",
    ]


def dry_run_lines(
    prep: Prepared, state: Path, smoke: SmokeOptions | None, ready_timeout_s: float
) -> list[str]:
    """What a rollout would do, and how the new config differs from the one the cluster runs (pure)."""
    cfg, url, base_url = prep.cfg, prep.address, prep.base_url
    steps = [
        f"write the rendered config to {env_dir(state, prep.target.label)}/"
        f"<time>-{prep.rendered.config_hash}.yaml",
        f"PUT it to {url}/api/serve/applications/ (Serve's declarative deploy, as `serve deploy` does), "
        "keeping the cluster's other declarative apps",
        f"wait up to {ready_timeout_s:.0f} s for {cfg.name!r} to run it and {base_url}/v1/models to answer",
    ]
    if smoke is not None:
        slo = cfg.slo
        steps.append(
            f"smoke load: {smoke.users} user(s) for {smoke.duration_s:g} s against {base_url}; pass if "
            f"TTFT p95 <= {slo.ttft_p95_ms:g} ms, TPOT p50 <= {slo.tpot_p50_ms:g} ms, errors <= "
            f"{slo.max_error_rate:.1%}"
        )
    if prep.previous is None:
        steps.append("on failure: remove the app (nothing ran before)")
    else:
        steps.append(
            "on failure: redeploy the config running now "
            f"({prep.previous_hash or 'not rendered by headroom'})"
        )
    lines = ["dry run: nothing deployed, nothing written. It would:"]
    lines += [f"  {i}. {step}" for i, step in enumerate(steps, 1)]
    if prep.previous is not None:
        lines.append(format_changes(_live_changes(prep), "running", "new"))
    return lines


def _live_changes(prep: Prepared) -> list[FieldChange]:
    """The merged config and Serve options the cluster runs now against the new ones."""
    assert prep.previous is not None
    live_cfg = (prep.previous.get("args") or {}).get("config")
    changes = (
        field_changes("config", live_cfg, prep.cfg.model_dump(mode="json"))
        if isinstance(live_cfg, Mapping)
        else []
    )
    changes += field_changes(
        "serve",
        {DEPLOYMENT_NAME: deployment_entry(prep.previous)},
        {DEPLOYMENT_NAME: deployment_entry(prep.rendered.app)},
    )
    return changes


def rollout(
    env: str | None = None,
    address: str | None = None,
    dry_run: bool = False,
    *,
    config_files: Sequence[str | Path] | None = None,
    config_dir: str | Path = DEFAULT_CONFIG_DIR,
    state: str | Path | None = None,
    smoke: SmokeOptions | None = SmokeOptions(),
    ready_timeout_s: float = 900.0,
    poll_s: float = 2.0,
    connect: Callable[[str], ClusterAPI] = ServeCluster,
    smoke_runner: SmokeRunner | None = None,
    say: Callable[[str], None] = to_stderr,
    now: Callable[[], datetime] = lambda: datetime.now(timezone.utc),
) -> RolloutResult:
    """Validate, plan, render, deploy through Serve's REST API, wait until ready, smoke-test against the
    config's SLO, and keep the new version or roll back to the one that ran before.

    Bad inputs (unknown env, unknown key, plan that does not fit, malformed address, RAY_AUTH_MODE=token
    without a token) raise ConfigError or RolloutError before any network call; an unreachable cluster, a
    missing or rejected Ray token, or an app in the way raise before any deploy (see prepare). smoke=None
    gates on readiness alone; otherwise smoke_runner runs the load. dry_run reads the cluster, says what
    would happen, and deploys and writes nothing.
    """
    prep, api = prepare(env, address, config_files=config_files, config_dir=config_dir, connect=connect)
    for line in describe(prep):
        say(line)
    state_path = state_dir(state)
    if dry_run:
        for line in dry_run_lines(prep, state_path, smoke, ready_timeout_s):
            say(line)
        r = prep.rendered
        return RolloutResult(
            "dry_run",
            prep.target.label,
            prep.cfg.name,
            r.config_hash,
            prep.previous_hash,
            prep.update,
            "dry run: nothing changed",
        )
    if smoke is not None and smoke_runner is None:
        raise ValueError(
            "rollout(smoke=...) needs smoke_runner (the CLI passes loadtests.smoke.run_smoke_load)"
        )
    attempt = _Attempt.begin(prep, api, state_path, now(), Waiting(ready_timeout_s, poll_s), say)
    return _execute(attempt, smoke, smoke_runner)


# --------------------------------------------------------------------------------------------------------
# The steps of a rollout that deploys: deploy, verify (ready, smoke gate), recover (roll back), record
# --------------------------------------------------------------------------------------------------------


@dataclass
class _Attempt:
    """One rollout under way: the cluster, its files, the time each step takes, and how it is recorded."""

    prep: Prepared
    api: ClusterAPI
    state: Path
    started: datetime
    waiting: Waiting
    say: Callable[[str], None]
    rendered_path: Path
    previous_rendered: str | None
    timings_s: dict[str, float] = field(default_factory=dict)
    t0: float = field(default_factory=time.monotonic)

    @classmethod
    def begin(
        cls,
        prep: Prepared,
        api: ClusterAPI,
        state: Path,
        started: datetime,
        waiting: Waiting,
        say: Callable[[str], None],
    ) -> _Attempt:
        """Writes the rendered config under the state directory (the first thing a real rollout changes)."""
        rendered, label = prep.rendered, prep.target.label
        directory = env_dir(state, label)
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"{stamp(started)}-{rendered.config_hash}.yaml"
        path.write_text(rendered.to_yaml(started.isoformat(timespec="seconds")), encoding="utf-8")
        say(f"  rendered:    {path}")
        previous = previous_rendered(state, label, prep.previous_hash)
        return cls(prep, api, state, started, waiting, say, path, previous)

    @contextmanager
    def timed(self, step: str) -> Iterator[None]:
        t = time.monotonic()
        try:
            yield
        finally:
            self.timings_s[step] = round(time.monotonic() - t, 1)

    def finish(self, outcome: str, message: str, result_gate: GateResult | None = None) -> RolloutResult:
        """Records the rollout in the history and says how it ended."""
        prep = self.prep
        self.timings_s["total_s"] = round(time.monotonic() - self.t0, 1)
        record = history_record(
            prep,
            self.started,
            outcome,
            message,
            self.rendered_path,
            self.previous_rendered,
            result_gate,
            self.timings_s,
        )
        append_history(self.state, prep.target.label, record)
        self.say(f"{outcome}: {message}")
        return RolloutResult(
            outcome,
            prep.target.label,
            prep.cfg.name,
            prep.rendered.config_hash,
            prep.previous_hash,
            prep.update,
            message,
            str(self.rendered_path),
            result_gate,
            dict(self.timings_s),
            record,
        )


def _execute(
    attempt: _Attempt, smoke: SmokeOptions | None, smoke_runner: SmokeRunner | None
) -> RolloutResult:
    prep = attempt.prep
    try:
        with attempt.timed("deploy_request_s"):
            attempt.api.deploy(deploy_body(prep.details, prep.rendered.app, prep.cfg.name))
    except RolloutError as err:
        return attempt.finish("failed", f"the deploy request was refused, nothing changed: {err}")
    result_gate, failure = _verify(attempt, smoke, smoke_runner)
    if failure is None:
        return attempt.finish(
            "succeeded", f"{prep.cfg.name} runs config {prep.rendered.config_hash}", result_gate
        )
    return _recover(attempt, failure, result_gate)


def _verify(
    attempt: _Attempt, smoke: SmokeOptions | None, smoke_runner: SmokeRunner | None
) -> tuple[GateResult | None, str | None]:
    """Waits until the new version is ready, then runs the smoke gate: (gate result, why it failed)."""
    prep = attempt.prep
    with attempt.timed("ready_s"):
        health = _wait_ready(
            attempt.api,
            prep.cfg.name,
            prep.rendered.config_hash,
            prep.base_url,
            prep.cfg.served_model_name,
            attempt.waiting,
            attempt.say,
        )
    if health.phase != "ready":
        return None, health.message
    if smoke is None:
        return None, None
    assert smoke_runner is not None
    raw_file = attempt.rendered_path.with_suffix(".smoke.jsonl")
    with attempt.timed("smoke_s"):
        return _smoke_gate(prep, smoke, raw_file, smoke_runner, attempt.say)


def _recover(attempt: _Attempt, failure: str, result_gate: GateResult | None) -> RolloutResult:
    """After a failed verification: roll back to what ran before (or remove a new app), and record it."""
    prep = attempt.prep
    attempt.say(f"  failed:      {failure}")
    if prep.previous is not None and prep.previous_hash == prep.rendered.config_hash:
        return attempt.finish(
            "failed",
            f"{failure}; the version before was this same config: nothing to roll back to",
            result_gate,
        )
    what = (
        f"config {prep.previous_hash or '(not rendered by headroom)'}"
        if prep.previous
        else "no app (removed)"
    )
    attempt.say(f"  rolling back to {what}")
    with attempt.timed("rollback_s"):
        back = _roll_back(prep, attempt.api, attempt.waiting, attempt.say)
    if back.phase == "ready":
        return attempt.finish("rolled_back", f"{failure}; rolled back to {what}", result_gate)
    return attempt.finish(
        "rollback_failed", f"{failure}; rolling back to {what} failed: {back.message}", result_gate
    )


def _smoke_gate(
    prep: Prepared,
    smoke: SmokeOptions,
    raw_file: Path,
    smoke_runner: SmokeRunner,
    say: Callable[[str], None],
) -> tuple[GateResult, str | None]:
    cfg = prep.cfg
    say(
        f"  smoke load:  {smoke.users} user(s), {smoke.duration_s:g} s, {smoke.max_tokens} tokens, "
        f"{prep.base_url}"
    )
    failure = None
    try:
        summary = smoke_runner(prep.base_url, cfg.served_model_name, raw_file, smoke)
    except RolloutError as err:
        summary, failure = {"requests": 0, "ok": 0}, str(err)
    result = gate(summary, cfg.slo)
    n = result.numbers
    say(
        f"  smoke:       {n['ok']}/{n['requests']} ok, TTFT p95 {n['ttft_p95_ms']} ms, TPOT p50 "
        f"{n['tpot_p50_ms']} ms, error rate {n['error_rate']}"
    )
    if failure is None and not result.passed:
        failure = "smoke gate failed: " + "; ".join(result.reasons)
    return result, failure


def _roll_back(prep: Prepared, api: ClusterAPI, waiting: Waiting, say: Callable[[str], None]) -> AppHealth:
    """Redeploys the app config that ran before (as the cluster reported it), or removes a new app."""
    name, previous = prep.cfg.name, prep.previous
    try:
        api.deploy(deploy_body(api.details(), previous, name))
        if previous is None:
            return _wait_ready(api, name, None, prep.base_url, None, waiting, say, absent=True)
        base_url = serve_base_url(prep.details, prep.address, str(previous.get("route_prefix") or "/"))
        return _wait_ready(api, name, prep.previous_hash, base_url, served_name(previous), waiting, say)
    except RolloutError as err:
        return AppHealth("failed", str(err))


def history_record(
    prep: Prepared,
    started: datetime,
    outcome: str,
    message: str,
    rendered_path: Path,
    previous_rendered: str | None,
    result_gate: GateResult | None,
    timings: Mapping[str, float],
) -> dict[str, Any]:
    """One line of history.jsonl (pure)."""
    return {
        "time": started.isoformat(timespec="seconds"),
        "env": prep.target.label,
        "app": prep.cfg.name,
        "outcome": outcome,
        "message": message,
        "config_hash": prep.rendered.config_hash,
        "previous_hash": prep.previous_hash,
        "update": prep.update,
        "address": prep.address,
        "sources": list(prep.target.sources),
        "rendered": str(rendered_path),
        "previous_rendered": previous_rendered,
        "plan": {k: v for k, v in prep.rendered.plan_facts().items() if k != "bundles"},
        "slo": prep.cfg.slo.model_dump(mode="json"),
        "smoke": result_gate.numbers if result_gate else None,
        "gate_reasons": list(result_gate.reasons) if result_gate else [],
        "timings_s": dict(timings),
    }


def _wait_ready(
    api: ClusterAPI,
    name: str,
    config_hash: str | None,
    base_url: str,
    model: str | None,
    waiting: Waiting,
    say: Callable[[str], None],
    absent: bool = False,
) -> AppHealth:
    """Polls until assess_app says ready (and, for a live app, /v1/models answers), failed, or timeout."""
    deadline = time.monotonic() + waiting.timeout_s
    last = ""
    while True:
        try:
            health = assess_app(api.details(), name, config_hash, absent=absent)
        except RolloutError as err:  # the dashboard can blip while Serve works; keep polling to the deadline
            health = AppHealth("waiting", str(err))
        if health.phase == "ready" and not absent:
            problem = api.probe(base_url, model)
            if problem is not None:
                health = AppHealth("waiting", f"Serve reports RUNNING; {problem}")
        if health.phase == "failed":
            return health
        if health.phase == "ready":
            say(f"  ready:       {health.message}")
            return health
        if health.message != last:
            say(f"  waiting:     {health.message}")
            last = health.message
        if time.monotonic() >= deadline:
            return AppHealth("failed", f"not ready after {waiting.timeout_s:.0f} s: {health.message}")
        time.sleep(waiting.poll_s)
