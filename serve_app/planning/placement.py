"""Placement planner: from a model, a cluster, the expected traffic and the SLOs to tensor-parallel size,
replicas, bundles and max_num_seqs.

``plan(PlanRequest) -> Plan`` is a pure function. It

1. enumerates the tensor-parallel sizes vLLM accepts within one node (1, 2, 4, 8 dividing the attention heads,
   KV heads and MLP widths; a user-given size is the only candidate; 1 on the CPU backend);
2. sizes each one with the memory model (:mod:`serve_app.planning.memory`): weights, activation peak,
   runtime buffers, draft model, and the KV blocks left;
3. estimates TPOT and TTFT with the roofline latency model (:mod:`serve_app.planning.latency`) and finds, per
   size, the highest concurrency per replica that meets the SLO within max_num_seqs;
4. picks the size with the most output tokens per second per GPU among those that meet the SLO: a model that
   fits one GPU may still get a TP group if single-GPU replicas cannot meet a tight TPOT; a model that does
   not fit one GPU must use TP;
5. or refuses (:mod:`serve_app.planning.refusal`) with vLLM's error template: need versus supply with units,
   the largest value that would fit, and which setting to change, each alternative computed.

max_num_seqs and preemption. vLLM admits a sequence when its prompt's KV blocks are free; when the running
sequences grow past the cache it preempts the newest and recomputes it later. It refuses to start only when
one max_model_len request cannot fit. Real traffic averages far below max_model_len, so the planner sizes
max_num_seqs for the expected sequence, ``workload.prompt_tokens + workload.output_tokens`` (a shared prefix
stored once with prefix caching), by the seeds' formula KV cache = concurrency x context x bytes per token:

* max_num_seqs = the configured value, lowered (with a warning giving the numbers and the levers) to the
  sequences of the expected context the KV cache holds: past that, sequences would keep preempting each
  other;
* beside it the worst-case guarantee, ``max_num_seqs_without_preemption``: how many fit if every sequence
  reached max_model_len. Where max_num_seqs is above it, the plan warns that it counts on preemption;
* the plan is refused only where vLLM itself would fail, or where the user forbade lowering:
  the weights and runtime leave no KV cache, or the cache cannot hold one max_model_len request (the seeds'
  pitfall - Qwen3-32B bf16, max_num_seqs 512, 40,960 tokens on one H100 - is this case, and its refusal
  gives the 512-sequence arithmetic at both lengths); or ``require_max_num_seqs`` is set and fewer than
  max_num_seqs sequences of the expected context fit.
  An overshoot, however large, is otherwise lowered, not refused: the lowered value is a deployment that
  runs the concurrency its cache holds, while a refusal would turn away configs vLLM serves (vLLM's default
  256 sequences on an L4, say); the warning carries the need versus supply all the same.

Pure: imports neither ray, vllm nor torch.
"""

from __future__ import annotations

import math

from serve_app.planning.latency import estimate_latency
from serve_app.planning.memory import CUDA_CONTEXT_BYTES, MemoryEstimate, blocks_for_requests, estimate_memory
from serve_app.planning.options import TpOption, evaluate, valid_tensor_parallel_sizes
from serve_app.planning.refusal import refuse, refuse_invalid_tp
from serve_app.planning.request import CPU_KV_CACHE_SPACE_DEFAULT_GIB, ClusterSpec, PlanRequest
from serve_app.planning.result import Plan, build_plan, gib_text, workload_text

# The planner's inputs and output are importable from here too (serving and rollout import them so).
__all__ = ["ClusterSpec", "Plan", "PlanRequest", "plan"]

# Larger TP must beat smaller TP by more than 5 % output tokens/s/GPU to be chosen.
TP_TIE_MARGIN = 0.95


