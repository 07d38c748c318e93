"""The planner's answer, `Plan`: built in one place for every outcome, shown as JSON or as a table.

Pure: imports neither ray, vllm nor torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from serve_app.planning.latency import LatencyEstimate
from serve_app.planning.memory import MemoryEstimate
from serve_app.planning.model_bytes import bytes_to_gib
from serve_app.planning.request import PlanRequest

__all__ = ["Plan", "build_plan", "gib_text", "render_plan_table", "round_or_none", "workload_text"]


@dataclass(frozen=True)
class Plan:
    """Where and how to run the replicas, or why not. ``reasons`` always says why."""

    fits: bool
    tensor_parallel_size: int
    replicas: int
    bundles: tuple[dict[str, float], ...]
    placement_strategy: str
    # What each engine runs with: sized for the expected context, so vLLM may preempt past the guarantee.
    max_num_seqs: int
    gpu_memory_utilization: float
    kv_cache_tokens_per_replica: int
    # vLLM's "Maximum concurrency for max_model_len tokens per request".
    max_concurrency_per_replica: float
    weights_gib_per_gpu: float
    kv_bytes_per_token: int
    reasons: tuple[str, ...]
    warnings: tuple[str, ...]
    accelerator: str
    gpu_type: str | None
    max_model_len: int
    max_num_batched_tokens: int
    # The expected sequence (workload prompt + output tokens) and how many of them the KV cache holds.
    expected_context_tokens: int
    max_concurrency_at_expected_context: float
    # The worst-case guarantee: sequences that all fit even if each reached max_model_len.
    max_num_seqs_without_preemption: int
    # Concurrency per replica at which the latency estimates hold (the SLO limit, or max_num_seqs).
    planned_concurrency_per_replica: int = 0
    estimated_tpot_p50_ms: float | None = None
    estimated_ttft_p95_ms: float | None = None
    estimated_output_tokens_per_s_per_gpu: float | None = None
    memory: MemoryEstimate | None = field(default=None, compare=False)
    alternatives: tuple[dict[str, Any], ...] = ()

    def to_json(self) -> dict[str, Any]:
        """Plain-JSON dict (for ``headroom plan --json`` and the app builder)."""
        return {
            "fits": self.fits,
            "accelerator": self.accelerator,
            "gpu_type": self.gpu_type,
            "tensor_parallel_size": self.tensor_parallel_size,
            "replicas": self.replicas,
            "bundles": [dict(b) for b in self.bundles],
            "placement_strategy": self.placement_strategy,
            "max_num_seqs": self.max_num_seqs,
            "max_num_seqs_without_preemption": self.max_num_seqs_without_preemption,
            "max_model_len": self.max_model_len,
            "expected_context_tokens": self.expected_context_tokens,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "gpu_memory_utilization": self.gpu_memory_utilization,
            "kv_cache_tokens_per_replica": self.kv_cache_tokens_per_replica,
            "max_concurrency_per_replica": round(self.max_concurrency_per_replica, 2),
            "max_concurrency_at_expected_context": round_or_none(self.max_concurrency_at_expected_context, 2),
            "planned_concurrency_per_replica": self.planned_concurrency_per_replica,
            "weights_gib_per_gpu": round(self.weights_gib_per_gpu, 3),
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "estimated_tpot_p50_ms": round_or_none(self.estimated_tpot_p50_ms),
            "estimated_ttft_p95_ms": round_or_none(self.estimated_ttft_p95_ms),
            "estimated_output_tokens_per_s_per_gpu": round_or_none(
                self.estimated_output_tokens_per_s_per_gpu
            ),
            "reasons": list(self.reasons),
            "warnings": list(self.warnings),
            "memory": self.memory.to_dict() if self.memory else None,
            "alternatives": [dict(a) for a in self.alternatives],
        }


def build_plan(
    req: PlanRequest,
    tp: int,
    memory: MemoryEstimate | None,
    reasons: tuple[str, ...] | list[str],
    warnings: tuple[str, ...] | list[str] = (),
    *,
    replicas: int = 0,
    max_num_seqs: int = 0,
    estimate: LatencyEstimate | None = None,
    planned_concurrency: int = 0,
    alternatives: tuple[dict[str, Any], ...] = (),
) -> Plan:
    """The one place a Plan is made. It fits when it places replicas; ``memory`` is None only when no
    memory estimate exists (an impossible tensor-parallel size)."""
    gpu = req.cluster.gpu
    on_gpu = req.accelerator == "gpu"
    expected = req.expected_context_tokens
    weights_bytes = memory.weights_bytes + memory.draft_weights_bytes if memory else 0
    return Plan(
        fits=replicas > 0,
        tensor_parallel_size=tp,
        replicas=replicas,
        bundles=_bundles(req, tp) if replicas > 0 else (),
        placement_strategy="STRICT_PACK" if tp > 1 else "PACK",
        max_num_seqs=max_num_seqs,
        gpu_memory_utilization=req.gpu_memory_utilization,
        kv_cache_tokens_per_replica=memory.kv_cache_tokens if memory else 0,
        max_concurrency_per_replica=memory.max_concurrency if memory else 0.0,
        weights_gib_per_gpu=bytes_to_gib(weights_bytes),
        kv_bytes_per_token=memory.kv_bytes_per_token if memory else 0,
        reasons=tuple(reasons),
        warnings=tuple(warnings),
        accelerator=req.accelerator,
        gpu_type=gpu.name if gpu and on_gpu else None,
        max_model_len=req.resolved_max_model_len,
        max_num_batched_tokens=memory.max_num_batched_tokens if memory else 0,
        expected_context_tokens=expected,
        max_concurrency_at_expected_context=(
            memory.concurrency_for(expected, req.prefix_reuse_fraction) if memory else 0.0
        ),
        max_num_seqs_without_preemption=memory.seqs_without_preemption if memory else 0,
        planned_concurrency_per_replica=planned_concurrency,
        estimated_tpot_p50_ms=estimate.tpot_p50_ms if estimate else None,
        estimated_ttft_p95_ms=estimate.ttft_p95_ms if estimate else None,
        estimated_output_tokens_per_s_per_gpu=estimate.output_tokens_per_s / tp if estimate else None,
        memory=memory,
        alternatives=alternatives,
    )


def _bundles(req: PlanRequest, tp: int) -> tuple[dict[str, float], ...]:
    # One bundle per TP rank; the first also hosts the replica actor, so it carries the replica's CPUs.
    first_cpus = max(1.0, req.num_cpus_per_replica)
    if req.accelerator == "cpu":
        return ({"CPU": first_cpus},)
    return tuple({"GPU": 1, "CPU": first_cpus if rank == 0 else 1} for rank in range(tp))


def round_or_none(value: float | None, digits: int = 1) -> float | None:
    """Rounded for JSON, which has no infinity (a prefill that cannot keep up has an infinite TTFT)."""
    return None if value is None or math.isinf(value) else round(value, digits)


def gib_text(n_bytes: float) -> str:
    return f"{bytes_to_gib(n_bytes):,.2f} GiB"


def workload_text(req: PlanRequest) -> str:
    """The expected request, as the planner sized for it."""
    return (
        f"workload: {req.prompt_tokens:,} prompt + {req.output_tokens:,} output tokens, prefix reuse "
        f"{req.prefix_reuse_fraction:.0%}"
    )


# ============================================================================================ rendering
def render_plan_table(plan: Plan) -> str:
    """The plan as a plain-text table (the CLI may dress it up with Rich)."""
    rows = _summary_rows(plan) + _memory_rows(plan) + _latency_rows(plan)
    width = max(len(k) for k, _ in rows)
    lines = [f"{k.ljust(width)}  {v}" for k, v in rows]
    rule = "-" * max(len(line) for line in lines)
    out = [rule, *lines, rule]
    out += [f"reason: {r}" for r in plan.reasons]
    out += [f"warning: {w}" for w in plan.warnings]
    return "\n".join(out)


def _summary_rows(plan: Plan) -> list[tuple[str, str]]:
    where = f"{plan.gpu_type} x{plan.tensor_parallel_size}" if plan.accelerator == "gpu" else "CPU"
    expected = plan.max_concurrency_at_expected_context
    return [
        ("fits", "yes" if plan.fits else "NO"),
        ("accelerator", where),
        ("tensor_parallel_size", str(plan.tensor_parallel_size)),
        ("replicas", str(plan.replicas)),
        ("placement", f"{plan.placement_strategy} {list(plan.bundles)}" if plan.bundles else "-"),
        ("max_model_len", f"{plan.max_model_len:,}"),
        ("max_num_seqs", f"{plan.max_num_seqs} (sized for {plan.expected_context_tokens:,}-token sequences)"),
        ("  without preemption", f"{plan.max_num_seqs_without_preemption} (all at max_model_len)"),
        (
            "max_num_batched_tokens",
            f"{plan.max_num_batched_tokens:,}" if plan.max_num_batched_tokens else "-",
        ),
        ("gpu_memory_utilization", f"{plan.gpu_memory_utilization:g}"),
        ("weights per GPU", f"{plan.weights_gib_per_gpu:,.2f} GiB"),
        ("KV bytes per token", f"{plan.kv_bytes_per_token:,} ({plan.kv_bytes_per_token / 1024:,.1f} KiB)"),
        ("KV cache per replica", f"{plan.kv_cache_tokens_per_replica:,} tokens"),
        ("max concurrency", f"{plan.max_concurrency_per_replica:,.2f} at {plan.max_model_len:,} tokens"),
        ("  at expected context", f"{expected:,.2f} at {plan.expected_context_tokens:,} tokens"),
    ]


def _memory_rows(plan: Plan) -> list[tuple[str, str]]:
    mem = plan.memory
    if mem is None or plan.accelerator != "gpu":
        return []
    graphs = gib_text(mem.cudagraph_bytes) + ("" if mem.cudagraph_subtracted else " (outside budget)")
    return [
        ("budget per GPU", gib_text(mem.requested_bytes)),
        ("  activation peak", gib_text(mem.activation_peak_bytes)),
        ("  non-torch", gib_text(mem.non_torch_bytes)),
        ("  CUDA graphs", graphs),
        ("  draft weights", gib_text(mem.draft_weights_bytes)),
        ("  KV cache", gib_text(mem.kv_cache_bytes)),
    ]


def _latency_rows(plan: Plan) -> list[tuple[str, str]]:
    if plan.estimated_tpot_p50_ms is None:
        return []
    ttft = plan.estimated_ttft_p95_ms
    return [
        ("planned concurrency", str(plan.planned_concurrency_per_replica)),
        ("est. TPOT p50", f"{plan.estimated_tpot_p50_ms:,.1f} ms"),
        ("est. TTFT p95", f"{ttft:,.0f} ms" if ttft else "-"),
        ("est. output tok/s/GPU", f"{plan.estimated_output_tokens_per_s_per_gpu or 0:,.0f}"),
    ]
