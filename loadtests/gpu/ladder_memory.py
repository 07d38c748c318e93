"""The memory every ladder engine logged against the planner's prediction for its setting.

python -m loadtests.gpu.ladder_memory CONFIG... --ladders A/results.json B/results.json --out memory.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from loadtests import engine_logs
from serve_app.config import deep_merge, load_config_files, parse_config
from serve_app.planning import cluster_spec, plan_config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", nargs="+")
    parser.add_argument("--ladders", nargs="+", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    base = load_config_files(*args.config)
    predictions = {}
    for path in args.ladders:
        for run in json.loads(path.read_text())["runs"]:
            cfg = parse_config(deep_merge(base.model_dump(mode="json"), {"engine": run["engine"]}))
            plan = plan_config(cfg, cluster_spec(cfg, gpus_per_node=1))
            predictions[run["setting"]] = {
                "kv_cache_tokens": plan.kv_cache_tokens_per_replica,
                "weights_gib": plan.weights_gib_per_gpu,
            }
    rows = []
    for engine in engine_logs.parse(engine_logs.ray_session_logs(), "headroom replica"):
        # Settings differ in activation memory only (a few hundred MiB): the nearest prediction is its own.
        name = min(predictions, key=lambda k: abs(predictions[k]["kv_cache_tokens"] - engine.kv_cache_tokens))
        rows.append({"config": name, **engine_logs.compare(predictions[name], engine)})
    args.out.write_text(json.dumps({"predictions": predictions, "engines": rows}, indent=2))
    print(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
