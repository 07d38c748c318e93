"""Deploys the planned placement on a real two-node Ray cluster with fake GPUs and reports where it landed.

Run as a script, with its own Ray cluster (separate from the test session's). It writes one JSON object
with the plan and every placement group Serve created for the replicas to the file named by its third
argument. No vLLM is started: the replicas are probes, because the GPUs are only advertised resources.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import ray
from ray import serve
from ray.cluster_utils import Cluster
from ray.util import placement_group_table

from serve_app.config import ConfigError, load_env_config
from serve_app.planning.from_config import plan_config, require_fit
from serve_app.serving.deployment import live_cluster
from serve_app.serving.serve_options import deployment_options
from tests.integration.conftest import free_port

GPUS_PER_NODE = 4


class Probe:
    def __call__(self) -> str:
        return "ok"


def main(model: str, num_replicas: int, out_path: str) -> None:
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 4, "num_gpus": GPUS_PER_NODE})
    cluster.add_node(num_cpus=4, num_gpus=GPUS_PER_NODE)
    ray.init(address=cluster.address, logging_level="ERROR")
    try:
        staging = load_env_config("staging").model_dump(mode="json")
        staging["model"] = {**staging["model"], "source": model, "served_name": "probe"}
        staging["deployment"] = {**staging["deployment"], "num_replicas": num_replicas}
        from serve_app.config import parse_config

        cfg = parse_config(staging)
        cluster_seen = live_cluster(cfg)
        plan = plan_config(cfg, cluster_seen)
        try:
            require_fit(plan)
        except ConfigError as refused:
            groups = list(placement_group_table().values())
            Path(out_path).write_text(json.dumps({"refused": str(refused), "placement_groups": groups}))
            return
        serve.start(http_options={"host": "127.0.0.1", "port": free_port()})
        options = deployment_options(cfg, plan)
        serve.run(serve.deployment(Probe).options(name="LLMServer", **options).bind(), name="probe")
        deadline = time.time() + 60
        while time.time() < deadline:
            groups = [g for g in placement_group_table().values() if g["state"] == "CREATED"]
            groups = [g for g in groups if "LLMServer" in g.get("name", "")]
            if len(groups) == num_replicas:
                break
            time.sleep(1)
        nodes = {n["NodeID"]: n["Resources"].get("GPU", 0) for n in ray.nodes() if n["Alive"]}
        Path(out_path).write_text(
            json.dumps(
                {
                    "cluster": {"nodes": cluster_seen.nodes, "gpus_per_node": cluster_seen.gpus_per_node},
                    "plan": plan.to_json(),
                    "options": {
                        k: options.get(k) for k in ("placement_group_bundles", "placement_group_strategy")
                    },
                    "node_gpus": nodes,
                    "placement_groups": [
                        {
                            "name": g["name"],
                            "strategy": g["strategy"],
                            "bundles": list(g["bundles"].values()),
                            "bundle_nodes": list(g["bundles_to_node_id"].values()),
                        }
                        for g in groups
                    ],
                }
            )
        )
    finally:
        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
