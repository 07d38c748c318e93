"""headroom's serving overhead against bare `vllm serve`, measured with vLLM's own client, side by side.

Both servers get the engine flags a headroom replica gets (serve_app.serving.engine_args with the plan).
Each round measures every cell of the matrix (workload x concurrency) on each server with `vllm bench
serve` (and with our client where asked), alternating which server goes first; the report gives each
metric's median over rounds with its min-max, and the per-round paired comparison with bare vLLM
(loadtests/overhead_matrix.py). Layouts, by `--gpus`:
- none (CPU build): both servers up at once, loaded one at a time.
- `--gpus A B`: bare vLLM on A, headroom on B, both up at once. `--swap-gpus` restarts both on swapped
  GPUs between rounds (as the time budget allows), so a difference between the GPUs cannot pass for
  overhead; `--concurrent` loads both at once, each from its own client process, halving the time.
- `--gpus A`: one GPU; each round starts, measures and stops each server in turn.
- `--gpus A --share-gpu`: both servers up at once on one GPU (give each half its memory in the config),
  started one after another, loaded one at a time: no restart per round.
`--variant NAME:ENV=VALUE,...` adds a headroom app whose replicas get that environment (a candidate fix,
measured in the same run). `--direct` adds headroom's replica on its own HTTP port as a third target (the
same replica and engine, HAProxy skipped), to place a difference in the ingress or in the replica.
`--bare-turnaround-ms MS ...` adds bare vLLM once more per value as `vllm+MSms`: the same server, loaded by a
client that sends each request MS ms after its slot frees (vllm_bench.wait_before_each_request), so a
closed loop's turnaround is longer by that much and nothing else changes; set beside headroom, it tells
whether a longer turnaround alone gives a closed loop headroom's first-token times.
`--open-loop C:RATE` adds, beside the closed loop at concurrency C, an open loop of Poisson arrivals at RATE
requests/s, the same for every server: a closed loop's next arrivals follow its completions, so a server's
latency feeds back into its load; an open loop's do not. Around each cell the engines' own TTFT histograms
are read (medians from bucket counts, loadtests/engine_timing.py), so a slower first token can be placed
inside or outside the engine, with each engine's prefix-cache hit rate (vLLM's counters) and, for headroom,
Ray Serve's probe of the replica's event loop (how late a sleep wakes up, sampled more often here:
engine_timing.LOOP_PROBE_INTERVAL_S), which tells whether that loop is saturated; not with `--variant`, whose
apps share one Ray metrics export. Each reading of headroom's waits until Ray has exported the cell's last
requests (every 10 s by default), so `--no-engine-timing` skips them all for a faster round (in the
2026-12-04 GPU run a round spent 115 of its 309 s outside `vllm bench serve`'s runs).
Results are written after every round, so a run cut short keeps what it measured: results.json,
report.md and the raw `vllm bench serve` results under raw/.

    python -m loadtests.bench_overhead --env local --out results/bench_overhead     (make bench-overhead)
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import shlex
import signal
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from loadtests import engine_logs, vllm_bench
from loadtests.engine_timing import Totals, cell_prefix_cache_hit_pct, cell_quantiles_ms, finished
from loadtests.machine import cluster_here, describe
from loadtests.overhead_client import ClientProcess, results_as_completed
from loadtests.overhead_matrix import (
    BARE,
    HEADROOM,
    HEADROOM_DIRECT,
    OUR_CLIENT,
    VLLM_BENCH,
    VLLM_BENCH_OPEN,
    WARMUP_SEED,
    aggregate,
    cell_seed,
    cpu_per_token,
    identity_flags,
    next_round,
    parse_counts,
    parse_rates,
    prompt_count,
    targets,
)
from loadtests.overhead_report import markdown
from loadtests.overhead_servers import (
    BareVllm,
    HeadroomServer,
    Server,
    ServerProcesses,
    add_compile_cache_argument,
    app_name_for,
    cpu_seconds,
    parse_variant,
    set_compile_cache,
)
from loadtests.vllm_bench import WORKLOADS, Workload
from serve_app.config import load_config_files
from serve_app.models.resolve import resolve_models
from serve_app.planning.from_config import cluster_spec, plan_config
from serve_app.serving.engine_args import PlannedEngine, vllm_cli_args
from serve_app.serving.serve_options import SERVE_CLUSTER_ENV

BARE_PORT, HEADROOM_PORT, HEADROOM_METRICS_PORT = 8310, 8311, 8312
ENGINE_TIMING_WAIT_S = 60.0  # Ray exports a replica's metrics every 10 s by default


@functools.cache
def versions() -> dict[str, str]:
    import ray
    import vllm

    return {"vllm": vllm.__version__, "ray": ray.__version__, "python": platform.python_version()}


def clear_earlier_run(out: Path, raw: Path) -> None:
    """Removes what an earlier run left in `out` that this run writes again: its server and client logs
    (appended to within a run, where servers restart) and raw results (a cell this run lacks would stay)."""
    raw.mkdir(parents=True, exist_ok=True)
    for path in [
        *raw.glob("*.json"),
        out / "vllm_serve.log",
        out / "headroom_serve.log",
        *out.glob("client-*.log"),
    ]:
        path.unlink(missing_ok=True)


@dataclass(frozen=True)
class Target:
    """A server under test: bare vLLM, headroom, a headroom variant (an app at /NAME), or headroom's
    replica on its own port (direct: the same replica and engine, without HAProxy in front)."""

    name: str
    server: Server
    route: str = ""
    direct: bool = False
    turnaround_ms: float = 0.0  # the client's wait before each request (--bare-turnaround-ms)

    @property
    def base_url(self) -> str:
        if self.direct:
            assert isinstance(self.server, HeadroomServer)
            return self.server.replica_url(self.route)
        return self.server.base_url + self.route

    @property
    def engine(self) -> str:
        """The engine behind it (a direct target shares its app's): its timing counts are per engine."""
        return self.server.name + self.route

    @property
    def second_door(self) -> str:
        """Its name where it loads an engine that another target loads too (else ''): its prompts'
        seed (overhead_matrix.cell_seed)."""
        return self.name if self.direct or self.turnaround_ms else ""

    def processes(self) -> ServerProcesses:
        if isinstance(self.server, HeadroomServer):
            return self.server.processes(self.route, with_ingress=not self.direct)
        return self.server.processes(self.route)


@dataclass(frozen=True)
class Cell:
    workload: Workload
    concurrency: int
    num_prompts: int


@dataclass
class Run:
    """What one run measured so far, and how it ran."""

    measurements: list[dict[str, Any]] = field(default_factory=list)
    starts: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    commands: dict[str, str] = field(default_factory=dict)
    rounds_done: int = 0


class Bench:
    """Servers, client processes and the measurements of one run (the diagnostic uses it too).

    args: config source (env/config), out, variant, gpus, concurrent, start_timeout_s, warmup_prompts,
    rounds, budget_s, ours_at, open_loop, swap_gpus, share_gpu, compile_cache."""

    def __init__(self, args: argparse.Namespace, cells: list[Cell]):
        self.args = args
        set_compile_cache(os.environ, args.compile_cache == "on")
        self.config_files = args.config or [f"configs/{args.env}.yaml"]
        self.cfg = load_config_files(*self.config_files)
        models = resolve_models(self.cfg)
        self.tokenizer = self.cfg.model.tokenizer or models.model_path
        # Both servers get the engine flags a replica gets on one GPU (the plan may lower max_num_seqs).
        configured = cluster_spec(self.cfg, gpus_per_node=1)
        self.plan = plan_config(self.cfg, configured, models.model_path, models.draft_path)
        self.flags = vllm_cli_args(
            self.cfg, models, PlannedEngine(self.plan.tensor_parallel_size, self.plan.max_num_seqs)
        )
        # The memory check predicts for the GPU this machine has, which the config may not describe.
        here, self.memory_predicted_for = cluster_here(self.cfg)
        self.memory_plan = self.plan
        if here != configured:
            self.memory_plan = plan_config(self.cfg, here, models.model_path, models.draft_path)
        # --bare-flags vllm-defaults: bare vLLM as a user would start it, with vLLM's own engine defaults.
        self.bare_flags = self.flags if args.bare_flags == "same" else identity_flags(self.flags)
        self.out: Path = args.out
        self.raw = self.out / "raw"
        clear_earlier_run(self.out, self.raw)
        self.bare = BareVllm(BARE, f"http://127.0.0.1:{BARE_PORT}", None, self.out / "vllm_serve.log")
        self.headroom = HeadroomServer(
            HEADROOM, f"http://127.0.0.1:{HEADROOM_PORT}", None, self.out / "headroom_serve.log"
        )
        self.variants = [parse_variant(v) for v in args.variant]
        self.targets = [Target(BARE, self.bare), Target(HEADROOM, self.headroom)] + [
            Target(app_name_for(f"/{name}"), self.headroom, f"/{name}") for name, _ in self.variants
        ]
        if args.direct:
            self.targets.append(Target(HEADROOM_DIRECT, self.headroom, direct=True))
        for ms in args.bare_turnaround_ms:
            self.targets.append(Target(f"{BARE}+{ms:g}ms", self.bare, turnaround_ms=ms))
        self.cells = cells
        self.clients: dict[str, ClientProcess] = {}
        self.procs: dict[str, ServerProcesses] = {}
        # The engines' timing histograms: requests sent to each engine since it started, and the last
        # reading that had counted them all (none with variants: their apps share Ray's export).
        self.engine_timing = args.engine_timing and not self.variants
        self.sent: dict[str, int] = {}
        self.totals: dict[str, Totals | None] = {}
        self.run = Run()
        self.started = time.monotonic()

    # ---- servers --------------------------------------------------------------------------------------

    def start(self, servers: list[Server], gpu: dict[str, str | None]) -> float:
        """Starts the servers on their GPUs (at once; one after another where they share one), waits until
        all answer, warms them up; seconds taken."""
        t0 = time.monotonic()
        gpus = [gpu[s.name] for s in servers if gpu[s.name] is not None]
        # Two engines on one GPU start one after another: vLLM sizes its KV cache from the memory it sees
        # used while it profiles, which would include the other engine's start-up.
        one_by_one = len(gpus) != len(set(gpus))
        for s in servers:
            s.gpu = gpu[s.name]
            if isinstance(s, BareVllm):
                s.start(self.bare_flags, BARE_PORT)
            else:
                assert isinstance(s, HeadroomServer)
                num_cpus = 8 if self.cfg.resources.accelerator == "cpu" else None  # several actors on 2 cores
                s.start(self.config_files, HEADROOM_PORT, self.args.variant, num_cpus, HEADROOM_METRICS_PORT)
            if one_by_one:
                self.wait_ready(s)
        if not one_by_one:
            for s in servers:
                self.wait_ready(s)
        live = [t for t in self.targets if t.server in servers]
        for t in live:
            self.procs[t.name] = t.processes()
        self.warm_up(live)
        return time.monotonic() - t0

    def wait_ready(self, s: Server) -> None:
        routes = [t.route for t in self.targets if t.server is s]
        ready_s = s.wait_ready(self.args.start_timeout_s, routes)
        self.run.starts.append({"server": s.name, "gpu": s.gpu, "ready_s": round(ready_s, 1)})
        print(f"{s.name} ready on GPU {s.gpu} after {ready_s:.0f} s", flush=True)

    def stop(self) -> None:
        for s in (self.bare, self.headroom):
            s.stop()

    def client(self, name: str) -> ClientProcess:
        if name not in self.clients:
            self.clients[name] = ClientProcess(name, self.out / f"client-{name}.log")
        return self.clients[name]

    def warm_up(self, live: list[Target]) -> None:
        """A few requests of each workload per server, not measured (first requests pay lazy set-up)."""
        n = self.args.warmup_prompts
        for i, w in enumerate({c.workload.name: c.workload for c in self.cells}.values()):
            for t in live:
                model, seed, name = self.cfg.served_model_name, WARMUP_SEED + i, f"warmup-{t.name}.json"
                argv = vllm_bench.bench_args(
                    t.base_url, model, self.tokenizer, w, min(4, n), n, seed, str(self.raw), name
                )
                self.client(t.name).submit({"client": VLLM_BENCH, "argv": argv})
            for _ in results_as_completed([self.client(t.name) for t in live]):
                pass
        for t in live:
            self.sent[t.engine] = 0
        for t in live:
            self.sent[t.engine] += n * len({c.workload.name for c in self.cells})
        for t in live:
            self.totals[t.engine] = self.settled_totals(t)

    def settled_totals(self, t: Target) -> Totals | None:
        """The engine's histograms once they count every request sent (Ray exports a replica's on an
        interval); None when they do not within ENGINE_TIMING_WAIT_S or cannot be read."""
        if not self.engine_timing:
            return None
        deadline = time.monotonic() + ENGINE_TIMING_WAIT_S
        while True:
            try:
                totals = t.server.engine_totals()
                if finished(totals) >= self.sent[t.engine]:
                    return totals
            except Exception as e:  # noqa: BLE001 - the timing is extra evidence; the cell still counts
                error = f"{type(e).__name__}: {e}"
            else:
                error = f"{finished(totals):.0f} of {self.sent[t.engine]} requests counted"
            if time.monotonic() > deadline:
                self.run.notes.append(f"{t.name}: engine timing not read ({error})")
                return None
            time.sleep(1)

    def engine_readings(self, t: Target, cell: Cell) -> dict[str, float | None]:
        """The engine's median timings and prefix-cache hit rate over the cell just measured on `t` (empty
        when not read)."""
        self.sent[t.engine] += cell.num_prompts
        before, after = self.totals.get(t.engine), self.settled_totals(t)
        self.totals[t.engine] = after
        if before is None or after is None:
            return {}
        return {
            **cell_quantiles_ms(before, after),
            "prefix_cache_hit_pct": cell_prefix_cache_hit_pct(before, after),
        }

    # ---- measuring ------------------------------------------------------------------------------------

    def job(self, t: Target, cell: Cell, client: str, round_index: int) -> dict[str, Any]:
        seed = cell_seed(cell.workload.name, cell.concurrency, round_index, client, t.second_door)
        w, c, n = cell.workload, cell.concurrency, cell.num_prompts
        if client == OUR_CLIENT:
            return {"client": client, "base_url": t.base_url, "model": self.cfg.served_model_name,
                    "workload": asdict(w), "concurrency": c, "num_prompts": n, "seed": seed}  # fmt: skip
        rate = self.args.open_loop[c] if client == VLLM_BENCH_OPEN else None
        loop = f"-open{rate:g}" if rate is not None else ""
        name = f"{t.name}-{w.name}-c{c}{loop}-r{round_index}.json"
        argv = vllm_bench.bench_args(
            t.base_url, self.cfg.served_model_name, self.tokenizer, w, c, n, seed, str(self.raw), name, rate
        )
        where = f"{t.name} {w.name} c={c}" + (f" open loop {rate:g}/s" if rate is not None else "")
        command = "vllm bench serve " + shlex.join(argv)
        if t.turnaround_ms:
            command += f"  (each request sent {t.turnaround_ms:g} ms after its slot frees)"
        self.run.commands.setdefault(where, command)
        return {"client": VLLM_BENCH, "argv": argv, "delay_s": t.turnaround_ms / 1000}

    def record(
        self, t: Target, cell: Cell, client: str, r: int, result: dict, cpu_s: dict[str, float]
    ) -> None:
        where = {"workload": cell.workload.name, "concurrency": cell.concurrency, "client": client}
        m = {**where, "server": t.name, "round": r, "gpu": t.server.gpu, "num_prompts": cell.num_prompts}
        m |= result | cpu_per_token(cpu_s, result.get("total_output_tokens") or 0)
        m |= self.engine_readings(t, cell)
        self.run.measurements.append(m)
        shown = ", ".join(f"{k} {m.get(k)}" for k in ("ttft_p50_ms", "tpot_p50_ms", "output_tokens_per_s"))
        print(f"round {r} {cell.workload.name} c={cell.concurrency} {client} {t.name}: {shown}", flush=True)

    def measure_cell(self, order: list[Target], cell: Cell, client: str, r: int) -> None:
        """The cell on each server: at once (each its own client process) or one after the other."""
        groups = {t.name: self.procs[t.name].groups() for t in order}
        if self.args.concurrent:
            before = {t.name: cpu_seconds(groups[t.name]) for t in order}
            for t in order:
                self.client(t.name).submit(self.job(t, cell, client, r))
            by_name = {t.name: t for t in order}
            for c, result in results_as_completed([self.client(t.name) for t in order]):
                after = cpu_seconds(groups[c.name])
                delta = {g: after[g] - before[c.name][g] for g in after}
                self.record(by_name[c.name], cell, client, r, result, delta)
            return
        for t in order:
            before = cpu_seconds(groups[t.name])
            result = self.client(t.name).run(self.job(t, cell, client, r))
            after = cpu_seconds(groups[t.name])
            self.record(t, cell, client, r, result, {g: after[g] - before[g] for g in after})

    def measure_round(self, r: int, live: list[Target]) -> None:
        for i, cell in enumerate(self.cells):
            order = live if (r + i) % 2 == 0 else live[::-1]
            clients = [VLLM_BENCH]
            if cell.concurrency in self.args.open_loop:
                clients.append(VLLM_BENCH_OPEN)
            if cell.concurrency in (self.args.ours_at or []):
                clients.append(OUR_CLIENT)
            for client in clients:
                self.measure_cell(order, cell, client, r)

    # ---- the schedule ---------------------------------------------------------------------------------

    def time_left_s(self) -> float:
        return self.args.budget_s - (time.monotonic() - self.started)

    def note_budget_stop(self, rounds_done: int, round_s: float) -> None:
        self.run.notes.append(
            f"stopped after {rounds_done} rounds: {max(self.time_left_s(), 0):.0f} s of the "
            f"{self.args.budget_s:.0f} s budget were left, and the last round took {round_s:.0f} s"
        )

    def run_pair(self) -> None:
        """Both servers up at once; a swap of GPUs between rounds when asked and the budget allows."""
        gpus = self.args.gpus or []
        assignment = 0

        def placement(a: int) -> dict[str, str | None]:
            if not gpus:
                return {BARE: None, HEADROOM: None}
            if self.args.share_gpu:
                return {BARE: gpus[0], HEADROOM: gpus[0]}
            bare = gpus[a % len(gpus)]
            return {BARE: bare, HEADROOM: ",".join(g for g in gpus if g != bare)}

        restart_s = self.start([self.bare, self.headroom], placement(assignment))
        round_s = 0.0
        for r in range(self.args.rounds):
            if r > 0:
                step = next_round(
                    self.time_left_s(), round_s, restart_s, self.args.swap_gpus and len(gpus) > 1
                )
                if step == "stop":
                    self.note_budget_stop(r, round_s)
                    return
                if step == "swap":
                    self.stop()
                    assignment += 1
                    restart_s = self.start([self.bare, self.headroom], placement(assignment))
                elif self.args.swap_gpus:
                    self.run.notes.append(f"round {r}: no GPU swap (it did not fit the time budget)")
            t0 = time.monotonic()
            self.measure_round(r, self.targets)
            round_s = time.monotonic() - t0
            self.run.rounds_done = r + 1
            self.write()

    def run_sequential(self) -> None:
        """One GPU: each round starts, measures and stops each server in turn (order alternating)."""
        gpu = self.args.gpus[0]
        round_s = 0.0
        for r in range(self.args.rounds):
            if r > 0 and next_round(self.time_left_s(), round_s, 0.0, False) == "stop":
                self.note_budget_stop(r, round_s)
                return
            t0 = time.monotonic()
            for t in self.targets if r % 2 == 0 else self.targets[::-1]:
                self.start([t.server], {t.server.name: gpu})
                self.measure_round(r, [t])
                t.server.stop()
            round_s = time.monotonic() - t0
            self.run.rounds_done = r + 1
            self.write()

    # ---- the report -----------------------------------------------------------------------------------

    def report(self) -> dict[str, Any]:
        servers = [t.name for t in self.targets]
        rows = aggregate(self.run.measurements, servers)
        return {
            "machine": describe(),
            "versions": versions(),
            "model": self.cfg.served_model_name,
            "engine_flags": self.flags,
            "bare_engine_flags": self.bare_flags,
            "layout": self.layout(),
            "variants": {app_name_for(f"/{n}"): env for n, env in self.variants},
            "serve_env": dict(SERVE_CLUSTER_ENV),
            "compile_cache": self.args.compile_cache,
            "workloads": {c.workload.name: asdict(c.workload) for c in self.cells},
            "prompts": {f"{c.workload.name} c={c.concurrency}": c.num_prompts for c in self.cells},
            "open_loop_rates": self.args.open_loop,
            "rounds_planned": self.args.rounds,
            "rounds_done": self.run.rounds_done,
            "budget_s": self.args.budget_s,
            "elapsed_s": round(time.monotonic() - self.started, 1),
            "starts": self.run.starts,
            "notes": self.run.notes,
            "command": " ".join(["python -m loadtests.bench_overhead", *map(shlex.quote, sys.argv[1:])]),
            "vllm_bench_commands": self.run.commands,
            "targets": {
                s: targets(rows, s, against_vllm_defaults=self.args.bare_flags == "vllm-defaults")
                for s in servers
                if s != BARE
            },
            "results": rows,
            "measurements": self.run.measurements,
            "memory": self.memory(),
            "memory_predicted_for": self.memory_predicted_for,
        }

    def layout(self) -> str:
        gpus = self.args.gpus or []
        if self.args.share_gpu:
            return f"both servers up at once on one GPU ({gpus[0]}), loaded one at a time, order alternating"
        if len(gpus) == 1:
            return f"one GPU ({gpus[0]}): each server started, measured and stopped in turn, every round"
        how = (
            "loaded at the same time, each from its own client"
            if self.args.concurrent
            else "loaded one at a time, order alternating"
        )
        where = (
            f"bare and headroom on GPUs {' / '.join(gpus)}"
            + (", swapped between rounds" if self.args.swap_gpus else "")
            if gpus
            else "the same CPUs"
        )
        return f"both servers up at once ({where}), {how}"

    def memory(self) -> list[dict]:
        """Each engine's logged KV tokens and weights against the plan (GPU only)."""
        if self.cfg.resources.accelerator != "gpu":
            return []
        logged = engine_logs.parse(engine_logs.read_files([self.bare.log_path]), "vllm serve")
        logged += engine_logs.parse(engine_logs.ray_session_logs(), "headroom replica")
        plan = self.memory_plan
        return engine_logs.compare_each(
            {f"TP={plan.tensor_parallel_size}": engine_logs.expected_memory(plan)}, logged
        )

    def write(self) -> None:
        report = self.report()
        (self.out / "results.json").write_text(json.dumps(report, indent=2))
        (self.out / "report.md").write_text(markdown(report))

    def close(self) -> None:
        for c in self.clients.values():
            c.close()
        self.stop()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    source = p.add_mutually_exclusive_group()
    source.add_argument("--env", default="local")
    source.add_argument("--config", nargs="+", help="config file(s) instead of an environment")
    p.add_argument(
        "--workloads", nargs="+", choices=sorted(WORKLOADS), default=["random-1024", "short", "shared-prefix"]
    )
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 64, 128, 256])
    p.add_argument(
        "--num-prompts", default="", help="C:N,... prompts per cell at concurrency C (else --waves)"
    )
    p.add_argument("--waves", type=int, default=5, help="prompts = waves x concurrency where not given")
    p.add_argument("--min-prompts", type=int, default=30)
    p.add_argument("--output-len", type=int, help="output tokens per request (default: the workload's 128)")
    p.add_argument(
        "--ours-at", type=int, nargs="*", default=[1], help="concurrencies where our client runs too"
    )
    p.add_argument(
        "--open-loop",
        type=_rates,
        default={},
        help="C:RATE,...: beside the closed loop at concurrency C, an open loop of the same prompt count "
        "(Poisson arrivals at RATE requests/s, at most C in flight; the same arrivals for every server)",
    )
    p.add_argument("--rounds", type=int, default=3, help="alternations per server")
    p.add_argument("--warmup-prompts", type=int, default=8)
    p.add_argument(
        "--gpus", nargs="+", help="GPU ids: two = side by side; one = one after another (or --share-gpu)"
    )
    p.add_argument("--swap-gpus", action="store_true", help="swap the two servers' GPUs between rounds")
    p.add_argument(
        "--share-gpu", action="store_true", help="one GPU: both servers up on it at once, loaded in turn"
    )
    p.add_argument("--concurrent", action="store_true", help="load both servers at once (own GPUs only)")
    p.add_argument(
        "--variant",
        action="append",
        default=[],
        help="NAME:ENV=VALUE,... a headroom app with that replica env",
    )
    p.add_argument(
        "--direct",
        action="store_true",
        help=f"also load headroom's replica on its own HTTP port, skipping HAProxy ('{HEADROOM_DIRECT}')",
    )
    p.add_argument(
        "--bare-turnaround-ms",
        type=_positive_ms,
        nargs="+",
        default=[],
        help="also load bare vLLM with each request sent MS ms after its slot frees ('vllm+MSms')",
    )
    p.add_argument(
        "--bare-flags",
        choices=["same", "vllm-defaults"],
        default="same",
        help="bare vLLM's engine flags: the replicas' (same) or only the model's identity (vLLM's defaults)",
    )
    p.add_argument(
        "--budget-s", type=float, default=3600, help="no new round starts that would not end within it"
    )
    p.add_argument(
        "--engine-timing",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="read the engines' TTFT and prefix-cache hits and the replica's loop lag around each cell "
        "(headroom's wait for Ray's export)",
    )
    add_compile_cache_argument(p)
    p.add_argument("--start-timeout-s", type=float, default=900)
    p.add_argument("--out", type=Path, default=Path("results/bench_overhead"))
    args = p.parse_args(argv)
    _check_layout(p, args)
    return args


