"""`headroom rollout` end to end on a real Ray cluster with the real vLLM CPU engine.

The test starts its own cluster with `ray start` (the production cluster settings, SERVE_CLUSTER_ENV, in its
environment; free ports, and HAProxy's files and Serve's fixed ports moved, so it shares nothing with other
clusters on the machine) and deploys through the dashboard's REST API, as `serve deploy` does:
- version A (configs/local.yaml + configs/rollout.yaml) rolls out and passes its smoke gate;
- version B changes an engine setting (max_num_seqs): Serve's rolling update replaces the replica (a new
  one starts before the old one stops) while a background thread sends requests; none fails;
- version C sets an SLO no engine meets (TTFT p95 <= 0.001 ms): its smoke gate fails, it is rolled back to
  B automatically, and B serves throughout and after.

The cluster runs with Ray's token authentication (RAY_AUTH_MODE=token), so every call above carries the
token; a second test runs `headroom status` and `headroom rollout` as a user would, without the token (refused
with exit 2, naming what to set) and with it, and finds the token in no output, rendered config, history or
Ray log. After the first test it rolls out the config already running (version B), which takes seconds; on
its own it deploys B as a new app.

`ray stop` stops every Ray cluster on the machine, so the test stops only its own, by process id: it makes
itself the subreaper of what `ray start` leaves behind, and at the end stops its new descendants (SIGTERM,
then SIGKILL after a grace period), the engine processes included.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil
import pytest

from loadtests.smoke import run_smoke_load
from serve_app.config import DEFAULT_CONFIG_DIR, ConfigError
from serve_app.rollout import SmokeOptions, dashboard_auth_headers, read_history, rollout, status
from serve_app.serving.serve_options import apply_cluster_env

pytestmark = pytest.mark.integration

HERE = Path(__file__).parent
REPO = HERE.parents[1]
VERSION_A = [
    DEFAULT_CONFIG_DIR / "base.yaml",
    DEFAULT_CONFIG_DIR / "local.yaml",
    HERE / "configs" / "rollout.yaml",
]
ENGINE_CHANGE = "engine: {max_num_seqs: 16}\n"  # version B's overlay on version A
MODEL = "tiny-qwen3-rollout"
SMOKE = SmokeOptions(users=2, duration_s=10, max_tokens=16)
RAY_AUTH_VARS = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class RayCluster:
    dashboard: str
    http_port: int
    state_dir: Path
    root: Path
    token: str

    @property
    def app_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}/rollout"


def _set_child_subreaper(on: bool) -> None:
    """prctl(PR_SET_CHILD_SUBREAPER): the daemons `ray start` leaves behind become this process's children
    (not init's), so the cluster's processes are exactly our new descendants."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(36, int(on), 0, 0, 0)


def _cluster_processes(before: set[int], root: Path) -> list[psutil.Process]:
    """Descendants of the children this process gained since `before`, plus anything holding files under
    the cluster's temp dir (in case one was reparented elsewhere)."""
    me = psutil.Process()
    found: dict[int, psutil.Process] = {}
    for child in me.children():
        if child.pid in before:
            continue
        with contextlib.suppress(psutil.Error):
            for proc in [child, *child.children(recursive=True)]:
                found[proc.pid] = proc
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if proc.pid != me.pid and any(f.path.startswith(str(root)) for f in proc.open_files()):
                found[proc.pid] = proc
    return list(found.values())


def _stop(procs: list[psutil.Process], grace_s: float = 15) -> None:
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            proc.send_signal(signal.SIGTERM)
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    for proc in alive:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    psutil.wait_procs(alive, timeout=10)


@contextlib.contextmanager
def token_auth_client(root: Path) -> Iterator[str]:
    """This process as a client of Ray's token authentication; yields the token it sends, which the test
    cluster is started with. A process already in token mode keeps its token: a `ray.init()` earlier in the
    session turned it on (with ~/.ray/auth_token), and its Ray driver shares Ray's token loader. Otherwise
    token mode is turned on with a new token for this module, and off again after."""
    from ray._private.authentication.authentication_token_generator import generate_new_authentication_token
    from ray._private.authentication.authentication_utils import is_token_auth_enabled
    from ray._private.authentication_test_utils import reset_auth_token_state
    from ray._raylet import AuthenticationTokenLoader

    if is_token_auth_enabled():
        yield AuthenticationTokenLoader.instance().get_raw_token()
        return
    token_file = root / "auth_token"
    token_file.write_text(generate_new_authentication_token())
    with pytest.MonkeyPatch.context() as env:
        env.delenv("RAY_AUTH_TOKEN", raising=False)
        env.setenv("RAY_AUTH_MODE", "token")
        env.setenv("RAY_AUTH_TOKEN_PATH", str(token_file))
        reset_auth_token_state()
        try:
            yield token_file.read_text()
        finally:
            env.undo()
            reset_auth_token_state()


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RayCluster]:
    root = Path(tempfile.mkdtemp(prefix="hr-", dir="/tmp"))  # short: Unix socket paths live under it
    # The cluster's Ray logs (Serve's controller and replicas, the engines' output) outlive it here, where
    # pytest keeps its last three runs: the evidence when a rollout is slow or fails.
    kept_logs = tmp_path_factory.mktemp("rollout-ray-logs")
    with token_auth_client(root) as token:
        yield from _start_cluster(root, token, kept_logs)


