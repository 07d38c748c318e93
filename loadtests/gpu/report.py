"""Turns what `loadtests/gpu/run.sh` brought back into the committed results page.

    python -m loadtests.gpu.report RUN_DIR --out results/gpu [--only-ladder]

RUN_DIR holds the phases' archives unpacked (overhead/, scale/, ladder-1/ and ladder-2/, each with two
parts of the ladder). Writes, under --out: report.md with every table, the autoscaling plot, each phase's
JSON and reports, the ladder's four parts (results and gzipped raw files) under ladder/ with their merged
report, and memory.json: every engine's logged KV tokens and weights against the plan.
"""

from __future__ import annotations

import argparse
import gzip
import json
import shutil
from pathlib import Path
from typing import Any

from loadtests import engine_logs, ladder_report
from serve_app.config import deep_merge, load_config_files, parse_config
from serve_app.planning.from_config import cluster_spec, plan_config

CONFIG = ("configs/base.yaml", "loadtests/gpu/qwen3-8b.yaml")


def predictions() -> dict[str, dict[str, float]]:
    base = load_config_files(*CONFIG)
    out = {}
    for tp in (1, 2):
        cfg = parse_config(deep_merge(base.model_dump(mode="json"), {"engine": {"tensor_parallel_size": tp}}))
        plan = plan_config(cfg, cluster_spec(cfg, gpus_per_node=2))
        out[f"TP={tp}"] = {
            "kv_cache_tokens": plan.kv_cache_tokens_per_replica,
            "weights_gib": plan.weights_gib_per_gpu,
        }
    return out


def memory_rows(run_dir: Path) -> list[dict[str, Any]]:
    expected = predictions()
    rows = []
    for phase in ("overhead", "scale", *sorted(p.name for p in run_dir.glob("ladder-*"))):
        sources = {"headroom replica": sorted((run_dir / phase / "ray-logs").glob("worker-*"))}
        if (run_dir / phase / "vllm_serve.log").exists():
            sources["bare vllm serve"] = [run_dir / phase / "vllm_serve.log"]
        for source, paths in sources.items():
            engines = engine_logs.parse(engine_logs.read_files(paths), source)
            rows += [{"phase": phase, **row} for row in engine_logs.compare_each(expected, engines)]
    return rows