def _rates(text: str) -> dict[int, float]:
    try:
        return parse_rates(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _positive_ms(text: str) -> float:
    try:
        ms = float(text)
    except ValueError:
        ms = -1.0
    if not 0 < ms <= 10_000:
        raise argparse.ArgumentTypeError(f"{text!r}: a wait in milliseconds, above 0 and at most 10000")
    return ms


def _check_layout(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.concurrent and len(args.gpus or []) < 2:
        p.error("--concurrent needs --gpus with two GPUs: servers that share a device would slow each other")
    if args.share_gpu and (len(args.gpus or []) != 1 or args.swap_gpus):
        p.error("--share-gpu needs --gpus with one GPU, and no --swap-gpus")
    if args.direct and (args.concurrent or (len(args.gpus or []) == 1 and not args.share_gpu)):
        p.error(
            "--direct loads headroom's one engine through two doors in turn: not with --concurrent, and "
            "on one GPU only with --share-gpu"
        )
    if args.variant and len(args.gpus or []) == 1:
        p.error("--variant needs a GPU of its own for each app, or the CPU build (no --gpus)")


def matrix(args: argparse.Namespace) -> list[Cell]:
    counts = parse_counts(args.num_prompts)
    return [
        Cell(
            WORKLOADS[w].with_output_len(args.output_len),
            c,
            prompt_count(c, counts, args.waves, args.min_prompts),
        )
        for w in args.workloads
        for c in args.concurrency
    ]


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def stop_on_sigterm() -> None:
    """SIGTERM (a time limit, a CI runner) ends a run like Ctrl-C, so the servers are stopped either way."""
    signal.signal(signal.SIGTERM, _interrupt)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    bench = Bench(args, matrix(args))
    stop_on_sigterm()
    try:
        if len(args.gpus or []) == 1 and not args.share_gpu:
            bench.run_sequential()
        else:
            bench.run_pair()
    finally:
        bench.close()
        if bench.run.measurements:
            bench.write()
    print((args.out / "report.md").read_text())
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
