"""Where headroom's extra time per request goes against bare `vllm serve`: one run collects the evidence.

Both servers up at once with the same engine flags (bare vLLM on the first GPU, headroom on the second;
with one GPU, both on it, each configured to half its memory; on the CPU build, the same CPUs). Then, as
far as the time budget allows, in this order:
1. Process facts of each server's frontend (API server; replica, HAProxy) and engine core: niceness, CPU
   affinity, scheduler, threads by name, cgroup, and the environment (the engine cores' compared).
2. A concurrency-1 sweep with `vllm bench serve` over prompt lengths across the 512-token CUDA-graph
   ceiling (default 50, 448, 576, 1024 tokens), servers alternating, with CPU time per request of every
   process and of each engine-core and frontend thread. During the longest prompts: `py-spy dump` and a
   `py-spy record` of each engine core and frontend.
3. HAProxy's stats before and after: did the backup server (the slow path through Serve's proxy) serve?
4. A loaded cell (default concurrency 64, 1024-token prompts; `--load-profile WORKLOAD:C:N`) with a
   `py-spy record` of each frontend: what the replica's event loop does per token.
5. The GPUs swapped (both servers restarted) and the sweep's shortest and longest prompts again: does the
   difference follow the server or the GPU?
Writes diag.json, diag.txt (findings first, then the evidence and a decision table), py-spy profiles and
logs under --out.

    python -m loadtests.overhead_diag --env local --out /tmp/diag          (CPU build: a smoke run)
    bash loadtests/gpu/run.sh diag                                        (GPU: one or two H200s)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import psutil

from loadtests import diag_evidence as ev
from loadtests import vllm_bench
from loadtests.bench_overhead import Bench, Cell, Target, stop_on_sigterm, versions
from loadtests.machine import describe
from loadtests.overhead_matrix import BARE, HEADROOM, VLLM_BENCH
from loadtests.overhead_servers import (
    ServerProcesses,
    add_compile_cache_argument,
    cpu_seconds,
    process_cpu_s,
)
from loadtests.vllm_bench import WORKLOADS, Workload

HAPROXY_STATS_URL = "http://127.0.0.1:8404/stats;csv"
LOG_PATTERNS = re.compile(
    r"OMP|Torch threads|thread binding|cudagraph|CUDA graph|capture|torch\.compile|[Cc]ompil|max_num_batched|"
    r"chunked prefill|nice",
)


# ---- process facts --------------------------------------------------------------------------------------


def thread_names(proc: psutil.Process) -> dict[int, str]:
    names = {}
    for t in proc.threads():
        try:
            names[t.id] = Path(f"/proc/{proc.pid}/task/{t.id}/comm").read_text().strip()
        except OSError:
            names[t.id] = "?"
    return names


def thread_cpu(proc: psutil.Process) -> dict[int, tuple[str, float]]:
    """{tid: (thread name, CPU seconds so far)}."""
    try:
        names = thread_names(proc)
        return {t.id: (names.get(t.id, "?"), t.user_time + t.system_time) for t in proc.threads()}
    except psutil.Error:
        return {}


def process_facts(proc: psutil.Process) -> dict[str, Any]:
    with proc.oneshot():
        names = thread_names(proc)
        counts: dict[str, int] = {}
        for n in names.values():
            counts[n] = counts.get(n, 0) + 1
        facts: dict[str, Any] = {
            "pid": proc.pid,
            "cmdline": " ".join(proc.cmdline())[:200],
            "nice": proc.nice(),
            "affinity": proc.cpu_affinity(),
            "sched_policy": os.sched_getscheduler(proc.pid),
            "num_threads": proc.num_threads(),
            "thread_names": dict(sorted(counts.items(), key=lambda kv: -kv[1])),
            # The engine-relevant variables only. /proc/PID/environ is what the process was started with;
            # vLLM's engine core rewrites that memory for its process title (then it reads empty), and a
            # forked child shows its parent's start-up environment, not what the parent set before forking.
            "environ": {k: ev.redact(k, v) for k, v in proc.environ().items() if ev.is_engine_var(k)} or None,
        }
    with contextlib.suppress(OSError):
        facts["cgroup"] = Path(f"/proc/{proc.pid}/cgroup").read_text().strip()[:300]
    return facts


def describe_process(p: psutil.Process) -> str:
    """pid, parent and command line: enough to tell a helper process from the engine core."""
    try:
        with p.oneshot():
            return f"{p.pid} (parent {p.ppid()}) {' '.join(p.cmdline()).strip()[:160] or p.name()}"
    except psutil.Error:
        return f"{p.pid} (ended)"


def key_processes(procs: ServerProcesses) -> dict[str, psutil.Process]:
    """The frontend's main process (API server / replica), HAProxy, and the engine core."""
    out = {"frontend": procs.frontend[0]}
    for p in procs.frontend[1:]:
        with contextlib.suppress(psutil.Error):  # a process may end between the listing and here
            if "haproxy" in p.name():
                out["haproxy"] = p
    cores = procs.engine_cores()
    if cores:
        out["engine_core"] = cores[0]
    return out


