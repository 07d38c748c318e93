"""One real Ray cluster and real headroom apps (vLLM CPU engines) shared by the whole test session.

An engine takes about a minute to start here, so every integration test shares these:
- `main`  at /       : configs/local.yaml + ngram speculation (tests/integration/configs/ngram.yaml)
- `draft` at /draft  : configs/local.yaml + draft-model speculation (tests/integration/configs/draft.yaml),
                       behind an API key read from the environment (DRAFT_KEYS_ENV)
- `secure` at /secure: two replicas with API keys from a key file, request limits and a bounded queue
                       (tests/integration/configs/secure.yaml); started by the first test that asks for it
"""

from __future__ import annotations

import os
import random
import secrets
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil
import pytest
import ray
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families
from ray import serve

from serve_app.config import DEFAULT_CONFIG_DIR, HeadroomConfig, deep_merge, load_config, parse_config
from serve_app.serving.deployment import build_from_config
from serve_app.serving.driver import init_ray_driver
from serve_app.serving.serve_options import apply_cluster_env

HERE = Path(__file__).parent
DRAFT_KEYS_ENV = "HEADROOM_TEST_DRAFT_KEYS"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def engine_core_of(replica: psutil.Process) -> psutil.Process:
    """The replica's vLLM engine-core process: the child that multiprocessing spawned (its other child is
    multiprocessing's resource tracker). vLLM titles it `VLLM::EngineCore` with setproctitle, which rewrites
    the command line; the title is a fallback only, as a replacement replica's engine was once seen untitled
    (command line and process name still `python`)."""
    children = replica.children()
    cores = [
        c
        for c in children
        if any(m in " ".join(c.cmdline()) for m in ("EngineCore", "multiprocessing.spawn"))
    ]
    assert len(cores) == 1, (replica, [(c.pid, c.name(), c.cmdline()[:3]) for c in children])
    return cores[0]


def overlay(name: str) -> HeadroomConfig:
    return load_config(
        DEFAULT_CONFIG_DIR / "base.yaml", DEFAULT_CONFIG_DIR / "local.yaml", HERE / "configs" / name
    )


@dataclass
class Cluster:
    http_port: int
    metrics_port: int
    main: HeadroomConfig
    draft: HeadroomConfig
    keys: dict[str, str] = field(default_factory=dict)
    """A valid API key per route prefix of the apps that require one."""

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def auth(self, prefix: str = "") -> dict[str, str]:
        """The Authorization header the app at `prefix` wants (none for an app without keys)."""
        return {"Authorization": f"Bearer {self.keys[prefix]}"} if prefix in self.keys else {}

    def client(self, prefix: str = "", **kwargs) -> OpenAI:
        key = self.keys.get(prefix, "unused")
        return OpenAI(base_url=f"{self.base_url}{prefix}/v1", api_key=key, max_retries=0, **kwargs)

    def metrics(self) -> dict[str, list]:
        """Ray's Prometheus export for this node: {sample name: [(labels, value), ...]}."""
        text = httpx.get(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10).text
        samples: dict[str, list] = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                samples.setdefault(s.name, []).append((s.labels, s.value))
        return samples

    def metric_sum(self, name: str, **labels: str) -> float:
        return sum(
            v for lab, v in self.metrics().get(name, []) if all(lab.get(k) == w for k, w in labels.items())
        )

    def wait_for_metric(self, name: str, at_least: float, timeout_s: float = 60, **labels: str) -> float:
        """Ray's agent exports on an interval; poll until the value arrives."""
        deadline = time.time() + timeout_s
        value = 0.0
        while time.time() < deadline:
            value = self.metric_sum(name, **labels)
            if value >= at_least:
                return value
            time.sleep(1)
        raise AssertionError(f"{name}{labels} stayed at {value} < {at_least} for {timeout_s}s")