def plot_autoscale(scale: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    a = scale["phases"]["autoscale"]
    ok = [r for r in a["requests"] if r["ok"]]
    fig, ax = plt.subplots(figsize=(11, 5))
    ax.scatter([r["sent_s"] + r["ttft_s"] for r in ok], [r["ttft_s"] * 1000 for r in ok], s=3, alpha=0.3,
               label="TTFT of each request (at its first token)")  # fmt: skip
    p95 = a["rolling_ttft_p95_s"]
    ax.plot([t for t, _ in p95], [v * 1000 for _, v in p95], color="black", label="TTFT p95, trailing 10 s")
    ax.axhline(a["ttft_target_ms"], color="red", linewidth=1, label=f"target {a['ttft_target_ms']:g} ms")
    marks = (("step_at_s", "load steps up", "grey"), ("ttft_p95_breach_at_s", "p95 breach", "red"),
             ("second_replica_requested_at_s", "2nd replica asked", "orange"),
             ("second_replica_running_at_s", "2nd replica serving", "green"))  # fmt: skip
    for key, label, color in marks:
        if a.get(key) is not None:
            ax.axvline(a[key], color=color, linestyle="--", linewidth=1, label=f"{label} ({a[key]:.0f} s)")
    ax.set(xlabel="seconds since the app was deployed", ylabel="TTFT ms", yscale="log",
           title="TTFT-headroom autoscaler, min 1 / max 2 replicas, Qwen3-8B shape on 2 x H200")  # fmt: skip
    replicas = ax.twinx()
    replicas.step([t for t, _ in a["replica_states"]], [s.get("RUNNING", 0) for _, s in a["replica_states"]],
                  where="post", color="purple", label="RUNNING replicas")  # fmt: skip
    replicas.set(ylabel="RUNNING replicas", ylim=(0, 3))
    lines, labels = ax.get_legend_handles_labels()
    more, more_labels = replicas.get_legend_handles_labels()
    ax.legend(lines + more, labels + more_labels, fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def copy_phase_files(run_dir: Path, out: Path) -> None:
    (out / "overhead").mkdir(parents=True, exist_ok=True)
    for name in ("results.json", "report.md"):
        shutil.copy(run_dir / "overhead" / name, out / "overhead" / name)
    with (
        open(run_dir / "overhead" / "vllm_serve.log", "rb") as src,
        gzip.open(out / "overhead" / "vllm_serve.log.gz", "wb") as dst,
    ):
        shutil.copyfileobj(src, dst)
    (out / "scale").mkdir(exist_ok=True)
    shutil.copy(run_dir / "scale" / "scale.json", out / "scale" / "scale.json")
    copy_ladder(run_dir, out / "ladder")


def copy_ladder(run_dir: Path, out: Path) -> None:
    """The ladder's parts (results and raw files) under out/part*, and their merge as out's report."""
    parts = sorted(run_dir.glob("ladder-*/part*/" + ladder_report.RESULTS))
    for results in parts:
        dst = out / results.parent.name
        dst.mkdir(parents=True, exist_ok=True)
        for src in (results, *sorted(results.parent.glob("raw_*.jsonl.gz"))):
            shutil.copy(src, dst / src.name)
    merged = ladder_report.merge([out / results.parent.name for results in parts], out)
    ladder_report.write(merged, out)


def overhead_section(overhead: dict[str, Any]) -> list[str]:
    lines = [
        "## Overhead: headroom against bare `vllm serve`, one H200 each, same engine flags",
        "",
        f"{overhead['max_tokens']} output tokens, ~50-token prompts, {overhead['rounds']} alternating rounds per "
        "concurrency; details in [overhead/report.md](overhead/report.md).",
        "",
        "| c | TTFT p50 ms vLLM / headroom | TTFT p99 ms vLLM / headroom | TPOT p50 ms vLLM / headroom "
        "| output tok/s vLLM / headroom | throughput ratio |",
        "|---:|---|---|---|---|---:|",
    ]
    for row in overhead["results"]:
        v, h, c = row["vllm"], row["headroom"], row["comparison"]
        pairs = [f"{v[k]:{f}} / {h[k]:{f}}" for k, f in
                 (("ttft_p50_ms", ".1f"), ("ttft_p99_ms", ".1f"), ("tpot_p50_ms", ".2f"), ("output_tokens_per_s", ",.0f"))]  # fmt: skip
        lines.append(f"| {row['concurrency']} | " + " | ".join(pairs) + f" | {c['throughput_ratio']:.3f} |")
    top = overhead["results"][-1]
    bare = [r["output_tokens_per_s"] for r in top["rounds"] if r["server"] == "vllm"]
    lines += [
        "",
        "Targets: "
        + "; ".join(f"{k}: **{'met' if ok else 'NOT met'}**" for k, ok in overhead["targets"].items()),
        "",
        f"At c={top['concurrency']} bare vLLM's own rounds differ by {max(bare) / min(bare) - 1:.0%} "
        f"({', '.join(f'{x:,.0f}' for x in bare)} tok/s). Start to serving, both launched together: "
        + ", ".join(f"{k} {v:.0f} s" for k, v in overhead["startup_s"].items())
        + ".",
        "",
    ]
    return lines


def memory_section(memory: list[dict[str, Any]]) -> list[str]:
    lines = [
        "## Memory model against vLLM's log, every engine of these runs",
        "",
        "| phase | engine | layout | KV tokens predicted | logged | error | weights GiB predicted / logged |",
        "|---|---|---|---:|---:|---:|---|",
    ]
    for m in memory:
        lines.append(
            f"| {m['phase']} | {m['source']} | {m['layout']} | {m['predicted_kv_cache_tokens']:,} | "
            f"{m['kv_cache_tokens']:,} | {m['kv_error']:+.2%} | {m['predicted_weights_gib']:.2f} / "
            f"{m['weights_gib']} |"
        )
    kv_ok = all(m["kv_within_2pct"] for m in memory)
    w_ok = all(m.get("weights_within_1pct", False) for m in memory)
    lines += [
        "",
        f"{len(memory)} engines; KV tokens within ±2%: **{'all' if kv_ok else 'NOT all'}** (worst "
        f"{max(abs(m['kv_error']) for m in memory):.2%}); weights within ±1%: **{'all' if w_ok else 'NOT all'}**.",
        "",
    ]
    return lines


def placement_section(scale: dict[str, Any]) -> list[str]:
    planner, phases = scale["planner"], scale["phases"]
    choice, slo = planner["choice"], planner["slo"]
    est = {k: planner[k]["estimated_output_tokens_per_s_per_gpu"] for k in ("TP=1", "TP=2")}
    rep = {r["concurrency"]: r for r in phases["replicas"]["ladder"]}
    tp = {r["concurrency"]: r for r in phases["tp"]["ladder"]}
    lines = [
        "## Two single-GPU replicas or one TP=2 replica, behind one Serve app",
        "",
        f"Planner, for TTFT p95 <= {slo['ttft_p95_ms']:g} ms and TPOT p50 <= {slo['tpot_p50_ms']:g} ms on two "
        f"GPUs: **TP={choice['tensor_parallel_size']} x {choice['replicas']}**. {choice['reasons'][0]}.",
        f"Its estimate: TP=2 gives x{est['TP=2'] / est['TP=1']:.3f} the output tokens/s per GPU of TP=1.",
        "",
        "| c | TTFT p50 ms 2xTP1 / TP2 | TTFT p99 ms 2xTP1 / TP2 | TPOT p50 ms 2xTP1 / TP2 | output tok/s 2xTP1 / TP2 "
        "| TP2 / 2xTP1 throughput |",
        "|---:|---|---|---|---|---:|",
    ]
    for c in sorted(set(rep) & set(tp)):
        a, b = rep[c], tp[c]
        pairs = [f"{a[k]:{f}} / {b[k]:{f}}" for k, f in
                 (("ttft_p50_ms", ".1f"), ("ttft_p99_ms", ".1f"), ("tpot_p50_ms", ".2f"), ("output_tokens_per_s", ",.0f"))]  # fmt: skip
        ratio = b["output_tokens_per_s"] / a["output_tokens_per_s"]
        lines.append(f"| {c} | " + " | ".join(pairs) + f" | {ratio:.3f} |")
    lines += ["", f"The TP=2 replica was ready {phases['tp']['ready_s']:.0f} s after it was deployed.", ""]
    return lines


def autoscale_section(scale: dict[str, Any]) -> list[str]:
    a = scale["phases"]["autoscale"]
    breach = a["ttft_p95_breach_at_s"]

    def since(key: str) -> str:
        return f"{a[key] - breach:.1f}" if a.get(key) is not None and breach is not None else "-"

    return [
        "## Autoscaling: min 1, max 2 replicas, step load",
        "",
        "![autoscale](autoscale.png)",
        "",
        f"TTFT target {a['ttft_target_ms']:g} ms. Arguments: `{scale['args']['low']}` users:seconds, then "
        f"`{scale['args']['high']}` with {scale['args']['prompt_words']}-word prompts.",
        "",
        "| event | s after deploy | s after the breach |",
        "|---|---:|---:|",
        f"| first replica serving | {a['first_replica_ready_s']:.1f} | |",
        f"| load steps up | {a['step_at_s']:.1f} | |",
        f"| TTFT p95 (trailing window) above the target | {breach:.1f} | 0 |",
        f"| second replica asked for | {a['second_replica_requested_at_s']:.1f} | "
        f"{since('second_replica_requested_at_s')} |",
        f"| second replica RUNNING | {a['second_replica_running_at_s']:.1f} | "
        f"{since('second_replica_running_at_s')} |",
        "",
        *[f"Policy: `{line.split('-- ', 1)[-1]}`" for line in scale["autoscaler_log"]],
        "",
    ]


def ladder_section(out: Path) -> list[str]:
    results = ladder_report.read(out / "ladder")
    lines = [
        "## Tuning ladder ([report](ladder/report.md))",
        "",
        f"{len(results.runs)} runs of {len(results.units_planned)} engines x {len(results.plan.profiles)} "
        f"profiles; TTFT p95 SLO {results.plan.ttft_slo_ms:g} ms.",
        "",
    ]
    for analysis in ladder_report.analyses(results):
        rec = analysis.recommendation
        knee = rec.max_num_seqs.text() if rec.max_num_seqs else "-"
        lines += [f"### {analysis.profile}", "", f"- recommended: **{rec.setting}**, max_num_seqs {knee}"]
        lines += [f"- {v.feature}: {v.reason}" for v in analysis.verdicts]
        lines.append("")
    return lines


def page(run_dir: Path, out: Path, memory: list[dict[str, Any]]) -> str:
    overhead = json.loads((run_dir / "overhead" / "results.json").read_text())
    scale = json.loads((run_dir / "scale" / "scale.json").read_text())
    header = [
        "# Measurements on H200s (generated)",
        "",
        f"Written by `python -m loadtests.gpu.report` from one run of `loadtests/gpu/run.sh`. Machine: "
        f"{overhead['machine']}; versions {overhead['versions']}. Model: `{' + '.join(CONFIG)}`.",
        "",
    ]
    return "\n".join(
        header
        + overhead_section(overhead)
        + memory_section(memory)
        + placement_section(scale)
        + autoscale_section(scale)
        + ladder_section(out)
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--out", type=Path, default=Path("results/gpu"))
    parser.add_argument(
        "--only-ladder",
        action="store_true",
        help="only the ladder's parts and their merged report (out/ladder)",
    )
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.only_ladder:
        copy_ladder(args.run_dir, args.out / "ladder")
        return
    copy_phase_files(args.run_dir, args.out)
    memory = memory_rows(args.run_dir)
    (args.out / "memory.json").write_text(
        json.dumps({"predictions": predictions(), "engines": memory}, indent=2)
    )
    plot_autoscale(
        json.loads((args.run_dir / "scale" / "scale.json").read_text()), args.out / "autoscale.png"
    )
    (args.out / "report.md").write_text(page(args.run_dir, args.out, memory))


if __name__ == "__main__":
    main()
