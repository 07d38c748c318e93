"""Refusals in vLLM's error template: need versus supply with units, the largest value that would fit, and
which setting to change, each alternative computed by the memory model.

Pure: imports neither ray, vllm nor torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from serve_app.config.vocabulary import TENSOR_PARALLEL_SIZES
from serve_app.planning.memory import MemoryEstimate, blocks_for_requests, estimate_memory
from serve_app.planning.model_bytes import bytes_to_gib, cdiv
from serve_app.planning.options import TpOption, valid_tensor_parallel_sizes
from serve_app.planning.request import PlanRequest
from serve_app.planning.result import Plan, build_plan, gib_text, workload_text

__all__ = ["refuse", "refuse_invalid_tp"]


def refuse(req: PlanRequest, opt: TpOption, options: list[TpOption], strict_seqs: bool = False) -> Plan:
    """A plan that does not fit: vLLM would not start (no KV cache left, or not one max_model_len request),
    or (``strict_seqs``, require_max_num_seqs) max_num_seqs sequences of the expected context do not fit."""
    reasons = [_headline(req, opt), *_memory_reasons(req, opt)]
    seqs = _seqs_reason(req, opt, strict_seqs)
    if seqs is not None:
        reasons.append(seqs)
    need = _Need(req, req.max_num_seqs if strict_seqs else None)
    reasons.append("Change one of: " + "; ".join(_suggestions(req, opt, need)) + ".")
    return build_plan(
        req,
        opt.tp,
        opt.memory,
        reasons,
        max_num_seqs=opt.cap if opt.fits else 0,
        alternatives=tuple(o.summary() for o in options),
    )


def refuse_invalid_tp(req: PlanRequest, tp: int, why: str) -> Plan:
    valid = [
        t for t, w in valid_tensor_parallel_sizes(req.model, req.cluster.gpus_per_node).items() if w is None
    ]
    hint = f"use one of {valid} or null to let the planner choose" if valid else "use nodes with more GPUs"
    reasons = (f"won't fit: tensor_parallel_size={tp} is not possible here: {why}", f"Change: {hint}.")
    return build_plan(req, tp, None, reasons)


# ============================================================================================== reasons
def _unit(req: PlanRequest) -> str:
    return "per GPU" if req.accelerator == "gpu" else "per replica"


def _headline(req: PlanRequest, opt: TpOption) -> str:
    mem, gpu = opt.memory, req.cluster.gpu
    where = f"{req.cluster.total_gpus} x {gpu.name if gpu else 'GPU'}"
    where = where if req.accelerator == "gpu" else "the CPU backend"
    weights_bytes = mem.weights_bytes + mem.draft_weights_bytes
    weights = f"{gib_text(weights_bytes)} of weights {_unit(req)} at TP={opt.tp}"
    return (
        f"won't fit: {req.model.name} ({mem.quantization.description}, {weights}, max_model_len "
        f"{req.resolved_max_model_len:,}, max_num_seqs {req.max_num_seqs}) on {where}"
    )


def _memory_reasons(req: PlanRequest, opt: TpOption) -> list[str]:
    """Why vLLM would not start: no memory left for the KV cache, or not one max_model_len request."""
    mem, length = opt.memory, req.resolved_max_model_len
    if mem.kv_cache_available_bytes <= 0:
        overhead = mem.activation_peak_bytes + mem.non_torch_bytes
        return [
            f"Weights need {gib_text(mem.weights_bytes + mem.draft_weights_bytes)} per GPU and "
            f"activations/runtime {gib_text(overhead)}, which is larger than the budget of "
            f"{gib_text(mem.requested_bytes)} (gpu_memory_utilization {mem.gpu_memory_utilization:g} x "
            f"{gib_text(mem.gpu_memory_bytes)}); no memory is left for the KV cache (short by "
            f"{gib_text(-mem.kv_cache_available_bytes)})."
        ]
    if mem.fits_one_request:
        return []
    supply = "available KV cache memory" if req.accelerator == "gpu" else "cpu_kv_cache_space_gib"
    one_request_bytes = cdiv(length, mem.block_size) * mem.kv_bytes_per_block
    return [
        f"To serve at least one request with max_model_len ({length:,}), {gib_text(one_request_bytes)} KV "
        f"cache is needed {_unit(req)}, which is larger than the {supply} "
        f"({gib_text(mem.kv_cache_available_bytes)} = {mem.kv_cache_tokens:,} tokens). Based on the "
        f"available memory, the largest max_model_len that fits is {mem.largest_max_model_len():,}."
    ]


def _seqs_reason(req: PlanRequest, opt: TpOption, strict: bool) -> str | None:
    """The seeds' formula, KV cache = concurrency x context x bytes per token, at the expected context and
    at max_model_len, against what the KV cache holds."""
    mem, seqs = opt.memory, req.max_num_seqs
    worst = mem.seqs_without_preemption
    if not strict and seqs <= max(1, worst):
        return None
    length, expected = req.resolved_max_model_len, req.expected_context_tokens
    reuse = req.prefix_reuse_fraction
    need_expected = blocks_for_requests(seqs, mem.block_size, expected, reuse) * mem.kv_bytes_per_block
    need_worst = blocks_for_requests(seqs, mem.block_size, length) * mem.kv_bytes_per_block
    return (
        f"max_num_seqs={seqs} sequences need {gib_text(need_expected)} of KV cache {_unit(req)} at the "
        f"expected {expected:,} tokens each ({workload_text(req)}) and {gib_text(need_worst)} at "
        f"max_model_len {length:,}; the KV cache holds {gib_text(mem.kv_cache_bytes)} = "
        f"{mem.kv_cache_tokens:,} tokens: {opt.kv_concurrency:,.1f} sequences at the expected context, "
        f"{worst} at max_model_len"
        + (" (require_max_num_seqs is set, so max_num_seqs is not lowered)" if strict else "")
        + "."
    )


# ========================================================================================= alternatives
def _alternative(req: PlanRequest, tp: int, **overrides: Any) -> MemoryEstimate | None:
    try:
        return estimate_memory(req.memory_inputs(tp, **overrides))
    except ValueError:
        return None


@dataclass(frozen=True)
class _Need:
    """What a refused request needs: one max_model_len request, or (require_max_num_seqs) max_num_seqs
    sequences of the expected context."""

    req: PlanRequest
    seqs: int | None

    def verdict(self, mem: MemoryEstimate | None) -> tuple[bool, str]:
        if mem is None or mem.kv_cache_available_bytes <= 0:
            return False, "no room left for the KV cache"
        if self.seqs is None:
            ok = mem.fits_one_request
            return ok, f"{mem.kv_cache_tokens:,} KV tokens" + ("" if ok else ", still short")
        conc = mem.concurrency_for(self.req.expected_context_tokens, self.req.prefix_reuse_fraction)
        ok = mem.fits_one_request and conc >= self.seqs
        return ok, f"room for {conc:,.1f} of the {self.seqs} sequences" + ("" if ok else ", still short")


def _suggestions(req: PlanRequest, opt: TpOption, need: _Need) -> list[str]:
    """Each setting that could make it fit, with the value computed (vLLM's template: which knob, to what)."""
    out = _length_or_seqs_levers(req, opt, need)
    if req.accelerator == "cpu":
        return out + _cpu_levers(req, opt, need)
    out += _quantization_levers(req, opt, need)
    out += _kv_and_utilization_levers(req, opt, need)
    out.append(_more_gpus_lever(req, opt, need))
    return out


def _length_or_seqs_levers(req: PlanRequest, opt: TpOption, need: _Need) -> list[str]:
    if need.seqs is not None:
        return [f"lower max_num_seqs to <= {max(1, opt.cap)} or unset require_max_num_seqs"]
    largest_len = opt.memory.largest_max_model_len()
    if 16 <= largest_len < req.resolved_max_model_len:
        return [f"lower max_model_len to <= {largest_len:,} (fits at TP={opt.tp} as configured)"]
    return []


def _cpu_levers(req: PlanRequest, opt: TpOption, need: _Need) -> list[str]:
    mem = opt.memory
    if need.seqs is None:
        blocks = cdiv(req.resolved_max_model_len, mem.block_size)
    else:
        context, reuse = req.expected_context_tokens, req.prefix_reuse_fraction
        blocks = blocks_for_requests(need.seqs, mem.block_size, context, reuse)
    need_gib = bytes_to_gib((blocks + 1) * mem.kv_bytes_per_block)  # + vLLM's null block
    out = [f"raise cpu_kv_cache_space_gib to >= {math.ceil(need_gib * 100) / 100:,.2f}"]
    if req.kv_cache_dtype == "auto":
        _, text = need.verdict(_alternative(req, opt.tp, kv_cache_dtype="fp8"))
        out.append(f"kv_cache_dtype='fp8' -> {text}")
    return out


def _quantization_levers(req: PlanRequest, opt: TpOption, need: _Need) -> list[str]:
    mem, tp, gpu = opt.memory, opt.tp, req.cluster.gpu
    if mem.quantization.bytes_per_weight <= 1.05:
        return []
    out = []
    fp8 = _alternative(req, tp, quantization="fp8")
    if fp8 is not None:
        kind = "" if gpu is None or gpu.fp8_dense_tflops else f" (weight-only Marlin kernels on {gpu.name})"
        _, text = need.verdict(fp8)
        out.append(
            f"quantize: quantization='fp8'{kind} -> weights {gib_text(fp8.weights_bytes)}/GPU at TP={tp}, "
            f"{text}"
        )
    awq = _alternative(req, tp, quantization="awq_marlin")
    if awq is not None:
        _, text = need.verdict(awq)
        out.append(
            f"or serve an int4 AWQ/GPTQ checkpoint -> weights {gib_text(awq.weights_bytes)}/GPU, {text}"
        )
    return out


def _kv_and_utilization_levers(req: PlanRequest, opt: TpOption, need: _Need) -> list[str]:
    mem, tp = opt.memory, opt.tp
    out = []
    kv8 = _alternative(req, tp, kv_cache_dtype="fp8") if req.kv_cache_dtype == "auto" else None
    if kv8 is not None and mem.kv_cache_available_bytes > 0:
        _, text = need.verdict(kv8)
        out.append(
            f"kv_cache_dtype='fp8' halves KV bytes per token ({mem.kv_bytes_per_token:,} -> "
            f"{kv8.kv_bytes_per_token:,}): {text}"
        )
    if req.gpu_memory_utilization < 0.95:
        ok, text = need.verdict(_alternative(req, tp, gpu_memory_utilization=0.95))
        if ok:
            out.append(f"raise gpu_memory_utilization to 0.95 -> {text}")
    return out


def _more_gpus_lever(req: PlanRequest, opt: TpOption, need: _Need) -> str:
    """The smallest larger TP that would fit, whatever the cluster has."""
    gpus_per_node = req.cluster.gpus_per_node
    for bigger in (t for t in TENSOR_PARALLEL_SIZES if t > opt.tp):
        if valid_tensor_parallel_sizes(req.model, 16)[bigger] is not None:
            continue
        alt = _alternative(req, bigger)
        ok, text = need.verdict(alt)
        if ok and alt is not None:
            where = ""
            if bigger > gpus_per_node:
                where = f"; nodes here have {gpus_per_node} GPU(s), so add GPUs per node"
            return (
                f"more GPUs: tensor_parallel_size={bigger} fits ({gib_text(alt.weights_bytes)} weights/GPU, "
                f"{text}){where}"
            )
    return (
        "more GPUs alone will not do: it does not fit even at TP=8 in one node, and headroom does not "
        "plan pipeline parallelism across nodes; quantize"
    )
