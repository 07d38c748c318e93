"""What Ray Serve's request path costs a replica per request, against uvicorn alone, with no engine.

A headroom replica serves HTTP through Ray Serve's direct ingress: HAProxy sends each request to the
replica's own uvicorn server, and Serve wraps the app with its request handling (request metadata, a
disconnect watcher unless turned off, ongoing-request accounting, the access log line and its request
metrics). `vllm serve` runs the same kind of app on uvicorn alone. The app here is a trivial streaming ASGI
app (a response start and CHUNKS body chunks, no engine), so what differs is Serve's path. Servers:

- `uvicorn`: the app on uvicorn (uvloop, httptools), as `vllm serve` runs its app;
- `serve`: the app as a Serve ingress deployment on a local cluster with headroom's settings
  (SERVE_CLUSTER_ENV: HAProxy, direct ingress, user code on the replica's loop, no disconnect watcher), loaded
  through HAProxy and at the replica's own port;
- `serve, Serve's disconnect watcher`: the same with Serve's per-request disconnect watcher, as Serve runs
  by default (headroom turns it off: serving/ingress_middleware.py);
- `serve, no access log`: headroom's settings with Serve's access log off
  (`logging_config.enable_access_log`).

Measured: the serving process's CPU time per request (user + system, from /proc; HAProxy's own CPU is not
counted) over N requests at concurrency C, rounds interleaved; median [min, max] over rounds. With
`--profile-requests N`, after the rounds py-spy records uvicorn and two of the replicas (at their own port)
while each serves N more requests: the sampled time per request in frames that contain each part of the path
(SERVE_PARTS), so the difference is seen by where it goes. py-spy's sampling slows what it samples a little.

    python -m loadtests.bench_serve_request --profile-requests 20000 --out results/serve_request
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import psutil
import ray
from ray import serve
from ray.serve._private.constants import (
    RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT,
    RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT,
)

from loadtests import diag_evidence as ev
from loadtests.machine import describe
from loadtests.processes import serve_replicas

BODY = b'data: {"x": 1}\n\n'


def trivial_app(chunks: int):
    """An ASGI app that reads the request body and answers with a response start and `chunks` body chunks."""

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        while (await receive()).get("more_body"):
            pass
        start = {
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-type", b"text/event-stream")],
        }
        await send(start)
        for _ in range(chunks - 1):
            await send({"type": "http.response.body", "body": BODY, "more_body": True})
        await send({"type": "http.response.body", "body": BODY, "more_body": False})

    return app


def uvicorn_app():
    """uvicorn's factory (`--factory`): the app with CHUNKS from the environment."""
    return trivial_app(int(os.environ["CHUNKS"]))


@serve.ingress()
class Trivial:
    """The app as a Serve ingress deployment, built late as headroom's LLMServer builds vLLM's."""

    def __init__(self, chunks: int):
        self.chunks = chunks

    async def __serve_build_asgi_app__(self):
        return trivial_app(self.chunks)


# A replica started with Serve's HTTP callback unset gets no middleware from headroom, so Serve watches each
# request for the client's disconnect, as it does by default (serving/ingress_middleware.py).
SERVE_WATCHER = {"env_vars": {"RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH": ""}}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _load(url: str, n: int, concurrency: int) -> None:
    left = [n]
    async with httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=concurrency)) as client:

        async def worker() -> None:
            while left[0] > 0:
                left[0] -= 1
                r = await client.post(url, content=b'{"prompt": "hi"}')
                r.raise_for_status()

        await asyncio.gather(*(worker() for _ in range(concurrency)))


def cpu_us_per_request(url: str, pid: int, n: int, concurrency: int) -> float:
    proc = psutil.Process(pid)
    before = sum(proc.cpu_times()[:2])
    asyncio.run(_load(url, n, concurrency))
    return (sum(proc.cpu_times()[:2]) - before) / n * 1e6