# ---- py-spy ---------------------------------------------------------------------------------------------


def py_spy() -> str | None:
    here = Path(sys.executable).parent / "py-spy"
    return str(here) if here.exists() else shutil.which("py-spy")


class Recording:
    """`py-spy record` of one process until stopped (SIGINT makes py-spy write what it has)."""

    def __init__(self, pid: int, out: Path, rate_hz: int = 100):
        self.out = out
        exe = py_spy()
        self.proc = None
        if exe is not None:
            cmd = [exe, "record", "--pid", str(pid), "--rate", str(rate_hz), "--format", "raw", "--threads"]
            cmd += ["--nonblocking", "--output", str(out)]
            self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.started = time.monotonic()

    def stop(self) -> dict[str, Any]:
        if self.proc is None:
            return {"error": "py-spy not found"}
        self.proc.send_signal(signal.SIGINT)
        try:
            _, err = self.proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            _, err = self.proc.communicate()
        seconds = time.monotonic() - self.started
        if not self.out.exists():
            return {"error": (err or "no output")[-300:]}
        profile = ev.pyspy_profile(self.out.read_text().splitlines())
        return {"seconds": round(seconds, 1), "file": self.out.name, "threads": profile}


def dump(pid: int, native: bool) -> str:
    exe = py_spy()
    if exe is None:
        return "py-spy not found"
    # Native frames need the process paused for a moment (py-spy refuses them with --nonblocking).
    cmd = [exe, "dump", "--pid", str(pid)] + (["--native"] if native else ["--nonblocking"])
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)
    return (r.stdout or r.stderr)[-6000:]


# ---- the diagnostic -------------------------------------------------------------------------------------


