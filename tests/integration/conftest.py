"""One real Ray cluster and two real headroom apps (vLLM CPU engines) shared by the whole test session.

An engine takes about a minute to start here, so every integration test shares these:
- `main`  at /       : configs/local.yaml + ngram speculation (tests/integration/configs/ngram.yaml)
- `draft` at /draft  : configs/local.yaml + draft-model speculation (tests/integration/configs/draft.yaml)
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import ray
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families
from ray import serve

from serve_app.config import DEFAULT_CONFIG_DIR, HeadroomConfig, load_config
from serve_app.serving.deployment import build_from_config
from serve_app.serving.serve_options import apply_cluster_env

HERE = Path(__file__).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def client(self, prefix: str = "", **kwargs) -> OpenAI:
        return OpenAI(base_url=f"{self.base_url}{prefix}/v1", api_key="unused", max_retries=0, **kwargs)

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
    # A new local cluster, whatever /tmp/ray/ray_current_cluster points at (a stale one fails the session).
    ray.init(
        address="local",
        num_cpus=8,
        _metrics_export_port=metrics_port,
        logging_level="WARNING",
        log_to_driver=False,
    )
    serve.start(http_options={"host": "127.0.0.1", "port": http_port})
    main, draft = overlay("ngram.yaml"), overlay("draft.yaml")
    for cfg in (main, draft):
        serve.run(build_from_config(cfg), name=cfg.name, route_prefix=cfg.route_prefix)
    yield Cluster(http_port, metrics_port, main, draft)
    serve.shutdown()
    ray.shutdown()
