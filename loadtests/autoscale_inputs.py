"""Writes what the autoscaling benchmark needs to know about a deployment, from its config and plan.

autoscale/ imports nothing from serve_app (its pure part must stay free of the planner and the config
loader), so the numbers travel as data: the policy settings and TTFT target of the config, the engine
limits its plan gives each replica, and what a replica does with requests beyond them (headroom's
overload refusal, when the config has it).

    python -m loadtests.autoscale_inputs configs/base.yaml configs/prod.yaml --gpus 8 --nodes 2 \\
        --out results/autoscale/deployment.json
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from serve_app.config import HeadroomConfig
from serve_app.config.loading import load_config_files
from serve_app.planning.from_config import cluster_spec, plan_config, require_fit


def deployment_inputs(config_paths: Sequence[str], gpus: int, nodes: int) -> dict[str, Any]:
    """The settings, TTFT target and per-replica engine limits of the config files' plan."""
    cfg = load_config_files(*config_paths)
    return {
        "configs": list(config_paths),
        "command": f"python -m loadtests.autoscale_inputs {' '.join(config_paths)} --gpus {gpus} "
        f"--nodes {nodes}",
        **inputs_of(cfg, gpus, nodes, " + ".join(config_paths)),
    }


def inputs_of(cfg: HeadroomConfig, gpus: int, nodes: int, source: str) -> dict[str, Any]:
    """What :func:`deployment_inputs` writes, for a config already loaded (``source`` names it)."""
    if cfg.deployment.autoscaling is None:
        raise SystemExit(f"{source}: deployment.autoscaling is not set")
    plan = plan_config(cfg, cluster_spec(cfg, nodes=nodes, gpus_per_node=gpus))
    require_fit(plan)
    overload = cfg.security.overload
    # The generation requests a replica admits: headroom's bound when it refuses beyond it
    # (serving/serve_options.py admission_options), else Serve's max_ongoing_requests, queueing behind.
    admits = (
        cfg.deployment.max_ongoing_requests
        if overload is None
        else overload.admission_bound(plan.max_num_seqs)
    )
    return {
        "ttft_target_ms": cfg.slo.ttft_p95_ms,
        "max_model_len": cfg.model.max_model_len,
        "autoscaling": cfg.deployment.autoscaling.model_dump(mode="json"),
        "limits": {
            "max_num_seqs": plan.max_num_seqs,
            "max_num_batched_tokens": plan.max_num_batched_tokens,
            "kv_cache_tokens": plan.kv_cache_tokens_per_replica,
            "max_ongoing_requests": admits,
        },
        "admission": {"retry_after_s": None if overload is None else float(overload.retry_after_s)},
        "replicas_that_fit": plan.replicas,
    }


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m loadtests.autoscale_inputs", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("configs", nargs="+", help="config files, base first")
    ap.add_argument("--gpus", type=int, default=8, help="GPUs per node to plan for")
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(deployment_inputs(args.configs, args.gpus, args.nodes), indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