class Diagnostic:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.lengths = [
            Workload(f"len{n}", n, args.output_len, 0, f"{n}-token prompts") for n in args.lengths
        ]
        # The warm-up (Bench.warm_up) sends a few requests of each length to each server.
        self.bench = Bench(args, [Cell(w, 1, 1) for w in self.lengths])
        self.out: Path = args.out
        (self.out / "pyspy").mkdir(parents=True, exist_ok=True)
        self.started = time.monotonic()
        self.evidence: dict[str, Any] = {"steps_skipped": [], "sweep": [], "swapped_sweep": []}

    def time_left_s(self) -> float:
        return self.args.budget_s - (time.monotonic() - self.started)

    def targets(self) -> list[Target]:
        return self.bench.targets[:2]

    def placement(self, a: int) -> dict[str, str | None]:
        gpus = self.args.gpus or []
        if len(gpus) == 1:  # both on one GPU (each config'd to half its memory), started one after another
            return {BARE: gpus[0], HEADROOM: gpus[0]}
        if not gpus:
            return {BARE: None, HEADROOM: None}
        return {BARE: gpus[a % 2], HEADROOM: gpus[(a + 1) % 2]}

    # ---- steps --------------------------------------------------------------------------------------

    def snapshot(self) -> None:
        facts: dict[str, dict[str, Any]] = {}
        for t in self.targets():
            facts[t.name] = {}
            for k, p in key_processes(self.bench.procs[t.name]).items():
                try:
                    facts[t.name][k] = process_facts(p)
                except psutil.Error as e:
                    facts[t.name][k] = {"error": repr(e)}
        cores = {name: f.get("engine_core", {}) for name, f in facts.items()}
        self.evidence["process_findings"] = ev.process_findings(cores)
        self.evidence["processes"] = facts
        # Every process each server's CPU accounting counts (an extra child would show here).
        self.evidence["process_groups"] = {
            t.name: {
                g: [describe_process(p) for p in ps] for g, ps in self.bench.procs[t.name].groups().items()
            }
            for t in self.targets()
        }
        # What each engine-side process other than the engine core is doing (its Python stack).
        self.evidence["engine_helper_dumps"] = {
            f"{t.name} {describe_process(p)}": dump(p.pid, native=False)
            for t in self.targets()
            for p in self.bench.procs[t.name].engine
            if p not in self.bench.procs[t.name].engine_cores()
        }

    def run_one(self, t: Target, w: Workload, c: int, n: int, seed: int, tag: str) -> dict[str, Any]:
        """One `vllm bench serve` run with CPU per process and per thread of the frontend and engine core."""
        procs = self.bench.procs[t.name]
        keys = key_processes(procs)
        before = {k: thread_cpu(p) for k, p in keys.items()}
        groups_before = cpu_seconds(procs.groups())
        engine_before = process_cpu_s(procs.engine)
        argv = vllm_bench.bench_args(
            t.base_url, self.bench.cfg.served_model_name, self.bench.tokenizer, w, c, n, seed,
            str(self.bench.raw), f"diag-{tag}-{t.name}-{w.name}-c{c}.json",
        )  # fmt: skip
        result = self.bench.client(t.name).run({"client": VLLM_BENCH, "argv": argv})
        after = {k: thread_cpu(p) for k, p in keys.items()}
        groups_after = cpu_seconds(procs.groups())
        engine_after = process_cpu_s(procs.engine)
        completed = result.get("completed") or 1
        row: dict[str, Any] = {
            "server": t.name,
            "gpu": t.server.gpu,
            "input_len": w.input_len,
            "concurrency": c,
        }
        row |= {
            k: result.get(k) for k in ("ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "output_tokens_per_s")
        }
        for g, cpu_s in groups_after.items():  # every process of the group (engine: the frontend's children)
            row[f"{g}_group_cpu_ms_per_request"] = round((cpu_s - groups_before[g]) / completed * 1000, 2)
        # Each engine-side process on its own: a helper beside the engine core shows here by pid.
        row["engine_processes_cpu_ms_per_request"] = {
            describe_process(p): round((engine_after[p.pid] - engine_before[p.pid]) / completed * 1000, 2)
            for p in procs.engine
            if p.pid in engine_before and p.pid in engine_after
        }
        for k in keys:
            threads = ev.thread_cpu_by_name(before[k], after[k])
            row[f"{k}_cpu_ms_per_request"] = round(sum(r["cpu_s"] for r in threads) / completed * 1000, 2)
            row[f"{k}_threads"] = threads[:6]
        print(f"{tag} {t.name} {w.name} c={c}: TTFT p50 {row['ttft_p50_ms']:.1f} ms, engine core "
              f"{row.get('engine_core_cpu_ms_per_request')} ms CPU/request", flush=True)  # fmt: skip
        return row

    def sweep(self, rounds: int, workloads: list[Workload], into: str, profile: bool) -> None:
        for r in range(rounds):
            for i, w in enumerate(workloads):
                if not self.step(f"{into} round {r} from {w.input_len} tokens on", 20):
                    return
                order = self.targets() if (r + i) % 2 == 0 else self.targets()[::-1]
                for t in order:
                    if profile and r == 0 and w is workloads[-1]:
                        row = self.profiled(t, w, 1, self.args.profile_prompts, 20_000 + i)
                    else:
                        row = self.run_one(t, w, 1, self.args.prompts, 10_000 * (r + 1) + i, into)
                    self.evidence[into].append({"round": r, **row})

    def profiled(self, t: Target, w: Workload, c: int, n: int, seed: int) -> dict[str, Any]:
        """run_one while py-spy records the engine core and the frontend; a dump of each mid-run."""
        keys = key_processes(self.bench.procs[t.name])
        recs = {
            k: Recording(p.pid, self.out / "pyspy" / f"{t.name}-{k}-c{c}.txt")
            for k, p in keys.items()
            if k != "haproxy"
        }
        dumps: dict[str, str] = {}

        def dump_later() -> None:
            time.sleep(self.args.dump_after_s)
            for k, p in keys.items():
                if k != "haproxy":
                    dumps[k] = dump(p.pid, native=(k == "engine_core"))

        dumper = threading.Thread(target=dump_later, daemon=True)
        dumper.start()
        row = self.run_one(t, w, c, n, seed, f"profiled-c{c}")
        dumper.join(timeout=120)
        row["pyspy_record"] = {k: rec.stop() for k, rec in recs.items()}
        row["pyspy_dump"] = dumps
        return row

    def haproxy(self) -> list[dict[str, Any]]:
        try:
            return ev.haproxy_servers(httpx.get(HAPROXY_STATS_URL, timeout=5).text)
        except httpx.HTTPError as e:
            return [{"error": str(e)}]

    def high_concurrency(self) -> None:
        name, c, n = self.args.load_profile
        w = WORKLOADS[name].with_output_len(self.args.output_len)
        self.evidence["load_profile"] = [self.profiled(t, w, c, n, 30_000) for t in self.targets()]

    # ---- the run ------------------------------------------------------------------------------------

    def step(self, name: str, needs_s: float) -> bool:
        if self.time_left_s() >= needs_s:
            return True
        self.evidence["steps_skipped"].append(
            f"{name}: {self.time_left_s():.0f} s left, needs ~{needs_s:.0f} s"
        )
        return False

    def run(self) -> None:
        start_s = self.bench.start([self.bench.bare, self.bench.headroom], self.placement(0))
        self.evidence["start_s"] = round(start_s, 1)
        self.snapshot()
        hap_before = self.haproxy()
        t0 = time.monotonic()
        self.sweep(self.args.rounds, self.lengths, "sweep", profile=True)
        sweep_s = time.monotonic() - t0
        hap_after = self.haproxy()
        self.evidence["haproxy"] = {"after": hap_after}
        if hap_before and "error" not in hap_before[0] and hap_after and "error" not in hap_after[0]:
            self.evidence["haproxy"]["backup_sessions_during_sweep"] = ev.backup_sessions(
                hap_before, hap_after
            )
        if self.args.load_profile and self.step("loaded profile", sweep_s / 2):
            self.high_concurrency()
        if len(self.args.gpus or []) >= 2 and self.step("GPU swap", start_s + sweep_s / 2):
            self.bench.stop()
            self.bench.start([self.bench.bare, self.bench.headroom], self.placement(1))
            self.sweep(1, [self.lengths[0], self.lengths[-1]], "swapped_sweep", profile=False)

    def logs(self) -> dict[str, list[str]]:
        """vLLM's lines about threads, graphs and compilation, from both servers' logs."""
        files = {"vllm": [self.bench.bare.log_path]}
        files["headroom"] = sorted(Path("/tmp/ray/session_latest/logs").glob("worker-*"))
        out = {}
        for name, paths in files.items():
            lines = []
            for path in paths:
                with contextlib.suppress(OSError):
                    lines += [
                        ln for ln in path.read_text(errors="replace").splitlines() if LOG_PATTERNS.search(ln)
                    ]
            out[name] = [ln[-300:] for ln in lines[:60]]
        return out

    def findings(self) -> list[str]:
        out = []
        deltas = ev.ttft_deltas(self.evidence["sweep"])
        if (g := ev.graph_boundary_finding(deltas)) is not None:
            out.append(g)
        for n in sorted({m["input_len"] for m in self.evidence["sweep"]}):
            rows = {m["server"]: m for m in self.evidence["sweep"] if m["input_len"] == n and m["round"] == 0}
            for k, label in (
                ("engine_group", "engine (all the frontend's child processes)"),
                ("engine_core", "engine-core"),
                ("frontend", "frontend main process"),
            ):
                key = f"{k}_cpu_ms_per_request"
                line = ev.ratio_finding(
                    f"{label} CPU per request at {n} tokens (c=1)",
                    rows.get(BARE, {}).get(key), rows.get(HEADROOM, {}).get(key), "ms",
                )  # fmt: skip
                if line:
                    out.append(line)
        out += self.evidence.get("process_findings", [])
        backup = self.evidence.get("haproxy", {}).get("backup_sessions_during_sweep")
        if backup is not None:
            out.append(f"HAProxy backup server (Serve's proxy) sessions during the sweep: {backup}.")
        swap = ev.swap_finding(deltas, ev.ttft_deltas(self.evidence["swapped_sweep"]))
        if swap:
            out.append(swap)
        return out

    def write(self) -> None:
        report = {
            "machine": describe(),
            "versions": versions(),
            "engine_flags": self.bench.flags,
            "layout": {BARE: self.placement(0)[BARE], HEADROOM: self.placement(0)[HEADROOM]},
            "budget_s": self.args.budget_s,
            "elapsed_s": round(time.monotonic() - self.started, 1),
            "command": " ".join(["python -m loadtests.overhead_diag", *sys.argv[1:]]),
            "findings": self.findings(),
            **self.evidence,
            "log_lines": self.logs(),
            "gpu": gpu_facts(),
        }
        (self.out / "diag.json").write_text(json.dumps(report, indent=1, default=str))
        (self.out / "diag.txt").write_text(text_report(report))


def gpu_facts() -> dict[str, str]:
    if shutil.which("nvidia-smi") is None:
        return {}
    out = {}
    for name, cmd in (("clocks", ["-q", "-d", "CLOCK,POWER,PERFORMANCE"]), ("topology", ["topo", "-m"])):
        r = subprocess.run(["nvidia-smi", *cmd], capture_output=True, text=True, check=False, timeout=30)
        out[name] = r.stdout[-8000:]
    return out


DECISIONS = """\
Decision table (issue 12): what each finding means, and the fix.
- TTFT added jumps across 512 tokens AND the engine core's CPU per request is higher in headroom: the
  engine core runs its eager prefill slower. Look at the engine-core rows above (environment, threads,
  niceness, affinity, hottest threads in py-spy). Fix by the cause:
  * OMP/MKL thread variables differ (Ray sets OMP_NUM_THREADS=<num_cpus> in workers): headroom's engine
    core gets vLLM's own choice (no OMP_NUM_THREADS) -> RAY_WORKER_DEFAULTS in serving/serve_options.py.
  * niceness/affinity/scheduler differ: RAY_worker_niceness (SERVE_CLUSTER_ENV) or the affinity Ray set.
  * an extra busy thread in headroom's engine core (py-spy: a thread only headroom has): remove its cause.
  * otherwise: raise vLLM's CUDA-graph ceiling for both (--compilation-config
    '{"max_cudagraph_capture_size": 1024}', one flag in serve_app/serving/engine_args.py), which takes
    1024-token prefills off the CPU-bound eager path.
- TTFT added is flat across lengths (about the same at 50 and 1024 tokens): a fixed per-request cost on the
  HTTP path (HAProxy hop + Serve's ingress wrapper). Check the frontend rows: `x-request-disconnect-disabled`
  (no receive task per request) needs a middleware in serve_app/serving/asgi.py (security helper's file).
- Frontend CPU per token higher at c=64 and the replica's py-spy profile shows Ray metric calls
  (ray/util/metrics.py, ray_wrappers.py) or Serve's access log (logging, handlers) in the event loop:
  per-step Ray metrics -> a buffered stat logger in serve_app/serving/engine.py (engine stat logger's owner);
  the access log -> RAY_SERVE_REQUEST_PATH_LOG_BUFFER_SIZE / RAY_SERVE_LOG_TO_STDERR in SERVE_CLUSTER_ENV.
- HAProxy's backup server took sessions: the replica was marked DOWN during the run (health check or
  observe layer4); those requests took Serve's Python proxy. Look at the replica log for the check failures.
- The difference follows the GPU after the swap: the two GPUs differ (clocks/power above); the overhead
  phase must swap GPUs between rounds (loadtests/gpu/run.sh overhead does) or run on one GPU.
"""


def _cpu_lines(m: dict[str, Any], lead: str) -> list[str]:
    """One run's TTFT, TPOT and CPU per request: key processes, whole groups, the busiest threads and each
    engine-side process."""
    groups = ", ".join(
        f"{g.removesuffix('_group_cpu_ms_per_request')} {v}"
        for g, v in m.items()
        if g.endswith("_group_cpu_ms_per_request")
    )
    lines = [
        f"  {lead}{m['server']:8} GPU {m['gpu']} {m['input_len']:5} tok: TTFT p50 "
        f"{m['ttft_p50_ms']:7.1f} ms  TPOT {m['tpot_p50_ms']:6.2f} ms  CPU/request ms: frontend "
        f"{m.get('frontend_cpu_ms_per_request')}, engine core {m.get('engine_core_cpu_ms_per_request')}"
        + (f", haproxy {m['haproxy_cpu_ms_per_request']}" if "haproxy_cpu_ms_per_request" in m else "")
        + f"; whole groups: {groups}"
    ]
    for k in ("engine_core", "frontend"):
        busiest = ", ".join(
            f"{t['thread']} x{t['threads']} {t['cpu_s']:.3f}s" for t in m.get(f"{k}_threads", [])[:4]
        )
        lines.append(f"      {k} threads: {busiest}")
    for proc, ms in (m.get("engine_processes_cpu_ms_per_request") or {}).items():
        lines.append(f"      engine process {proc}: {ms} ms CPU/request")
    return lines


def text_report(report: dict[str, Any]) -> str:
    lines = [
        "headroom vs bare vLLM: where the extra time per request goes (loadtests/overhead_diag.py)",
        f"Machine: {report['machine']}; vLLM {report['versions']['vllm']}, Ray {report['versions']['ray']}.",
        f"Servers: bare on GPU {report['layout'][BARE]}, headroom on GPU {report['layout'][HEADROOM]}; "
        f"ready after {report.get('start_s')} s; ran {report['elapsed_s']:.0f} s",
        f"(budget {report['budget_s']:.0f} s).",
        "",
        "FINDINGS",
        *[f"- {f}" for f in report["findings"]],
        *[f"- skipped: {s}" for s in report["steps_skipped"]],
        "",
        "c=1 SWEEP (vllm bench serve; CPU per request of the frontend main process and the engine core)",
    ]
    for m in report["sweep"] + report["swapped_sweep"]:
        lines += _cpu_lines(m, f"round {m['round']} ")
    if report.get("load_profile"):
        lines += ["", "LOADED CELL (vllm bench serve, profiled; CPU per request as above)"]
        for m in report["load_profile"]:
            lines += _cpu_lines(m, f"c={m['concurrency']} {m.get('output_tokens_per_s') or 0:,.0f} tok/s ")
    for m in report["sweep"] + report.get("load_profile", []):
        for k, rec in (m.get("pyspy_record") or {}).items():
            where = f"{m['server']} {k} c={m['concurrency']} {m['input_len']} tok"
            lines.append(f"PY-SPY RECORD {where} ({rec.get('seconds')} s):")
            for name, th in list((rec.get("threads") or {}).items())[:4]:
                top = "; ".join(f"{leaf} {n}" for leaf, n in th["top"][:5])
                lines.append(f"    {name}: {th['samples']} samples: {top}")
    lines += ["", "PROCESSES (environment: engine-relevant variables; None = unreadable, see diag.json)"]
    for server, procs in report.get("processes", {}).items():
        for k, p in procs.items():
            if "error" in p:
                lines.append(f"  {server} {k}: {p['error']}")
                continue
            lines.append(
                f"  {server} {k}: pid {p['pid']} nice {p['nice']} affinity {p['affinity']} sched "
                f"{p['sched_policy']} threads {p['num_threads']} {dict(list(p['thread_names'].items())[:8])}"
            )
            lines.append(f"      environment: {p['environ']}")
    for server, groups in report.get("process_groups", {}).items():
        lines += [f"  {server} {g}: {', '.join(ps)}" for g, ps in groups.items()]
    lines += ["", "HAPROXY (sessions per server after the sweep)"]
    for r in report.get("haproxy", {}).get("after", []):
        lines.append(f"  {r}")
    lines += ["", "VLLM LOG LINES"]
    for name, log in report["log_lines"].items():
        lines += [f"  [{name}] {ln}" for ln in log[:30]]
    for proc, text in report.get("engine_helper_dumps", {}).items():
        lines += ["", f"PY-SPY DUMP engine helper {proc}", text]
    for m in report["sweep"] + report.get("load_profile", []):
        for k, text in (m.get("pyspy_dump") or {}).items():
            lines += ["", f"PY-SPY DUMP {m['server']} {k} c={m['concurrency']}", text]
    lines += ["", DECISIONS]
    for name, text in report["gpu"].items():
        lines += ["", f"NVIDIA-SMI {name}", text]
    return "\n".join(lines) + "\n"


def _load_cell(text: str) -> tuple[str, int, int] | None:
    """'short:256:1280' -> ('short', 256, 1280); 'none' -> None."""
    if text == "none":
        return None
    name, _, rest = text.partition(":")
    c, _, n = rest.partition(":")
    if name not in WORKLOADS or not (c.isdigit() and n.isdigit() and int(c) > 0 and int(n) > 0):
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected WORKLOAD:C:N with WORKLOAD one of {sorted(WORKLOADS)} and C, N > 0, "
            "or 'none'"
        )
    return name, int(c), int(n)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    source = p.add_mutually_exclusive_group()
    source.add_argument("--env", default="local")
    source.add_argument("--config", nargs="+")
    p.add_argument("--lengths", type=int, nargs="+", default=[50, 448, 576, 1024], help="prompt tokens, c=1")
    p.add_argument("--prompts", type=int, default=10, help="prompts per c=1 run")
    p.add_argument("--profile-prompts", type=int, default=30, help="prompts of the profiled c=1 run")
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument(
        "--load-profile",
        type=_load_cell,
        default=_load_cell("random-1024:64:128"),
        help="WORKLOAD:C:N: the loaded cell profiled with py-spy (N prompts at concurrency C); 'none': none",
    )
    p.add_argument("--dump-after-s", type=float, default=1.0)
    p.add_argument(
        "--gpus", nargs="+",
        help="two GPU ids: bare on the first, headroom on the second; one: both on it (give each half its "
        "memory in the config), started one after another",
    )  # fmt: skip
    p.add_argument("--budget-s", type=float, default=330)
    add_compile_cache_argument(p)
    p.add_argument("--start-timeout-s", type=float, default=600)
    p.add_argument("--out", type=Path, default=Path("results/diag"))
    args = p.parse_args(argv)
    # What Bench reads and the diagnostic does not vary.
    args.variant, args.concurrent, args.warmup_prompts, args.bare_flags = [], False, 4, "same"
    args.direct, args.bare_turnaround_ms, args.engine_timing = False, [], True
    args.share_gpu = False  # the diagnostic places its servers itself (Diagnostic.placement)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    diag = Diagnostic(args)
    stop_on_sigterm()
    try:
        diag.run()
    finally:
        diag.bench.close()
        diag.write()
    print((args.out / "diag.txt").read_text()[:6000])
    return 0


if __name__ == "__main__":
    sys.exit(main())
