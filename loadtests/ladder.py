"""The seeds' tuning procedure as one command (`headroom ladder`).

1. Fix the test set (a seeded workload profile) and the concurrency ladder.
2. Baseline: every feature off; record TTFT/TPOT/throughput/peak memory at each step.
3. Estimate the concurrency ceiling from the KV headroom (the planner) and compare with what is measured.
4. Production concurrency: the last step before TTFT p95 first exceeds the SLO.
5. Switch on prefix caching, then chunked prefill, then speculative decoding (ngram, and the draft model
   where the config has one), one at a time and cumulatively, rerunning the same ladder each time on a
   freshly deployed engine (so no run feeds the next one's prefix cache); finally check whether each
   feature's gain survives at the highest step, and recommend switching it off where it does not.

The decisions (which settings, what to recommend) are pure functions of the measurements, tested
directly; `run_ladder` is the glue that deploys, loads with Locust and samples memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loadtests import raw_stats
from loadtests.machine import describe
from loadtests.processes import serve_replicas
from loadtests.streaming_client import run_load
from loadtests.workloads import parse_steps
from serve_app.config import HeadroomConfig, deep_merge, parse_config

ROOT = Path(__file__).resolve().parents[1]

# A feature "survives" at the highest step when it keeps at least this share of the previous setting's
# throughput and does not raise TTFT p95 by more than this factor.
MIN_THROUGHPUT_RATIO = 0.98
MAX_TTFT_RATIO = 1.10


@dataclass(frozen=True)
class Setting:
    """One rung of the feature ladder: a name and the config overlay that switches it on."""

    name: str
    overlay: dict[str, Any]
    feature: str | None  # the feature this setting adds to the previous one; None for the baseline


def settings_for(cfg: HeadroomConfig, ngram_tokens: int = 3) -> list[Setting]:
    """Baseline, then prefix caching, chunked prefill and speculation switched on in the seeds' order."""
    e, m = cfg.engine, cfg.model
    # With chunked prefill off a whole prompt must fit one step.
    whole_prompt_budget = max(e.max_num_batched_tokens or 0, m.max_model_len or 0) or None
    off = {"enable_prefix_caching": False, "enable_chunked_prefill": False, "speculative": None}
    if whole_prompt_budget:
        off["max_num_batched_tokens"] = whole_prompt_budget
    settings = [Setting("baseline", {"engine": off}, None)]
    pc = {**off, "enable_prefix_caching": True}
    settings.append(Setting("+prefix caching", {"engine": pc}, "prefix caching"))
    cp = {**pc, "enable_chunked_prefill": True, "max_num_batched_tokens": e.max_num_batched_tokens}
    settings.append(Setting("+chunked prefill", {"engine": cp}, "chunked prefill"))
    ngram = {
        "method": "ngram",
        "num_speculative_tokens": ngram_tokens,
        "prompt_lookup_min": 1,
        "prompt_lookup_max": 3,
    }
    settings.append(
        Setting("+ngram speculation", {"engine": {**cp, "speculative": ngram}}, "ngram speculation")
    )
    if e.speculative is not None and e.speculative.draft_model:
        draft = e.speculative.model_dump(mode="json")
        settings.append(
            Setting(
                "+draft-model speculation",
                {"engine": {**cp, "speculative": draft}},
                "draft-model speculation",
            )
        )
    return settings


def apply(cfg: HeadroomConfig, setting: Setting, name: str) -> HeadroomConfig:
    base = cfg.model_dump(mode="json")
    if "speculative" in setting.overlay.get("engine", {}):
        base["engine"]["speculative"] = None  # replaced whole: one method's fields do not fit another's
    data = deep_merge(base, setting.overlay)
    data["name"] = name
    return parse_config(data, source=f"ladder setting {setting.name!r}")