def wait_until_serving(url: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.post(url, content=b"{}", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} did not answer within {timeout_s} s")


def replica_pid_and_port(app_name: str) -> tuple[int, int]:
    """The replica's process and the port of its own HTTP server (direct ingress, in Serve's port range)."""
    (replica,) = serve_replicas(app_name)
    ports = sorted(
        c.laddr.port
        for c in replica.net_connections()
        if c.status == psutil.CONN_LISTEN
        and RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT <= c.laddr.port <= RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT
    )
    return replica.pid, ports[0]


# Where a request's time goes: (part, a substring of the frames that are it, as py-spy names them).
# Inclusive: a part's time includes the frames below it, so rows nest and do not add up.
SERVE_PARTS = (
    ("uvicorn: a request's ASGI cycle, all below it", "RequestResponseCycle.run_asgi ("),
    ("uvicorn: reading and parsing requests", "HttpToolsProtocol.data_received ("),
    ("Serve's request path, the app included", "Replica._direct_ingress_asgi ("),
    ("the app itself", "trivial_app.<locals>.app ("),
    ("Serve after the response: access log and metrics", "Replica._record_errors_and_metrics ("),
    ("of which the access log's record (made with the log off too)", "Logger.info ("),
    ("of which request metrics", "ReplicaMetricsManager.record_request_metrics ("),
    ("Serve's request ids (two UUID4s)", "generate_request_id ("),
)
PROFILED = ("uvicorn", "serve, replica's port", "serve, no access log, replica's port")
PROFILE_RATE_HZ = 500


def us_per_request_in_parts(raw: list[str], rate_hz: int, requests: int) -> dict[str, float]:
    """From a py-spy raw profile of a process that served `requests` while it was recorded: the sampled
    microseconds per request in frames containing each part of SERVE_PARTS."""
    shares = ev.frame_share(raw, "", [frame for _, frame in SERVE_PARTS])
    return {part: shares[frame][0] / rate_hz / requests * 1e6 for part, frame in SERVE_PARTS}


def profile(targets: dict[str, tuple[str, int]], args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """py-spy on each PROFILED server while it serves --profile-requests requests; raw profiles kept in
    --out as profile-N.raw.gz (N: the server's place in PROFILED)."""
    from loadtests.overhead_diag import Recording

    parts = {}
    for i, label in enumerate(PROFILED):
        url, pid = targets[label]
        raw_path = args.out / f"profile-{i}.raw"
        recording = Recording(pid, raw_path, rate_hz=PROFILE_RATE_HZ)
        time.sleep(1.0)  # py-spy attaches; idle samples count in no part
        cpu_us_per_request(url, pid, args.profile_requests, args.concurrency)
        stopped = recording.stop()
        if "error" in stopped:
            raise RuntimeError(f"py-spy on {label} (pid {pid}): {stopped['error']}")
        raw = raw_path.read_text().splitlines()
        parts[label] = us_per_request_in_parts(raw, PROFILE_RATE_HZ, args.profile_requests)
        with gzip.open(raw_path.with_suffix(".raw.gz"), "wt") as f:
            f.write("\n".join(raw) + "\n")
        raw_path.unlink()
    return parts


def run(args: argparse.Namespace) -> tuple[dict[str, list[float]], dict[str, dict[str, float]]]:
    from serve_app.serving.driver import init_ray_driver
    from serve_app.serving.serve_options import apply_cluster_env

    uv_port, serve_port = free_port(), free_port()
    uv = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "--factory", "loadtests.bench_serve_request:uvicorn_app",
         "--port", str(uv_port), "--loop", "uvloop", "--http", "httptools", "--no-access-log",
         "--log-level", "warning"],
        env={**os.environ, "CHUNKS": str(args.chunks)}, start_new_session=True,
    )  # fmt: skip
    apply_cluster_env(os.environ)
    samples: dict[str, list[float]] = {}
    parts: dict[str, dict[str, float]] = {}
    try:
        init_ray_driver(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False,
                        logging_level="WARNING")  # fmt: skip
        serve.start(http_options={"host": "127.0.0.1", "port": serve_port})
        apps = {
            "serve, Serve's disconnect watcher": {"ray_actor_options": {"runtime_env": SERVE_WATCHER}},
            "serve": {},
            "serve, no access log": {"logging_config": {"enable_access_log": False}},
        }
        for i, options in enumerate(apps.values()):
            name = f"trivial{i}"
            deployment = serve.deployment(Trivial).options(
                name="Trivial", max_ongoing_requests=256, **options
            )
            serve.run(deployment.bind(args.chunks), name=name, route_prefix=f"/{name}", blocking=False)
            wait_until_serving(f"http://127.0.0.1:{serve_port}/{name}")
        wait_until_serving(f"http://127.0.0.1:{uv_port}/")
        targets = {"uvicorn": (f"http://127.0.0.1:{uv_port}/", uv.pid)}
        for i, label in enumerate(apps):
            pid, port = replica_pid_and_port(f"trivial{i}")
            targets[f"{label}, through HAProxy"] = (f"http://127.0.0.1:{serve_port}/trivial{i}", pid)
            targets[f"{label}, replica's port"] = (f"http://127.0.0.1:{port}/trivial{i}", pid)
        for url, pid in targets.values():  # warm-up
            cpu_us_per_request(url, pid, args.requests // 10, args.concurrency)
        for r in range(args.rounds):
            order = list(targets.items())
            for label, (url, pid) in order[r % len(order) :] + order[: r % len(order)]:
                samples.setdefault(label, []).append(
                    cpu_us_per_request(url, pid, args.requests, args.concurrency)
                )
        if args.profile_requests:
            parts = profile(targets, args)
    finally:
        uv.terminate()
        uv.wait(timeout=30)
        serve.shutdown()
        ray.shutdown()
    return samples, parts


def report(
    samples: dict[str, list[float]],
    parts: dict[str, dict[str, float]],
    args: argparse.Namespace,
    command: str,
) -> str:
    base = samples["uvicorn"]
    lines = [
        "# Ray Serve's request path: the serving process's CPU per request, no engine",
        "",
        f"Machine: {describe()}. Trivial streaming app, {args.chunks} body chunk(s) per response; "
        f"{args.requests} requests at concurrency {args.concurrency} per round, {args.rounds} rounds, "
        "interleaved.",
        "",
        "| server | us of CPU per request, median [min, max] | minus uvicorn's, paired per round |",
        "|---|---:|---:|",
    ]
    for label, values in samples.items():
        extra = [v - b for v, b in zip(values, base, strict=True)]
        lines.append(
            f"| {label} | {np.median(values):.0f} [{min(values):.0f}, {max(values):.0f}] | "
            f"{np.median(extra):+.0f} [{min(extra):+.0f}, {max(extra):+.0f}] |"
        )
    if parts:
        lines += [
            "",
            f"Where the time goes (py-spy at {PROFILE_RATE_HZ} Hz while each server served "
            f"{args.profile_requests} more requests at concurrency {args.concurrency}): sampled us per "
            "request in frames containing each part, which includes the frames below it; raw profiles "
            "in profile-N.raw.gz, N the server's column from 0.",
            "",
            "| part | " + " | ".join(parts) + " |",
            "|---|" + "---:|" * len(parts),
        ]
        for part, _ in SERVE_PARTS:
            lines.append(f"| {part} | " + " | ".join(f"{p[part]:.0f}" for p in parts.values()) + " |")
    lines += ["", f"Command: `{command}`", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=3000, help="requests per server per round")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--chunks", type=int, default=1, help="body chunks per response")
    p.add_argument("--profile-requests", type=int, default=0,
                   help="requests per server under py-spy after the rounds; 0: no profile")  # fmt: skip
    p.add_argument("--out", type=Path, default=Path("results/serve_request"))
    args = p.parse_args(argv)
    for name, value in (("--requests", args.requests), ("--concurrency", args.concurrency),
                        ("--rounds", args.rounds), ("--chunks", args.chunks)):  # fmt: skip
        if value < 1:
            p.error(f"{name} must be >= 1, got {value}")
    if args.profile_requests < 0:
        p.error(f"--profile-requests must be >= 0 (0: no profile), got {args.profile_requests}")
    command = "python -m loadtests.bench_serve_request " + " ".join(
        argv if argv is not None else sys.argv[1:]
    )
    args.out.mkdir(parents=True, exist_ok=True)
    samples, parts = run(args)
    results = {"command": command, "samples_us": samples, "profile_us_per_request": parts}
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    text = report(samples, parts, args, command.strip())
    (args.out / "report.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