def plan(req: PlanRequest) -> Plan:
    """Plan replicas for ``req``: the chosen tensor-parallel size and limits with reasons, or a refusal."""
    sizes = _candidate_sizes(req)
    if isinstance(sizes, Plan):
        return sizes
    options = [evaluate(req, tp) for tp in sizes]
    fitting = [o for o in options if o.fits]
    if not fitting:
        return refuse(req, options[-1], options)
    if req.accelerator == "cpu":
        chosen, reasons, warnings = fitting[0], _cpu_reasons(fitting[0]), _cpu_warnings(req)
    else:
        chosen, reasons, warnings = _choose(req, fitting, options)
    if chosen.cap < req.max_num_seqs and req.require_max_num_seqs:
        return refuse(req, chosen, options, strict_seqs=True)
    max_num_seqs = max(1, chosen.cap)
    warnings += _max_num_seqs_warnings(req, chosen, max_num_seqs)
    if req.speculative is not None and req.accelerator == "gpu":
        warnings.append(_speculation_warning(req, chosen))
    if chosen.memory.headroom_after_graphs_bytes < 0:
        warnings.append(_graph_headroom_warning(chosen.memory))
    est = chosen.estimate
    return build_plan(
        req,
        chosen.tp,
        chosen.memory,
        reasons,
        warnings,
        replicas=chosen.replicas,
        max_num_seqs=max_num_seqs,
        estimate=est,
        planned_concurrency=min(chosen.slo_concurrency or 1, max_num_seqs) if est else max_num_seqs,
        alternatives=tuple(o.summary() for o in options),
    )


def _candidate_sizes(req: PlanRequest) -> list[int] | Plan:
    """The tensor-parallel sizes to evaluate, or the refusal of an impossible one."""
    forced = req.tensor_parallel_size
    if req.accelerator == "cpu":
        if forced is not None and forced != 1:
            return refuse_invalid_tp(req, forced, "the CPU accelerator runs one rank per replica")
        return [1]
    verdicts = valid_tensor_parallel_sizes(req.model, req.cluster.gpus_per_node)
    if forced is not None:
        why = verdicts[forced]
        return [forced] if why is None else refuse_invalid_tp(req, forced, why)
    sizes = [size for size, why in verdicts.items() if why is None]
    if not sizes:
        return refuse_invalid_tp(req, 1, "; ".join(f"TP={t}: {w}" for t, w in verdicts.items() if w))
    return sizes


# ============================================================================================ choosing
def _choose(
    req: PlanRequest, fitting: list[TpOption], options: list[TpOption]
) -> tuple[TpOption, list[str], list[str]]:
    """The GPU option to run, the reasons for it and any warning about the SLO."""
    meeting = [o for o in fitting if o.meets_slo]
    warnings: list[str] = []
    if req.tensor_parallel_size is not None:
        chosen = fitting[0]
        reasons = [f"TP={chosen.tp} as requested (tensor_parallel_size)"]
    elif meeting:
        chosen = _most_throughput(meeting)
        reasons = [_throughput_reason(req, chosen, options)]
    else:
        chosen = min(fitting, key=lambda o: (o.estimate.tpot_p50_ms if o.estimate else math.inf, o.tp))
        reasons, warnings = _closest_to_slo(req, chosen)
    return chosen, reasons + _fit_reasons(req, chosen, options, bool(meeting)), warnings


def _most_throughput(meeting: list[TpOption]) -> TpOption:
    # Within 5 % of the best, the smaller TP wins: fewer GPUs per failure, no NCCL, simpler placement.
    best = max(o.tokens_per_s_per_gpu for o in meeting)
    return min((o for o in meeting if o.tokens_per_s_per_gpu >= TP_TIE_MARGIN * best), key=lambda o: o.tp)


def _throughput_reason(req: PlanRequest, chosen: TpOption, options: list[TpOption]) -> str:
    others = ", ".join(
        f"TP={o.tp}: {o.tokens_per_s_per_gpu:,.0f}" for o in options if o is not chosen and o.meets_slo
    )
    layout = (
        f"{_plural(chosen.replicas, 'independent single-GPU replica')}"
        if chosen.tp == 1
        else f"{_plural(chosen.replicas, f'TP={chosen.tp} bundle')} of {chosen.tp} GPUs"
    )
    within = f"within {_slo_text(req)}" if _has_slo(req) else "(no latency SLO given)"
    return (
        f"TP={chosen.tp} gives the most output throughput per GPU {within}: {layout}, est. "
        f"{chosen.tokens_per_s_per_gpu:,.0f} tok/s/GPU at {chosen.slo_concurrency} concurrent "
        "sequences per replica" + (f" (vs {others} tok/s/GPU)" if others else "")
    )


