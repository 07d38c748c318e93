"""The two servers the overhead benchmark and its diagnostic compare, each started as its own process group.

- `BareVllm`: `vllm serve` (vLLM's OpenAI API server module) with the flags a headroom replica's engine gets.
- `HeadroomServer`: a local Ray cluster with headroom's cluster settings (SERVE_CLUSTER_ENV) and the
  config's Serve application, run by this module's `headroom` command in a child process; extra apps
  ("variants") in the same cluster get their replicas' environment changed, so a candidate fix is
  measured side by side with the default in one run.

Each server runs in a new session and is stopped as a whole (SIGTERM, then SIGKILL to its process group,
then any engine process still alive), also when the caller fails or is interrupted. The GPU a server
uses is its CUDA_VISIBLE_DEVICES. `ServerProcesses` splits a server's processes into the HTTP side
("frontend": the API server, or replica + HAProxy + Serve proxies) and the engine (the frontend's
children), for CPU accounting.

    python -m loadtests.overhead_servers headroom --config A.yaml B.yaml --port 8311 --metrics-port 8312 \
        [--variant NAME:KEY=VALUE,KEY=VALUE ...]     (the child; the benchmarks start it)
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

from loadtests.engine_timing import LOOP_PROBE_INTERVAL_S, Totals, histogram_totals

INGRESS_TITLES = ("ray::ProxyActor", "ray::HAProxyManager")
# Where Ray Serve's direct ingress gives each replica its own HTTP port (Ray's defaults, overridable there).
DIRECT_HTTP_PORTS = range(
    int(os.environ.get("RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT", "30000")),
    int(os.environ.get("RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT", "31000")),
)


# vLLM's switch for its torch.compile cache (vllm/envs.py; in 0.26-0.33 it gates the AOT artifacts too).
COMPILE_CACHE_OFF_ENV = "VLLM_DISABLE_COMPILE_CACHE"
COMPILE_CACHE_HELP = (
    "vLLM's torch.compile cache for every engine started: 'off' (the default) makes each compile its own "
    "graphs, so no engine runs graphs loaded from the cache an earlier engine wrote while the other runs "
    "freshly compiled ones (until 2026-12-05 bare vLLM, started first, mostly compiled and headroom's "
    "engine loaded: results/gpu/compile_audit.md); 'on' is vLLM's default (faster restarts)"
)


def add_compile_cache_argument(p: argparse.ArgumentParser) -> None:
    """`--compile-cache off|on` (default off), for each command that starts both servers."""
    p.add_argument("--compile-cache", choices=["off", "on"], default="off", help=COMPILE_CACHE_HELP)


def set_compile_cache(environ: dict[str, str] | os._Environ[str], on: bool) -> None:
    """Every server started from this process (and its Ray cluster) inherits `environ`."""
    if on:
        environ.pop(COMPILE_CACHE_OFF_ENV, None)
    else:
        environ[COMPILE_CACHE_OFF_ENV] = "1"


def wait_ready(url: str, proc: subprocess.Popen, timeout_s: float) -> None:
    """Polls `url` (a server's /v1/models) until it answers 200; fails early when the process exits."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server process exited with {proc.returncode} before {url} answered")
        try:
            if httpx.get(url, timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise TimeoutError(f"{url} not ready after {timeout_s:.0f}s")


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _title(proc: psutil.Process) -> str:
    try:
        return " ".join(proc.cmdline()) or proc.name()
    except psutil.Error:
        return ""


def descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


@dataclass
class ServerProcesses:
    """One server's processes: the HTTP side and the engine side, and of the HTTP side the part in front of
    the replica (HAProxy and Serve's proxies; none for `vllm serve` or a client at the replica's port)."""

    frontend: list[psutil.Process]
    engine: list[psutil.Process]
    ingress: list[psutil.Process] = field(default_factory=list)

    def groups(self) -> dict[str, list[psutil.Process]]:
        """CPU accounting groups; "ingress" (a part of "frontend") only where there is one."""
        groups = {"frontend": self.frontend, "engine": self.engine}
        return groups | ({"ingress": self.ingress} if self.ingress else {})

    def engine_cores(self) -> list[psutil.Process]:
        """The engine's main processes (vLLM's EngineCore), without helpers such as compile workers."""
        cores = [p for p in self.engine if "EngineCore" in _title(p)]
        return cores or self.engine[:1]


def process_cpu_s(procs: list[psutil.Process]) -> dict[int, float]:
    """{pid: user + system CPU seconds so far} of the processes still running."""
    out = {}
    for p in procs:
        with contextlib.suppress(psutil.Error):
            t = p.cpu_times()
            out[p.pid] = t.user + t.system
    return out


def cpu_seconds(groups: dict[str, list[psutil.Process]]) -> dict[str, float]:
    """User + system CPU seconds used so far by each group (processes that ended count 0)."""
    return {name: sum(process_cpu_s(procs).values()) for name, procs in groups.items()}


@dataclass
class Server:
    """A server process group started by this module; `stop()` ends all of it."""

    name: str
    base_url: str
    gpu: str | None
    log_path: Path
    proc: subprocess.Popen | None = None
    started_s: float = 0.0
    ready_s: float | None = None
    _known: list[psutil.Process] = field(default_factory=list)

    def _popen(self, cmd: list[str], env: dict[str, str]) -> None:
        if self.gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = self.gpu
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "a") as log:
            self.proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        self.started_s = time.monotonic()

    def wait_ready(self, timeout_s: float, routes: list[str] | None = None) -> float:
        assert self.proc is not None
        for route in routes or [""]:
            wait_ready(f"{self.base_url}{route}/v1/models", self.proc, timeout_s)
        self.ready_s = time.monotonic() - self.started_s
        self._known = descendants(self.proc.pid)
        return self.ready_s

    def stop(self, timeout_s: float = 60) -> None:
        """SIGTERM (the child shuts its cluster down), then SIGKILL to the group, then leftovers."""
        if self.proc is None:
            return
        known = self._known + descendants(self.proc.pid)
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=timeout_s)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        # Ray's daemons and vLLM's engine may have left the group; only processes this server started.
        for p in known:
            if _alive(p):
                with contextlib.suppress(psutil.Error):
                    p.kill()
        self.proc = None

    @property
    def metrics_url(self) -> str:
        """Where the engine's Prometheus metrics are read."""
        raise NotImplementedError

    def engine_totals(self) -> Totals:
        """The engine's timing histograms and prefix-cache counters now (loadtests/engine_timing.py)."""
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(self.metrics_url, timeout=10).text
        return histogram_totals(
            (s.name, s.labels, s.value)
            for family in text_string_to_metric_families(text)
            for s in family.samples
        )