def _start_cluster(root: Path, token: str, kept_logs: Path) -> Iterator[RayCluster]:
    from ray.dashboard.modules.serve.sdk import ServeSubmissionClient

    ports = {
        name: free_port()
        for name in (
            "gcs",
            "dashboard",
            "metrics",
            "client",
            "agent",
            "agent_grpc",
            "runtime_env",
            "node_manager",
            "object_manager",
            "http",
            "haproxy_stats",
            "haproxy_metrics",
            "fallback_http",
            "fallback_grpc",
        )
    }
    # 100-port windows away from Serve's defaults (30000-31000, 40000-41000) that other clusters use.
    replica_http, replica_grpc = random.randrange(31000, 32600, 100), random.randrange(41000, 42900, 100)
    token_file = root / "cluster_token"
    token_file.write_text(token)
    env = {k: v for k, v in os.environ.items() if k not in RAY_AUTH_VARS}
    apply_cluster_env(env)
    env.update(
        {
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN_PATH": str(token_file),
            "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p),
            "RAY_SERVE_HAPROXY_CONFIG_FILE_LOC": str(root / "haproxy" / "haproxy.cfg"),
            "RAY_SERVE_HAPROXY_SOCKET_PATH": str(root / "haproxy" / "admin.sock"),
            "RAY_SERVE_HAPROXY_SERVER_STATE_BASE": str(root / "haproxy"),
            "RAY_SERVE_HAPROXY_SERVER_STATE_FILE": str(root / "haproxy" / "server-state"),
            "RAY_SERVE_HAPROXY_METRICS_SOCKET_PATH": str(root / "haproxy" / "metrics.sock"),
            "RAY_SERVE_HAPROXY_STATS_PORT": str(ports["haproxy_stats"]),
            "RAY_SERVE_HAPROXY_METRICS_PORT": str(ports["haproxy_metrics"]),
            # Serve's Python proxy (HAProxy's fallback while an app has no running replica) and the replicas'
            # own HTTP/gRPC servers bind with SO_REUSEPORT on fixed defaults (8500, 9500, 30000+, 40000+):
            # another cluster on this machine would share those sockets, and answer some of our requests.
            "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT": str(ports["fallback_http"]),
            "RAY_SERVE_FALLBACK_PROXY_GRPC_PORT": str(ports["fallback_grpc"]),
            "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(replica_http),
            "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(replica_http + 99),
            "RAY_SERVE_DIRECT_INGRESS_MIN_GRPC_PORT": str(replica_grpc),
            "RAY_SERVE_DIRECT_INGRESS_MAX_GRPC_PORT": str(replica_grpc + 99),
        }
    )
    ray_bin = str(Path(sys.executable).parent / "ray")
    cmd = [
        ray_bin, "start", "--head", "--disable-usage-stats", "--num-cpus", "8",
        "--port", str(ports["gcs"]),
        "--dashboard-host", "127.0.0.1", "--dashboard-port", str(ports["dashboard"]),
        "--metrics-export-port", str(ports["metrics"]),
        "--ray-client-server-port", str(ports["client"]),
        "--dashboard-agent-listen-port", str(ports["agent"]),
        "--dashboard-agent-grpc-port", str(ports["agent_grpc"]),
        "--runtime-env-agent-port", str(ports["runtime_env"]),
        "--node-manager-port", str(ports["node_manager"]),
        "--object-manager-port", str(ports["object_manager"]),
        "--temp-dir", str(root / "ray"),
    ]  # fmt: skip
    dashboard = f"http://127.0.0.1:{ports['dashboard']}"
    t0 = time.monotonic()
    before = {p.pid for p in psutil.Process().children()}
    _set_child_subreaper(True)
    try:
        subprocess.run(cmd, env=env, check=True, timeout=180, capture_output=True, text=True)
        deadline = time.monotonic() + 120
        while True:
            try:
                headers = dashboard_auth_headers()
                if httpx.get(f"{dashboard}/api/ray/version", headers=headers, timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the dashboard did not come up"
            time.sleep(1)
        # Start Serve on a free port (an empty declarative config through the REST API).
        ServeSubmissionClient(dashboard, headers=dashboard_auth_headers()).deploy_applications(
            {"http_options": {"host": "127.0.0.1", "port": ports["http"]}, "applications": []}
        )
        print(f"\ncluster up in {time.monotonic() - t0:.1f} s: dashboard {dashboard}, http {ports['http']}")
        yield RayCluster(dashboard, ports["http"], root / "state", root, token)
    finally:
        # Every process of this cluster, engine processes included: no need to drain the apps first.
        t1 = time.monotonic()
        _stop(_cluster_processes(before, root))
        _set_child_subreaper(False)
        logs = root / "ray" / "session_latest" / "logs"
        if logs.is_dir():
            shutil.copytree(logs, kept_logs, dirs_exist_ok=True)
        shutil.rmtree(root, ignore_errors=True)
        print(f"cluster stopped in {time.monotonic() - t1:.1f} s; its Ray logs: {kept_logs}")


@dataclass
class Traffic:
    """Requests sent back to back from a background thread; every answer is counted."""

    url: str
    ok: int = 0
    failures: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __enter__(self) -> Traffic:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        assert self._thread is not None
        self._thread.join(timeout=120)

    def _run(self) -> None:
        body = {"model": MODEL, "prompt": "the rollout goes on", "max_tokens": 8, "ignore_eos": True}
        with httpx.Client(timeout=60) as client:
            while not self._stop.is_set():
                try:
                    response = client.post(f"{self.url}/v1/completions", json=body)
                    if response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 8:
                        self.ok += 1
                    else:
                        self.failures.append(f"{response.status_code}: {response.text[:300]}")
                except (httpx.HTTPError, ValueError, KeyError) as e:
                    self.failures.append(f"{type(e).__name__}: {e}")
                time.sleep(0.05)  # continuous, but leaves the 2-core box some CPU for the starting engine


def _live(cluster: RayCluster) -> dict:
    return _details(cluster)["applications"]["rollout"]


def _details(cluster: RayCluster) -> dict:
    from ray.dashboard.modules.serve.sdk import ServeSubmissionClient

    return ServeSubmissionClient(cluster.dashboard, headers=dashboard_auth_headers()).get_serve_details()


def _replica_ids(cluster: RayCluster) -> set[str]:
    return {r["replica_id"] for r in _live(cluster)["deployments"]["LLMServer"]["replicas"]}


def _overlay(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_rollout_update_under_traffic_and_automatic_rollback(ray_cluster: RayCluster, tmp_path: Path):
    cluster = ray_cluster
    times: dict[str, float] = {}

    def run(files: list[Path], **kwargs):
        return rollout(
            config_files=files,
            address=cluster.dashboard,
            state=cluster.state_dir,
            smoke=SMOKE,
            smoke_runner=run_smoke_load,
            # Alone on this 2-core box A, B and C were ready in 53, 98 and 121 s; in a full `make test`
            # (the session cluster's engines beside it) C once took longer than 240 s. `headroom rollout`
            # itself waits 900 s by default.
            ready_timeout_s=480,
            poll_s=1,
            **kwargs,
        )

    # A: a new application.
    t = time.monotonic()
    a = run(VERSION_A)
    times["A"] = time.monotonic() - t
    assert a.outcome == "succeeded", a.message
    assert a.update.startswith("new application")
    assert a.gate is not None and a.gate.passed and a.gate.numbers["ok"] > 0
    assert httpx.get(f"{cluster.app_url}/v1/models", timeout=10).json()["data"][0]["id"] == MODEL
    replicas_a = _replica_ids(cluster)

    # B: an engine setting changes; the replica rolls over while requests keep coming.
    files_b = [*VERSION_A, _overlay(tmp_path / "b.yaml", ENGINE_CHANGE)]
    t = time.monotonic()
    with Traffic(cluster.app_url) as traffic_b:
        time.sleep(2)
        b = run(files_b)
        time.sleep(2)
    times["B"] = time.monotonic() - t
    assert b.outcome == "succeeded", b.message
    assert b.update.startswith("in-place update")
    assert traffic_b.failures == [], (
        f"{len(traffic_b.failures)} of {traffic_b.ok + len(traffic_b.failures)} failed"
    )
    assert traffic_b.ok >= 20
    live = _live(cluster)
    assert live["deployed_app_config"]["args"]["config"]["engine"]["max_num_seqs"] == 16
    assert live["deployed_app_config"]["args"]["headroom"]["config_hash"] == b.config_hash != a.config_hash
    assert _replica_ids(cluster).isdisjoint(replicas_a), "the engine change did not replace the replica"

    # A bad input against the live cluster fails before anything is deployed.
    with pytest.raises(ConfigError, match="unknown environment"):
        rollout(env="nope", address=cluster.dashboard, state=cluster.state_dir)

    # C: a dry run changes nothing; the real rollout fails its smoke gate and is rolled back to B.
    files_c = [*files_b, _overlay(tmp_path / "c.yaml", "slo: {ttft_p95_ms: 0.001}\n")]
    dry = run(files_c, dry_run=True)
    assert dry.outcome == "dry_run" and dry.previous_hash == b.config_hash
    assert _live(cluster)["deployed_app_config"]["args"]["headroom"]["config_hash"] == b.config_hash
    t = time.monotonic()
    with Traffic(cluster.app_url) as traffic_c:
        c = run(files_c)
        time.sleep(2)
    times["C"] = time.monotonic() - t
    assert c.outcome == "rolled_back", c.message
    assert c.gate is not None and not c.gate.passed
    assert any("TTFT p95" in reason for reason in c.gate.reasons)
    assert traffic_c.failures == [], (
        f"{len(traffic_c.failures)} of {traffic_c.ok + len(traffic_c.failures)} failed"
    )
    live = _live(cluster)
    assert live["status"] == "RUNNING"
    assert live["deployed_app_config"]["args"]["headroom"]["config_hash"] == b.config_hash
    answer = httpx.post(
        f"{cluster.app_url}/v1/completions",
        json={"model": MODEL, "prompt": "still here", "max_tokens": 4},
        timeout=60,
    )
    assert answer.status_code == 200

    # History: every rendered config kept, outcomes and numbers recorded; status reports both.
    history = read_history(cluster.state_dir, "rollout")
    assert [h["outcome"] for h in history] == ["succeeded", "succeeded", "rolled_back"]
    assert all(Path(h["rendered"]).is_file() for h in history)
    assert history[2]["previous_rendered"] == history[1]["rendered"]
    assert history[2]["smoke"]["ttft_p95_ms"] > 0.001
    st = status(cluster.dashboard, cluster.state_dir)
    (app,) = [x for x in st["applications"] if x["name"] == "rollout"]
    assert app["config_hash"] == b.config_hash and app["status"] == "RUNNING"
    assert st["last_rollouts"]["rollout"]["outcome"] == "rolled_back"

    print(
        f"\nA {times['A']:.0f} s ({a.timings_s})\nB {times['B']:.0f} s ({b.timings_s}; {traffic_b.ok} "
        f"requests during the update, 0 failed)\nC {times['C']:.0f} s ({c.timings_s}; {traffic_c.ok} "
        "requests, 0 failed)"
    )


def headroom(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """`headroom ARGS` as a user runs it, in its own process, with Ray's auth variables only as given."""
    base = {k: v for k, v in os.environ.items() if k not in RAY_AUTH_VARS}
    base["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), base.get("PYTHONPATH")) if p)
    cmd = [sys.executable, "-m", "serve_app.cli.commands", *args]
    return subprocess.run(cmd, env={**base, **env}, cwd=REPO, capture_output=True, text=True, timeout=600)


def _deployed_configs(cluster: RayCluster) -> dict[str, dict]:
    return {name: app["deployed_app_config"] for name, app in _details(cluster)["applications"].items()}


def test_cli_needs_the_ray_token_and_never_shows_it(ray_cluster: RayCluster, tmp_path: Path):
    cluster = ray_cluster
    token_file = tmp_path / "token"
    token_file.write_text(cluster.token)
    with_token = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token_file)}
    target = ["--address", cluster.dashboard, "--state-dir", str(cluster.state_dir)]
    files_b = [*VERSION_A, _overlay(tmp_path / "b.yaml", ENGINE_CHANGE)]
    rollout_b = ["rollout", *(a for f in files_b for a in ("--config", str(f))), "--no-smoke", *target]
    runs: list[subprocess.CompletedProcess[str]] = []
    apps, rollouts = _deployed_configs(cluster), len(read_history(cluster.state_dir, "rollout"))

    # Without the token (Ray's clients send none unless RAY_AUTH_MODE=token), a wrong one or a missing
    # file: refused with exit 2, naming what to set, and nothing deployed or written.
    for env, command, words in (
        ({}, ["status", *target], ["requires a token", "RAY_AUTH_MODE=token", "$RAY_AUTH_TOKEN"]),
        ({}, rollout_b, ["requires a token", "RAY_AUTH_MODE=token", "$RAY_AUTH_TOKEN_PATH"]),
        ({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "not-the-token"}, ["status", *target], ["rejected"]),
        (
            {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(tmp_path / "missing")},
            rollout_b,
            ["no token could be loaded", f"cannot be opened or is empty: {tmp_path / 'missing'}"],
        ),
    ):
        runs.append(headroom(*command, env=env))
        assert runs[-1].returncode == 2, (env, command, runs[-1].stderr)
        assert all(word in " ".join(runs[-1].stderr.split()) for word in words), runs[-1].stderr
    assert _deployed_configs(cluster) == apps
    assert len(read_history(cluster.state_dir, "rollout")) == rollouts

    # With the token: the rollout (version B; after the first test, the config already running) and status.
    runs.append(headroom(*rollout_b, "--timeout-s", "300", "--json", env=with_token))
    assert runs[-1].returncode == 0, runs[-1].stderr
    record = json.loads(runs[-1].stdout)
    assert record["outcome"] == "succeeded"
    runs.append(headroom("status", "--json", *target, env=with_token))
    assert runs[-1].returncode == 0, runs[-1].stderr
    (app,) = [a for a in json.loads(runs[-1].stdout)["applications"] if a["name"] == "rollout"]
    assert app["status"] == "RUNNING" and app["config_hash"] == record["config_hash"]

    # The token is in no output, rendered config, history line, deployed config or Ray log.
    places = {f"output of `headroom {' '.join(r.args[3:5])}`": r.stdout + r.stderr for r in runs}
    places["the cluster's Serve details"] = json.dumps(_details(cluster))
    files = [*cluster.state_dir.rglob("*"), *(cluster.root / "ray" / "session_latest" / "logs").rglob("*")]
    places.update({str(f): f.read_text(errors="replace") for f in files if f.is_file()})
    assert Path(record["rendered"]).is_file() and str(Path(record["rendered"])) in places
    assert sum(".log" in where or ".out" in where or ".err" in where for where in places) >= 3
    assert [where for where, text in places.items() if cluster.token in text] == []