def production_concurrency(steps: Sequence[dict[str, Any]], ttft_slo_ms: float) -> int | None:
    """The last step before TTFT p95 first exceeds the SLO (None when even the first step exceeds it)."""
    best = None
    for step in steps:
        if not step["ttft_p95_ms"] <= ttft_slo_ms:  # NaN (no successful request) counts as a breach
            break
        best = step["concurrency"]
    return best


def is_speculation(feature: str | None) -> bool:
    return feature is not None and "speculation" in feature


def feature_verdicts(runs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """For each feature, its effect at the highest step against the setting it was added to, and a verdict.

    Settings are cumulative, except that the speculation methods are alternatives: each is compared with
    the last setting before any speculation.
    """
    verdicts = []
    for i, after in enumerate(runs):
        if after["feature"] is None:
            continue
        before = next(r for r in reversed(runs[:i]) if not is_speculation(r["feature"]))
        b, a = before["steps"][-1], after["steps"][-1]
        throughput = _ratio(a["output_tokens_per_s"], b["output_tokens_per_s"])
        ttft = _ratio(a["ttft_p95_ms"], b["ttft_p95_ms"])
        tpot = _ratio(a["tpot_p50_ms"], b["tpot_p50_ms"])
        keep = throughput >= MIN_THROUGHPUT_RATIO and ttft <= MAX_TTFT_RATIO
        if math.isnan(throughput) or math.isnan(ttft):
            verdicts.append(
                {
                    "feature": after["feature"],
                    "setting": after["setting"],
                    "keep": None,
                    "throughput_ratio": throughput,
                    "ttft_p95_ratio": ttft,
                    "tpot_p50_ratio": tpot,
                    "reason": f"not judged: nothing measured at concurrency {a['concurrency']} for "
                    f"{after['setting']} or {before['setting']}; rerun the ladder",
                }
            )
            continue
        why = (
            f"at concurrency {a['concurrency']}: throughput x{throughput:.2f}, TTFT p95 x{ttft:.2f}, "
            f"TPOT p50 x{tpot:.2f} against {before['setting']}"
        )
        verdicts.append(
            {
                "feature": after["feature"],
                "setting": after["setting"],
                "keep": bool(keep),
                "throughput_ratio": throughput,
                "ttft_p95_ratio": ttft,
                "tpot_p50_ratio": tpot,
                "reason": ("keep: " if keep else "switch off, its gain does not survive: ") + why,
            }
        )
    return verdicts


def _ratio(a: float, b: float) -> float:
    return a / b if b and not math.isnan(b) else math.nan


def recommend(runs: Sequence[dict[str, Any]], ttft_slo_ms: float) -> dict[str, Any]:
    """The feature set (features whose gain survives; of the speculation methods, the better surviving
    one) and max_num_seqs: the production concurrency of the setting with exactly those features."""
    verdicts = feature_verdicts(runs)
    # A feature that could not be judged is kept (it was on in every later setting that was measured).
    kept = {v["feature"] for v in verdicts if v["keep"] is not False and not is_speculation(v["feature"])}
    spec = [v for v in verdicts if v["keep"] and is_speculation(v["feature"])]
    if spec:
        kept.add(max(spec, key=lambda v: v["throughput_ratio"])["feature"])
    chosen = runs[0]
    for run in runs[1:]:
        if run["feature"] in kept:
            chosen = run
    return {
        "features": [v["feature"] for v in verdicts if v["feature"] in kept],
        "setting": chosen["setting"],
        "max_num_seqs": chosen["production_concurrency"],
        "verdicts": verdicts,
        "ttft_slo_ms": ttft_slo_ms,
    }


# ------------------------------------------------------------------------------------------------ glue


@dataclass
class MemorySampler:
    """Peak memory of the serving processes while a step runs: the GPU memory nvidia-smi attributes to the
    processes `procs()` returns (the replica and its engine) when there is a GPU, else their resident set."""

    procs: Callable[[], list[Any]]
    interval_s: float = 0.5
    peak_bytes: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)

    def _sample(self) -> int:
        procs = self.procs()
        if _has_gpu():
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