class BareVllm(Server):
    """Bare `vllm serve` with the given engine flags."""

    def start(self, flags: list[str], port: int) -> None:
        module = "vllm.entrypoints.openai.api_server"
        cmd = [sys.executable, "-m", module, *flags, "--host", "127.0.0.1", "--port", str(port)]
        self._popen(cmd, dict(os.environ))

    @property
    def metrics_url(self) -> str:
        return f"{self.base_url}/metrics"

    def processes(self, route: str = "") -> ServerProcesses:
        assert self.proc is not None
        api = psutil.Process(self.proc.pid)
        return ServerProcesses(frontend=[api], engine=api.children(recursive=True))


class HeadroomServer(Server):
    """headroom's Serve application on its own local Ray cluster (this module's `headroom` command); the
    engines' metrics are read where Ray exports them (the node's metrics port, every app's replicas)."""

    metrics_port: int = 0

    def start(
        self, config: list[str], port: int, variants: list[str], num_cpus: int | None, metrics_port: int
    ) -> None:
        self.metrics_port = metrics_port
        cmd = [sys.executable, "-m", "loadtests.overhead_servers", "headroom", "--config", *config]
        cmd += ["--port", str(port), "--metrics-port", str(metrics_port)]
        if num_cpus is not None:
            cmd += ["--num-cpus", str(num_cpus)]
        for variant in variants:
            cmd += ["--variant", variant]
        self._popen(cmd, dict(os.environ))

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def _replicas(self, route: str, tree: list[psutil.Process] | None = None) -> list[psutil.Process]:
        assert self.proc is not None
        app = app_name_for(route)
        tree = descendants(self.proc.pid) if tree is None else tree
        return [p for p in tree if _title(p).startswith(f"ray::ServeReplica:{app}:")]

    def processes(self, route: str = "", with_ingress: bool = True) -> ServerProcesses:
        """The replica of the app at `route` ("" = the default app) with the cluster's ingress (unless
        not asked for), and the replica's engine. HAProxy and the Serve proxies serve every app."""
        assert self.proc is not None
        tree = descendants(self.proc.pid)
        replicas = self._replicas(route, tree)
        ingress = [
            p for p in tree if "haproxy" in _title(p).split(" ")[0] or _title(p).startswith(INGRESS_TITLES)
        ]
        engine = [child for r in replicas for child in r.children(recursive=True)]
        if not with_ingress:
            ingress = []
        return ServerProcesses(frontend=replicas + ingress, engine=engine, ingress=ingress)

    def replica_url(self, route: str = "") -> str:
        """The HTTP address of the (one) replica of the app at `route` itself: the port Serve's direct
        ingress gave it, which HAProxy forwards to; a client there skips HAProxy."""
        ports = sorted(
            c.laddr.port
            for r in self._replicas(route)
            for c in r.net_connections(kind="tcp")
            if c.status == psutil.CONN_LISTEN and c.laddr.port in DIRECT_HTTP_PORTS
        )
        if len(ports) != 1:
            raise RuntimeError(f"expected one replica HTTP port in {DIRECT_HTTP_PORTS}, found {ports}")
        return f"http://127.0.0.1:{ports[0]}{route}"


