"""How each engine of the overhead runs got its torch.compile graphs, beside headroom's share of bare's speed.

Reads the archives `loadtests/gpu/run.sh` packs (`vllm_serve.log`, Ray's worker logs and `results.json` of one
`bench_overhead` run) and tables, per run, each engine's compile source (loadtests/engine_logs.py: compiled in
its start, or loaded from the cache an earlier engine on the machine wrote) with headroom's paired throughput
and TTFT p50 ratios per `vllm bench serve` cell. A server restarted during a run (GPU swaps, one-GPU turns)
left only its last start's logs, so its earlier engines are not seen.

    python -m loadtests.compile_audit results/gpu --out results/gpu/compile_audit.md
"""

from __future__ import annotations

import argparse
import json
import tarfile
from pathlib import Path
from typing import Any

from loadtests import engine_logs
from loadtests.overhead_matrix import BARE, HEADROOM

ARCHIVES = ("overhead.tar.gz", "defaults.tar.gz")  # the run.sh phases that run bench_overhead


def archives(paths: list[Path]) -> list[Path]:
    """The archives named, and those of bench_overhead's phases under the folders named, in name order."""
    found = set()
    for path in paths:
        if path.is_dir():
            found.update(a for name in ARCHIVES for a in path.rglob(name))
        else:
            found.add(path)
    return sorted(found)


def _text(tar: tarfile.TarFile, member: tarfile.TarInfo) -> str:
    f = tar.extractfile(member)
    return f.read().decode(errors="replace") if f else ""


def audit(archive: Path) -> dict[str, Any]:
    """One archive: the compile source of each engine logged, per server, and headroom's paired ratios."""
    bare_logs: dict[str, list[str]] = {}
    ray_logs: dict[str, list[str]] = {}
    results: dict[str, Any] = {}  # none in a run cut off before its first round
    with tarfile.open(archive) as tar:
        for member in tar.getmembers():
            parts = Path(member.name).parts
            if "raw" in parts or not member.isfile():
                continue
            if parts[-1] == "vllm_serve.log":
                bare_logs[member.name] = _text(tar, member).splitlines()
            elif len(parts) >= 2 and parts[-2] == "ray-logs" and parts[-1].startswith("worker-"):
                ray_logs[member.name] = _text(tar, member).splitlines()
            elif parts[-1] == "results.json" and len(parts) == 2:
                results = json.loads(_text(tar, member))
    engines = {
        BARE: [e.torch_compile for e in engine_logs.parse(bare_logs, BARE)],
        HEADROOM: [e.torch_compile for e in engine_logs.parse(ray_logs, HEADROOM)],
    }
    cells = []
    for row in results.get("results", []):
        paired = row.get("comparison", {}).get(HEADROOM)
        if row.get("client") != "vllm-bench" or not paired:
            continue
        cells.append(
            {
                "cell": f"{row['workload']} c={row['concurrency']}",
                "throughput_ratio": paired.get("throughput_ratio"),
                "ttft_p50_ratio": paired.get("ttft_p50_ratio"),
            }
        )
    return {
        "archive": str(archive),
        "layout": results.get("layout"),
        # describe() ends with the GPUs ("..., 1 x NVIDIA H200"): where the runs differ, the cards may.
        "gpus": str(results.get("machine", "?")).rsplit(", ", 1)[-1],
        "compile_cache": results.get("compile_cache", "on (vLLM's default; before the option)"),
        "engines": engines,
        "cells": cells,
    }


def _spread(s: dict[str, float] | None) -> str:
    if not s:
        return "-"
    return f"x{s['median']:.3f} [{s['min']:.3f}, {s['max']:.3f}]"


def _sources(sources: list[str | None]) -> str:
    return ", ".join(s or "not logged" for s in sources) or "none logged"


def markdown(audits: list[dict[str, Any]], command: str) -> str:
    lines = [
        "# How each engine got its torch.compile graphs in the GPU overhead runs",
        "",
        "Per run: each engine's compile source as its log shows it (only a server's last start is logged), "
        "and headroom's paired ratios to bare vLLM per `vllm bench serve` cell (median [min, max] over "
        "rounds).",
        "",
        "| run | GPUs | compile cache | bare vLLM's engines | headroom's engines | cell | throughput "
        "| TTFT p50 |",
        "|---|---|---|---|---|---|---:|---:|",
    ]
    for a in audits:
        head = (
            f"| {a['archive']} | {a['gpus']} | {a['compile_cache']} | {_sources(a['engines'][BARE])} | "
            f"{_sources(a['engines'][HEADROOM])} |"
        )
        no_cells = [{"cell": "no results.json", "throughput_ratio": None, "ttft_p50_ratio": None}]
        for cell in a["cells"] or no_cells:
            ratios = f"{_spread(cell['throughput_ratio'])} | {_spread(cell['ttft_p50_ratio'])}"
            lines.append(f"{head} {cell['cell']} | {ratios} |")
    lines += ["", f"Command: `{command}`", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("paths", nargs="+", type=Path, help=f"archives, or folders to search for {ARCHIVES}")
    p.add_argument("--out", type=Path, required=True, help="the Markdown table (a .json beside it)")
    args = p.parse_args(argv)
    audits = [audit(a) for a in archives(args.paths)]
    command = " ".join(["python -m loadtests.compile_audit", *map(str, args.paths), "--out", str(args.out)])
    args.out.write_text(markdown(audits, command))
    args.out.with_suffix(".json").write_text(json.dumps(audits, indent=2))
    print(args.out.read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