def _has_gpu() -> bool:
    return shutil.which("nvidia-smi") is not None


def replica_processes(app_name: str) -> list[Any]:
    return [proc for r in serve_replicas(app_name) for proc in (r, *r.children(recursive=True))]


def run_locust(
    url: str, model: str, profile: str, ladder: str, max_tokens: int, raw: Path, seed: int
) -> None:
    cmd = [
        sys.executable, "-m", "locust", "-f", str(ROOT / "loadtests" / "locustfile.py"), "--headless",
        "--host", url, "--ladder", ladder, "--model", model, "--profile", profile,
        "--max-tokens", str(max_tokens), "--raw-file", str(raw), "--seed", str(seed), "--only-summary",
        "--csv", str(raw.with_suffix("")),
    ]  # fmt: skip
    # Locust exits 1 when any request failed; failures are data here (the error-rate column), so only a
    # run that produced no raw file is an error.
    result = subprocess.run(cmd, cwd=ROOT, check=False, capture_output=True, text=True)
    if not raw.exists():
        raise RuntimeError(f"locust wrote no results (exit {result.returncode}): {result.stderr[-2000:]}")


# Behind HAProxy a deleted replica stays reachable for 30 s (Serve's default) so that stale load balancers
# can deregister it. The ladder deletes a setting's app only after its load has finished and nothing else
# routes to it, so on a cluster the ladder starts itself the drain is 2 s: 30 s per setting was a third of
# each setting's time on an H200 (results/gpu).
LADDER_DRAIN = ("RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S", "2")

# Each step's first seconds hold the previous step's requests still draining and the new users ramping.
STEP_WARMUP_S = 2.0


def step_rows(raw: Path, ladder: str) -> list[dict[str, Any]]:
    steps = parse_steps(ladder)
    summaries = raw_stats.summarize_by(raw_stats.load_records(raw), "step", warmup_s=STEP_WARMUP_S)
    by_label = {row["group"]: row for row in summaries}
    rows = []
    for step in steps:
        row = by_label.get(f"c={step.value:g}", {})
        rows.append(
            {
                "concurrency": int(step.value),
                **{k: row.get(k, math.nan) for k in ("requests", "ok", "error_rate", "output_tokens_per_s")},
                **{
                    k: row.get(k, math.nan)
                    for k in ("ttft_p50_ms", "ttft_p95_ms", "tpot_p50_ms", "e2e_p50_ms")
                },
            }
        )
    return rows


def kv_estimate(cfg: HeadroomConfig, tokens_per_request: int) -> dict[str, Any]:
    """The planner's KV-cache capacity and the concurrency it allows at this workload's request size."""
    from serve_app.planning.from_config import cluster_spec, plan_config

    plan = plan_config(cfg, cluster_spec(cfg, gpus_per_node=cfg.engine.tensor_parallel_size or 1))
    return {
        "kv_cache_tokens": plan.kv_cache_tokens_per_replica,
        "tokens_per_request": tokens_per_request,
        "concurrency_ceiling": plan.kv_cache_tokens_per_replica // max(1, tokens_per_request),
        "max_num_seqs": plan.max_num_seqs,
    }