APP_NAME = "headroom"


def app_name_for(route: str) -> str:
    """The Serve app name of a variant route ("/fast" -> "headroom-fast"; "" -> "headroom")."""
    return APP_NAME if not route else f"{APP_NAME}-{route.strip('/')}"


def parse_variant(text: str) -> tuple[str, dict[str, str]]:
    """'NAME:KEY=VALUE,KEY=VALUE' -> (NAME, {KEY: VALUE}); a value may be empty ('KEY=' sets it empty)."""
    name, _, assignments = text.partition(":")
    if not name or not name.replace("-", "").isalnum():
        raise ValueError(f"variant {text!r}: expected NAME:KEY=VALUE[,KEY=VALUE], NAME letters/digits/-")
    env = {}
    for item in filter(None, assignments.split(",")):
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise ValueError(f"variant {text!r}: {item!r} is not KEY=VALUE")
        env[key] = value
    return name, env


def _serve_headroom(args: argparse.Namespace) -> None:
    """The child: a local cluster, the default app at / and each variant at /NAME, until SIGTERM."""
    import ray
    from ray import serve
    from ray.serve import Application

    from serve_app.config import load_config_files
    from serve_app.planning.from_config import cluster_spec
    from serve_app.serving.deployment import build_from_config
    from serve_app.serving.driver import init_ray_driver
    from serve_app.serving.serve_options import apply_cluster_env

    stop = []
    cfg = load_config_files(*args.config)
    cluster = cluster_spec(cfg, gpus_per_node=1)
    apply_cluster_env(os.environ)
    # Serve's probe of each replica's event loop, often enough to see a cell's lag (engine_timing.py).
    os.environ.setdefault("RAY_SERVE_EVENT_LOOP_MONITORING_INTERVAL_S", str(LOOP_PROBE_INTERVAL_S))
    # Logs stay in Ray's files (this process is not the load generator, but keeps quiet all the same).
    # address="local": a new cluster, never one that `ray start` left running on this machine.
    init_ray_driver(
        address="local",
        num_cpus=args.num_cpus,
        _metrics_export_port=args.metrics_port,
        logging_level="WARNING",
        log_to_driver=False,
        include_dashboard=False,
    )
    # After ray.init, whose failure-signal handler would abort on SIGTERM without shutting the cluster down.
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": args.port})
        apps = [("", {})] + [(f"/{n}", env) for n, env in map(parse_variant, args.variant)]
        for route, env in apps:
            app = build_from_config(cfg, cluster)
            if env:  # the replicas' environment, for this app only (Serve keeps the bound arguments)
                deployment = app._bound_deployment
                actor = dict(deployment.ray_actor_options or {})
                actor["runtime_env"] = {"env_vars": env}
                app = Application(deployment.options(ray_actor_options=actor))
            serve.run(app, name=app_name_for(route), route_prefix=route or "/", blocking=False)
        print("headroom: serving", flush=True)
        while not stop:
            time.sleep(0.5)
    finally:
        serve.shutdown()
        ray.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    hr = sub.add_parser("headroom", help="run headroom's app on a local Ray cluster until SIGTERM")
    hr.add_argument("--config", nargs="+", required=True)
    hr.add_argument("--port", type=int, required=True)
    hr.add_argument("--num-cpus", type=int)
    hr.add_argument("--metrics-port", type=int, required=True, help="Ray's metrics export port")
    hr.add_argument("--variant", action="append", default=[], help="NAME:KEY=VALUE,... (repeatable)")
    args = parser.parse_args()
    _serve_headroom(args)


if __name__ == "__main__":
    main()
