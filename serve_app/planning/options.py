"""The tensor-parallel sizes a model can take, each sized by the memory model and timed by the latency model.

Pure: imports neither ray, vllm nor torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from serve_app.config.vocabulary import TENSOR_PARALLEL_SIZES
from serve_app.planning.latency import LatencyEstimate, estimate_latency, meets_slo
from serve_app.planning.memory import MemoryEstimate, estimate_memory
from serve_app.planning.model_bytes import bytes_to_gib, padded_vocab_size
from serve_app.planning.request import PlanRequest
from serve_app.planning.result import round_or_none
from serve_app.planning.shape import ModelShape

__all__ = ["TpOption", "evaluate", "valid_tensor_parallel_sizes"]


def valid_tensor_parallel_sizes(shape: ModelShape, gpus_per_node: int) -> dict[int, str | None]:
    """Each of 1, 2, 4, 8 mapped to None when vLLM can shard ``shape`` that way within one node, else why not.

    vLLM divides attention heads, KV heads (or replicates them when tp exceeds their count), MLP and expert
    widths evenly across ranks; the vocabulary is padded to a multiple of 64 so it always divides.
    """
    verdicts: dict[int, str | None] = {}
    for tp in TENSOR_PARALLEL_SIZES:
        why: str | None = None
        if tp > gpus_per_node:
            why = f"needs {tp} GPUs in one node; nodes have {gpus_per_node}"
        elif shape.num_attention_heads % tp:
            why = f"num_attention_heads ({shape.num_attention_heads}) is not divisible by {tp}"
        elif not shape.is_mla and tp < shape.num_key_value_heads and shape.num_key_value_heads % tp:
            why = f"num_key_value_heads ({shape.num_key_value_heads}) is not divisible by {tp}"
        elif shape.num_dense_layers and shape.intermediate_size % tp:
            why = f"intermediate_size ({shape.intermediate_size}) is not divisible by {tp}"
        elif shape.is_moe and shape.moe_intermediate_size % tp:
            why = f"moe_intermediate_size ({shape.moe_intermediate_size}) is not divisible by {tp}"
        elif padded_vocab_size(shape.vocab_size) % tp:
            why = f"padded vocab ({padded_vocab_size(shape.vocab_size)}) is not divisible by {tp}"
        verdicts[tp] = why
    return verdicts


@dataclass(frozen=True)
class TpOption:
    """One tensor-parallel size (1 on the CPU backend), sized and, on GPUs, timed."""

    tp: int
    memory: MemoryEstimate
    replicas: int
    # Sequences of the expected context (workload prompt + output, prefix reuse) the KV cache holds.
    kv_concurrency: float
    # max_num_seqs capped by kv_concurrency.
    cap: int
    # Highest concurrency meeting the SLO (0: none), and the estimate there (at 1 when none meets).
    slo_concurrency: int
    estimate: LatencyEstimate | None

    @property
    def fits(self) -> bool:
        """vLLM starts: the budget leaves a KV cache that holds one max_model_len request."""
        return self.memory.kv_cache_available_bytes > 0 and self.memory.fits_one_request

    @property
    def meets_slo(self) -> bool:
        return self.slo_concurrency > 0

    @property
    def tokens_per_s_per_gpu(self) -> float:
        if self.estimate is None or not self.meets_slo:
            return 0.0
        return self.estimate.output_tokens_per_s / self.tp

    def summary(self) -> dict[str, Any]:
        est = self.estimate
        return {
            "tensor_parallel_size": self.tp,
            "fits": self.fits,
            "replicas": self.replicas if self.fits else 0,
            "weights_gib_per_gpu": round(bytes_to_gib(self.memory.weights_bytes), 2),
            "kv_cache_tokens_per_replica": self.memory.kv_cache_tokens,
            "kv_concurrency": round(self.kv_concurrency, 2),
            "slo_concurrency_per_replica": self.slo_concurrency,
            "estimated_tpot_p50_ms": round_or_none(est.tpot_p50_ms) if est else None,
            "estimated_ttft_p95_ms": round_or_none(est.ttft_p95_ms) if est else None,
            "estimated_output_tokens_per_s_per_gpu": round(self.tokens_per_s_per_gpu, 1),
        }


def evaluate(req: PlanRequest, tp: int) -> TpOption:
    """``req`` at tensor-parallel size ``tp``: memory, the KV cap on max_num_seqs and, on GPUs, the highest
    concurrency that meets the SLO (the latency model is not calibrated for the CPU backend)."""
    memory = estimate_memory(req.memory_inputs(tp))
    cluster = req.cluster
    replicas = cluster.nodes if req.accelerator == "cpu" else cluster.nodes * (cluster.gpus_per_node // tp)
    kv_conc = memory.concurrency_for(req.expected_context_tokens, req.prefix_reuse_fraction)
    cap = max(0, min(req.max_num_seqs, int(kv_conc) if math.isfinite(kv_conc) else req.max_num_seqs))
    option = TpOption(tp, memory, replicas, kv_conc, cap, 0, None)
    gpu = cluster.gpu
    if not option.fits or cap < 1 or req.accelerator == "cpu" or gpu is None:
        return option
    # Latency grows with concurrency, so binary-search the largest concurrency that meets the SLO.
    lo, hi, best = 1, cap, 0
    while lo <= hi:
        mid = (lo + hi) // 2
        if meets_slo(req, estimate_latency(req, memory, gpu, mid)):
            best, lo = mid, mid + 1
        else:
            hi = mid - 1
    estimate = estimate_latency(req, memory, gpu, best or 1)
    return TpOption(tp, memory, replicas, kv_conc, cap, best, estimate)