def _closest_to_slo(req: PlanRequest, chosen: TpOption) -> tuple[list[str], list[str]]:
    est = chosen.estimate
    assert est is not None  # a fitting GPU option is always timed
    reason = (
        f"no tensor-parallel size meets {_slo_text(req)} at any concurrency; TP={chosen.tp} comes "
        f"closest (est. TPOT p50 {est.tpot_p50_ms:.1f} ms, TTFT p95 {est.ttft_p95_ms:.0f} ms at "
        "concurrency 1)"
    )
    warning = (
        f"SLO not met: {_slo_text(req)} is out of reach on "
        f"{req.cluster.gpu.name if req.cluster.gpu else 'GPU'} by the roofline estimate; relax the SLO, "
        "quantize (fp8), shorten prompts or use a faster GPU"
    )
    return [reason], [warning]


def _fit_reasons(req: PlanRequest, chosen: TpOption, options: list[TpOption], slo_met: bool) -> list[str]:
    """Whether the model fits one GPU, and why a TP group anyway; how MoE was sized."""
    reasons = []
    one_gpu = next((o for o in options if o.tp == 1), None)
    if one_gpu is not None and one_gpu.fits:
        reasons.append(f"the model fits one GPU: {_fits_one_gpu_text(one_gpu)}")
        if chosen.tp > 1 and slo_met and not one_gpu.meets_slo:
            single = one_gpu.estimate
            detail = f" (best at concurrency 1: TPOT {single.tpot_p50_ms:.1f} ms)" if single else ""
            reasons.append(f"single-GPU replicas cannot meet {_slo_text(req)}{detail}, so TP={chosen.tp}")
    elif one_gpu is not None:
        reasons.append(
            f"the model does not fit one GPU: {_does_not_fit_text(one_gpu)}; TP={chosen.tp} is needed"
        )
    elif chosen.tp > 1 and req.tensor_parallel_size is None:
        reasons.append("the model does not fit one GPU: TP=1 is not a valid shard for it")
    if req.model.is_moe:
        reasons.append(
            f"MoE: weights sized by all {req.model.num_experts} experts "
            f"({gib_text(chosen.memory.weights_bytes)}/GPU), compute by the {req.model.num_experts_per_tok} "
            "active ones"
        )
    return reasons


def _cpu_reasons(chosen: TpOption) -> list[str]:
    mem = chosen.memory
    return [
        f"CPU backend: one rank per replica, {chosen.replicas} replica(s); "
        f"{gib_text(mem.kv_cache_available_bytes)} KV cache (cpu_kv_cache_space_gib) = "
        f"{mem.kv_cache_tokens:,} tokens in {mem.block_size}-token blocks",
        "latency is not modelled on CPU; measure it with the tuning ladder",
    ]


def _cpu_warnings(req: PlanRequest) -> list[str]:
    if req.cpu_kv_cache_space_gib is not None:
        return []
    return [
        f"cpu_kv_cache_space_gib not set; planned with {CPU_KV_CACHE_SPACE_DEFAULT_GIB:g} GiB (set it: "
        "vLLM's CPU default varies)"
    ]


# ============================================================================================ warnings
def _max_num_seqs_warnings(req: PlanRequest, chosen: TpOption, max_num_seqs: int) -> list[str]:
    """max_num_seqs lowered to what the expected context allows; and the worst-case guarantee when
    max_num_seqs counts on preemption (the seeds' formula: KV cache = concurrency x context x bytes)."""
    mem, out = chosen.memory, []
    length, expected = req.resolved_max_model_len, req.expected_context_tokens
    workload = workload_text(req)
    if max_num_seqs < req.max_num_seqs:
        levers = ("fp8 KV cache (kv_cache_dtype), " if req.kv_cache_dtype == "auto" else "") + (
            "quantized weights, more prefix reuse or a larger TP"
        )
        out.append(
            f"max_num_seqs lowered from {req.max_num_seqs} to {max_num_seqs}: the KV cache holds "
            f"{mem.kv_cache_tokens:,} tokens per replica = {chosen.kv_concurrency:.1f} sequences of the "
            f"expected {expected:,} tokens ({workload}); more would keep preempting each other. Raise it "
            f"with {levers}"
        )
    worst = mem.seqs_without_preemption
    if max_num_seqs > worst:
        need = blocks_for_requests(max_num_seqs, mem.block_size, length) * mem.kv_bytes_per_block
        out.append(
            f"max_num_seqs {max_num_seqs} counts on preemption: it is sized for the expected "
            f"{expected:,}-token sequence ({workload}). If every sequence reached max_model_len, "
            f"{max_num_seqs} x {length:,} tokens x {mem.kv_bytes_per_token:,} bytes = {gib_text(need)} of KV "
            f"cache would be needed, against {gib_text(mem.kv_cache_bytes)}: {worst} are guaranteed, and "
            "vLLM would preempt the newest of the rest and recompute them later. For the guarantee, set "
            f"max_num_seqs <= {worst}"
        )
    return out