def run_ladder(
    cfg: HeadroomConfig,
    profile: str,
    ttft_slo_ms: float,
    ladder: str,
    out: Path,
    max_tokens: int,
    seed: int = 0,
    url: str | None = None,
    progress: Callable[[str], None] = print,
    app_name: str = "ladder",
    http_port: int | None = None,
) -> dict[str, Any]:
    """Runs the whole procedure and writes report.md, results.json, the plots and the raw files to `out`.

    Several ladders can share a cluster (one GPU each) under different `app_name`s and one `http_port`.
    """
    out.mkdir(parents=True, exist_ok=True)
    runs: list[dict[str, Any]] = []
    if url is not None:
        settings = [Setting("as deployed", {}, None)]
    else:
        settings = settings_for(cfg)
        import ray
        from ray import serve

        from serve_app.serving.deployment import build_from_config
        from serve_app.serving.serve_options import apply_cluster_env

        apply_cluster_env(os.environ)
        if not ray.is_initialized():
            # Seen only by a cluster this ray.init starts; this process's environment is left as it was.
            name, value = LADDER_DRAIN
            before = os.environ.get(name)
            os.environ.setdefault(name, value)
            try:
                ray.init(address=os.environ.get("RAY_ADDRESS"), logging_level="ERROR", log_to_driver=False)
            finally:
                if before is None:
                    del os.environ[name]
        http_port = http_port or 8000 + (os.getpid() % 1000)
        serve.start(http_options={"host": "127.0.0.1", "port": http_port})
    for index, setting in enumerate(settings):
        raw = out / f"raw_{index}_{setting.name.strip('+').replace(' ', '_')}.jsonl"
        raw.unlink(missing_ok=True)
        if url is None:
            app_cfg = apply(cfg, setting, name=app_name)
            progress(f"[{index + 1}/{len(settings)}] {setting.name}: deploying a fresh engine")
            serve.run(build_from_config(app_cfg), name=app_name, route_prefix=f"/{app_name}")
            target = f"http://127.0.0.1:{http_port}/{app_name}"
        else:
            app_cfg, target = cfg, url
        # A fresh engine's first requests pay one-time costs; they are not part of any step.
        asyncio.run(run_load(target, cfg.served_model_name, 4, 8, max_tokens))
        progress(f"[{index + 1}/{len(settings)}] {setting.name}: ladder {ladder}")
        with MemorySampler(lambda: replica_processes(app_name)) as memory:
            run_locust(target, cfg.served_model_name, profile, ladder, max_tokens, raw, seed)
        if url is None:
            serve.delete(app_name)
        steps = step_rows(raw, ladder)
        records = [r for r in raw_stats.load_records(raw) if raw_stats.is_success(r)]
        tokens_per_request = round(
            sum((r.get("prompt_tokens") or 0) + (r.get("output_tokens") or 0) for r in records)
            / max(1, len(records))
        )
        runs.append(
            {
                "setting": setting.name,
                "feature": setting.feature,
                "engine": app_cfg.engine.model_dump(mode="json"),
                "steps": steps,
                "peak_memory_gib": memory.peak_bytes / 1024**3,
                "production_concurrency": production_concurrency(steps, ttft_slo_ms),
                "kv_estimate": kv_estimate(app_cfg, tokens_per_request),
                "raw_file": raw.name,
            }
        )
        progress(f"    production concurrency {runs[-1]['production_concurrency']}, peak memory "
                 f"{runs[-1]['peak_memory_gib']:.2f} GiB")  # fmt: skip
        # Written after every setting: a run cut short still leaves the settings it measured.
        report = {
            "machine": describe(),
            "versions": versions(),
            "model": cfg.served_model_name,
            "profile": profile,
            "ladder": ladder,
            "max_tokens": max_tokens,
            "seed": seed,
            "ttft_slo_ms": ttft_slo_ms,
            "runs": runs,
            "settings_planned": [s.name for s in settings],
            "recommendation": recommend(runs, ttft_slo_ms),
            "command": " ".join(["headroom", "ladder", *sys.argv[2:]]),
        }
        (out / "results.json").write_text(json.dumps(report, indent=2, default=str))
        plot(report, out)
        (out / "report.md").write_text(markdown(report))
    return report


def versions() -> dict[str, str]:
    from importlib.metadata import version

    import ray
    import vllm

    # Locust's version from its metadata: importing locust would monkey-patch this process for gevent.

    return {
        "vllm": vllm.__version__,
        "ray": ray.__version__,
        "locust": version("locust"),
        "python": platform.python_version(),
    }


