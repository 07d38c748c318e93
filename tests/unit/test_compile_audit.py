"""The compile-source audit of packed overhead runs (loadtests/compile_audit.py)."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

from loadtests import compile_audit, engine_logs

COMPILED = "(EngineCore pid=1) INFO 12-05 08:47:53 [b.py:3] Compiling a graph for compile range (1, 8192)"
LOADED = "(EngineCore pid=2) INFO 12-05 08:51:20 [d.py:3] Directly load AOT compilation from path /c"


def kv(pid: int) -> str:
    return f"(EngineCore pid={pid}) INFO 12-05 08:52:00 [k.py:1] GPU KV cache size: 137,264 tokens"


def pack(path: Path, files: dict[str, str]) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def test_each_servers_engines_and_headroom_paired_ratios(tmp_path):
    ratio = {"median": 0.974, "min": 0.97, "max": 0.98, "n": 3}
    results = {
        "machine": "x86_64, 16 CPUs, 126 GiB RAM, 1 x NVIDIA H100 80GB HBM3",
        "layout": "both servers up at once on one GPU (0)",
        "compile_cache": "on",
        "results": [
            {"workload": "random-1024", "concurrency": 64, "client": "vllm-bench",
             "comparison": {"headroom": {"throughput_ratio": ratio, "ttft_p50_ratio": ratio}}},
            {"workload": "random-1024", "concurrency": 1, "client": "ours", "comparison": {}},
        ],
    }  # fmt: skip
    run = tmp_path / "2026-12-05" / "overhead"
    run.mkdir(parents=True)
    pack(
        run / "overhead.tar.gz",
        {
            "overhead/vllm_serve.log": f"{COMPILED}\n{kv(1)}\n",
            "overhead/ray-logs/worker-ab.err": f"{LOADED}\n{kv(2)}\n",
            "overhead/ray-logs/worker-cd.out": "nothing of an engine here\n",
            "overhead/raw/vllm-random-1024-c64-r0.json": "{}",
            "overhead/results.json": json.dumps(results),
        },
    )
    pack(run / "diag.tar.gz", {"diag/vllm_serve.log": COMPILED})  # not a bench_overhead phase

    [found] = compile_audit.archives([tmp_path])
    audit = compile_audit.audit(found)
    assert audit["engines"] == {"vllm": [engine_logs.COMPILED], "headroom": [engine_logs.LOADED]}
    assert audit["gpus"] == "1 x NVIDIA H100 80GB HBM3" and audit["compile_cache"] == "on"
    cell = {"cell": "random-1024 c=64", "throughput_ratio": ratio, "ttft_p50_ratio": ratio}
    assert audit["cells"] == [cell]  # our client's cells are not vllm bench serve's
    text = compile_audit.markdown([audit], "python -m loadtests.compile_audit x --out y")
    assert "| compiled | loaded from cache | random-1024 c=64 | x0.974 [0.970, 0.980] |" in text