@pytest.fixture(scope="session")
def cluster() -> Cluster:
    http_port, metrics_port = free_port(), free_port()
    apply_cluster_env(os.environ)  # the production settings (HAProxy ingress)
    # Serve's own listeners have fixed default ports: HAProxy's stats and metrics, the Python fallback proxy
    # (where HAProxy sends requests while an app has no running replica) and the replicas' HTTP/gRPC ports,
    # several of them bound with SO_REUSEPORT. A cluster a test starts (make loadtest, a ladder) on the
    # defaults would share those sockets with this one, and this one's apps would answer its requests. So
    # this cluster gets ports of its own, set only while ray.init starts it (its processes inherit them) and
    # then taken out of this process's environment again, leaving Ray's defaults to the clusters tests start.
    replica_http, replica_grpc = random.randrange(33000, 34900, 100), random.randrange(43000, 44900, 100)
    own_ports = {
        "RAY_SERVE_HAPROXY_STATS_PORT": str(free_port()),
        "RAY_SERVE_HAPROXY_METRICS_PORT": str(free_port()),
        "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT": str(free_port()),
        "RAY_SERVE_FALLBACK_PROXY_GRPC_PORT": str(free_port()),
        "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(replica_http),
        "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(replica_http + 99),
        "RAY_SERVE_DIRECT_INGRESS_MIN_GRPC_PORT": str(replica_grpc),
        "RAY_SERVE_DIRECT_INGRESS_MAX_GRPC_PORT": str(replica_grpc + 99),
    }
    os.environ.update(own_ports)
    # The draft app's replica reads its key from the environment Ray's processes start with.
    os.environ[DRAFT_KEYS_ENV] = f"draft-{secrets.token_urlsafe(24)}"
    # A new local cluster, whatever /tmp/ray/ray_current_cluster points at (a stale one fails the session).
    # (init_ray_driver: the tests check the exit codes of the CLIs and `make` they run.)
    init_ray_driver(
        address="local",
        num_cpus=8,
        _metrics_export_port=metrics_port,
        logging_level="WARNING",
        log_to_driver=False,
    )
    for name in own_ports:
        del os.environ[name]
    serve.start(http_options={"host": "127.0.0.1", "port": http_port})
    main, draft = overlay("ngram.yaml"), overlay("draft.yaml")
    for cfg in (main, draft):
        serve.run(build_from_config(cfg), name=cfg.name, route_prefix=cfg.route_prefix)
    yield Cluster(http_port, metrics_port, main, draft, {draft.route_prefix: os.environ[DRAFT_KEYS_ENV]})
    serve.shutdown()
    ray.shutdown()


@dataclass
class SecureApp:
    """The `secure` app: its config, its two keys (in `key_file`) and a client for it."""

    cluster: Cluster
    cfg: HeadroomConfig
    keys: list[str]
    key_file: Path

    @property
    def prefix(self) -> str:
        return self.cfg.route_prefix

    @property
    def base_url(self) -> str:
        return f"{self.cluster.base_url}{self.prefix}"

    def auth(self, key: str | None = None) -> dict[str, str]:
        return {"Authorization": f"Bearer {key or self.keys[0]}"}

    def client(self, key: str | None = None, **kwargs) -> OpenAI:
        kwargs.setdefault("max_retries", 0)
        return OpenAI(base_url=f"{self.base_url}/v1", api_key=key or self.keys[0], **kwargs)


def secure_config(key_file: Path) -> HeadroomConfig:
    """configs/local.yaml + configs/secure.yaml, with the key file's path (known only at run time)."""
    layers = [
        DEFAULT_CONFIG_DIR / "base.yaml",
        DEFAULT_CONFIG_DIR / "local.yaml",
        HERE / "configs" / "secure.yaml",
    ]
    merged = load_config(*layers).model_dump(mode="json")
    return parse_config(deep_merge(merged, {"security": {"api_keys": {"file": str(key_file)}}}))


@pytest.fixture(scope="session")
def secure(cluster, tmp_path_factory) -> SecureApp:
    keys = [f"secure-{secrets.token_urlsafe(24)}" for _ in range(2)]
    key_file = tmp_path_factory.mktemp("keys") / "api-keys"
    key_file.write_text("# the secure test app's keys\n" + "\n".join(keys) + "\n")
    cfg = secure_config(key_file)
    serve.run(build_from_config(cfg), name=cfg.name, route_prefix=cfg.route_prefix)
    cluster.keys[cfg.route_prefix] = keys[0]
    return SecureApp(cluster, cfg, keys, key_file)