def plot(report: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    (ttft, tpot), (tput, mem) = axes
    for run in report["runs"]:
        c = [s["concurrency"] for s in run["steps"]]
        ttft.plot(c, [s["ttft_p50_ms"] for s in run["steps"]], marker="o", label=f"{run['setting']} p50")
        ttft.plot(
            c,
            [s["ttft_p95_ms"] for s in run["steps"]],
            marker="x",
            linestyle="--",
            label=f"{run['setting']} p95",
        )
        tpot.plot(c, [s["tpot_p50_ms"] for s in run["steps"]], marker="o", label=run["setting"])
        tput.plot(c, [s["output_tokens_per_s"] for s in run["steps"]], marker="o", label=run["setting"])
    ttft.axhline(report["ttft_slo_ms"], color="red", linewidth=0.8, label="TTFT SLO")
    for ax, title, unit in (
        (ttft, "TTFT", "ms"),
        (tpot, "TPOT p50", "ms"),
        (tput, "output throughput", "tok/s"),
    ):
        ax.set(title=title, xlabel="concurrency", ylabel=unit, xscale="log")
        ax.legend(fontsize=6)
    mem.bar([r["setting"] for r in report["runs"]], [r["peak_memory_gib"] for r in report["runs"]])
    mem.set(title="peak memory", ylabel="GiB")
    mem.tick_params(axis="x", labelrotation=20, labelsize=7)
    fig.tight_layout()
    fig.savefig(out / "ladder.png", dpi=110)
    plt.close(fig)


def steps_table(runs: Sequence[dict[str, Any]]) -> list[str]:
    """Every setting's steps as Markdown table rows."""
    lines = [
        "| setting | concurrency | TTFT p50 ms | TTFT p95 ms | TPOT p50 ms | output tok/s | errors |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for run in runs:
        for s in run["steps"]:
            lines.append(
                f"| {run['setting']} | {s['concurrency']} | {s['ttft_p50_ms']:.1f} | "
                f"{s['ttft_p95_ms']:.1f} | {s['tpot_p50_ms']:.2f} | {s['output_tokens_per_s']:.0f} | "
                f"{s['error_rate']:.1%} |"
            )
    return lines


def markdown(report: dict[str, Any]) -> str:
    rec = report["recommendation"]
    lines = [
        f"# Tuning ladder: {report['model']}, profile `{report['profile']}`",
        "",
        f"Machine: {report['machine']}. Versions: "
        + ", ".join(f"{k} {v}" for k, v in report["versions"].items())
        + ".",
        f"Ladder (users:seconds): `{report['ladder']}`; {report['max_tokens']} output tokens per request; "
        f"seed {report['seed']}; TTFT p95 SLO {report['ttft_slo_ms']:g} ms. Each setting ran on a freshly "
        "deployed engine (an empty prefix cache). All numbers are measured, exact percentiles from the "
        "per-request raw files.",
        "",
        "![ladder](ladder.png)",
        "",
        *steps_table(report["runs"]),
    ]
    lines += [
        "",
        "| setting | production concurrency (TTFT p95 <= SLO) | KV-estimated ceiling | peak memory GiB |",
        "|---|---:|---:|---:|",
    ]
    for run in report["runs"]:
        kv = run["kv_estimate"]
        lines.append(
            f"| {run['setting']} | {run['production_concurrency']} | {kv['concurrency_ceiling']:,} "
            f"({kv['kv_cache_tokens']:,} KV tokens / {kv['tokens_per_request']} per request) | "
            f"{run['peak_memory_gib']:.2f} |"
        )
    lines += ["", "## Recommendation", ""]
    lines.append(
        f"- max_num_seqs: **{rec['max_num_seqs']}** (the production concurrency of `{rec['setting']}`)"
    )
    lines.append("- features: " + (", ".join(rec["features"]) or "none"))
    lines += [f"- {v['feature']}: {v['reason']}" for v in rec["verdicts"]]
    lines += [
        "",
        "The KV-estimated ceiling is how many requests of this size the KV cache holds; the production "
        "concurrency is usually lower, because TTFT degrades before the cache fills.",
        "",
        f"Command: `{report['command']}`",
        "",
    ]
    return "\n".join(lines)
