"""Our TTFT/TPOT definitions against `vllm bench serve`'s, on the same server.

Definitions (ours: loadtests/streaming_client.py, loadtests/locustfile.py; vLLM's: vllm/benchmarks/serve.py):
- TTFT: request sent -> first streamed token. Same in both.
- TPOT: (e2e latency - TTFT) / (output tokens - 1), per request, then the median. Same formula in both.
- ITL (vLLM) is every gap between streamed chunks; our locustfile reports their mean and max per request.

Two checks, written to results/vllm_bench_agreement/:
1. Same requests: recompute TPOT from `vllm bench serve`'s own per-request latencies, TTFTs and output
   lengths with our code (loadtests.raw_stats); it must equal vLLM's reported median TPOT (1% tolerance,
   rounding only).
2. Same load, our client: our streaming client runs the same shape (prompt length, output length,
   concurrency, request count) against the same server, right after vLLM's run; medians must agree within
   the stated tolerance (TTFT: 5 ms or 30%, TPOT: 15%): separate runs on a shared machine, so noise.

    python -m loadtests.vllm_bench_agreement --url http://127.0.0.1:8000 --model tiny-qwen3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

from loadtests import vllm_bench
from loadtests.raw_stats import percentile
from loadtests.streaming_client import run_load

TTFT_TOLERANCE = (5.0, 0.30)  # ms, fraction: whichever is larger
TPOT_TOLERANCE = 0.15


def run_vllm_bench(url: str, model: str, tokenizer: str, args: argparse.Namespace, out: Path) -> dict:
    """`vllm bench serve` with its per-request records (--save-detailed), the same command line as the
    overhead benchmark's (loadtests/vllm_bench.py)."""
    workload = vllm_bench.Workload("agreement", args.input_len, args.output_len)
    argv = vllm_bench.bench_args(
        url,
        model,
        tokenizer,
        workload,
        args.concurrency,
        args.num_prompts,
        0,
        str(out),
        "vllm_bench_serve.json",
    )
    return vllm_bench.run([*argv, "--save-detailed"])


def our_tpots_from_vllm_records(result: dict) -> list[float]:
    """TPOT per request by our definition, from vLLM's own per-request numbers (seconds)."""
    return [
        (latency - ttft) / (n - 1)
        for latency, ttft, n in zip(result["latencies"], result["ttfts"], result["output_lens"], strict=True)
        if n > 1
    ]


def within(ours: float, theirs: float, abs_ms: float, rel: float) -> bool:
    return abs(ours - theirs) <= max(abs_ms, rel * theirs)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--tokenizer", help="Tokenizer path; default: the embedded tiny model's.")
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--out", type=Path, default=Path("results/vllm_bench_agreement"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    tokenizer = args.tokenizer
    if tokenizer is None:
        from serve_app.models.embedded import ensure_embedded_model

        tokenizer = str(ensure_embedded_model("embedded:tiny-qwen3"))

    vllm_result = run_vllm_bench(args.url, args.model, tokenizer, args, args.out)
    recomputed_tpot_ms = percentile(our_tpots_from_vllm_records(vllm_result), 50) * 1000
    summary, ours = asyncio.run(
        run_load(args.url, args.model, args.concurrency, args.num_prompts, args.output_len, args.input_len)
    )
    ttft_rule = f"max({TTFT_TOLERANCE[0]:g} ms, {TTFT_TOLERANCE[1]:.0%})"
    checks = {
        "same requests: our TPOT formula on vLLM's per-request data == vLLM's median TPOT (1%)": within(
            recomputed_tpot_ms, vllm_result["median_tpot_ms"], 0.0, 0.01
        ),
        f"same load, our client: median TTFT within {ttft_rule}": within(
            summary.ttft_p50_ms, vllm_result["median_ttft_ms"], *TTFT_TOLERANCE
        ),
        f"same load, our client: median TPOT within {TPOT_TOLERANCE:.0%}": within(
            summary.tpot_p50_ms, vllm_result["median_tpot_ms"], 0.0, TPOT_TOLERANCE
        ),
    }
    report = {
        "url": args.url,
        "workload": {k: getattr(args, k) for k in ("input_len", "output_len", "num_prompts", "concurrency")},
        "vllm_bench_serve": {
            k: vllm_result[k]
            for k in ("median_ttft_ms", "p95_ttft_ms", "median_tpot_ms", "median_itl_ms", "output_throughput")
        },
        "our_tpot_from_vllm_records_median_ms": recomputed_tpot_ms,
        "our_client": summary.as_dict(),
        "checks": checks,
        "command": " ".join(["python -m loadtests.vllm_bench_agreement", *sys.argv[1:]]),
    }
    (args.out / "results.json").write_text(json.dumps(report, indent=2))
    lines = [
        "# TTFT/TPOT: headroom's client against `vllm bench serve`",
        "",
        "| | vllm bench serve | ours |",
        "|---|---:|---:|",
        f"| median TTFT ms | {vllm_result['median_ttft_ms']:.2f} | {summary.ttft_p50_ms:.2f} |",
        f"| median TPOT ms | {vllm_result['median_tpot_ms']:.3f} | {summary.tpot_p50_ms:.3f} "
        f"(our formula on vLLM's records: {recomputed_tpot_ms:.3f}) |",
        f"| output tok/s | {vllm_result['output_throughput']:.0f} | {summary.output_tokens_per_s:.0f} |",
        "",
        *[f"- {'PASS' if ok else 'FAIL'}: {name}" for name, ok in checks.items()],
        "",
        f"Command: `{report['command']}`",
        "",
    ]
    (args.out / "report.md").write_text("\n".join(lines))
    print("\n".join(lines))
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