def _speculation_warning(req: PlanRequest, chosen: TpOption) -> str:
    spec, gpu = req.speculative, req.cluster.gpu
    assert spec is not None and gpu is not None
    plain_req = req.model_copy(
        update={
            "speculative_method": None,
            "num_speculative_tokens": 0,
            "draft_model": None,
            "parallel_drafting": False,
        }
    )
    plain_mem = estimate_memory(plain_req.memory_inputs(chosen.tp))
    conc = max(1, min(chosen.cap, 64))
    with_spec = estimate_latency(req, chosen.memory, gpu, conc)
    without = estimate_latency(plain_req, plain_mem, gpu, conc)
    return (
        f"speculative decoding ({spec.method}, {spec.num_speculative_tokens} tokens, assumed acceptance "
        f"{spec.acceptance_rate:.0%}) trades TTFT for TPOT: at concurrency {conc} est. TPOT "
        f"{without.tpot_p50_ms:.1f} -> {with_spec.tpot_p50_ms:.1f} ms, TTFT p95 {without.ttft_p95_ms:.0f} "
        f"-> {with_spec.ttft_p95_ms:.0f} ms; draft weights {gib_text(chosen.memory.draft_weights_bytes)}/GPU "
        f"and {chosen.memory.draft_kv_bytes_per_token:,} KV bytes/token. Longer steps raise TTFT under load: "
        "judge TTFT and TPOT on your own workload (`headroom ladder`), not throughput alone"
    )


def _graph_headroom_warning(mem: MemoryEstimate) -> str:
    free_share = (mem.gpu_memory_bytes - mem.cudagraph_bytes - CUDA_CONTEXT_BYTES) / mem.gpu_memory_bytes
    return (
        f"CUDA graphs ({gib_text(mem.cudagraph_bytes)}) and the CUDA context need more than the "
        f"{gib_text(mem.gpu_memory_bytes - mem.requested_bytes)} left outside gpu_memory_utilization "
        f"{mem.gpu_memory_utilization:g}; lower it to <= {math.floor(free_share * 100) / 100:.2f} or "
        "set enforce_eager"
    )


# ================================================================================================ text
def _slo_text(req: PlanRequest) -> str:
    parts = []
    if req.ttft_p95_ms is not None:
        parts.append(f"TTFT p95 <= {req.ttft_p95_ms:g} ms")
    if req.tpot_p50_ms is not None:
        parts.append(f"TPOT p50 <= {req.tpot_p50_ms:g} ms")
    return " and ".join(parts) if parts else "no latency SLO"


def _has_slo(req: PlanRequest) -> bool:
    return req.ttft_p95_ms is not None or req.tpot_p50_ms is not None


def _plural(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _fits_one_gpu_text(opt: TpOption) -> str:
    mem = opt.memory
    budget = (
        f"{gib_text(mem.requested_bytes)} ({mem.gpu_memory_utilization:g} x {gib_text(mem.gpu_memory_bytes)})"
    )
    return (
        f"{gib_text(mem.weights_bytes + mem.draft_weights_bytes)} of weights fit one GPU's budget of "
        f"{budget}, leaving {mem.kv_cache_tokens:,} KV tokens"
    )


def _does_not_fit_text(opt: TpOption) -> str:
    mem = opt.memory
    overhead = mem.activation_peak_bytes + mem.non_torch_bytes
    if mem.kv_cache_available_bytes <= 0:
        return (
            f"weights {gib_text(mem.weights_bytes + mem.draft_weights_bytes)} + activations/runtime "
            f"{gib_text(overhead)} exceed the budget {gib_text(mem.requested_bytes)} at TP={opt.tp}"
        )
    return (
        f"at TP={opt.tp} only {mem.kv_cache_tokens:,} KV tokens remain, fewer than one "
        f"{mem.max_model_len:,}-token request needs"
    )
