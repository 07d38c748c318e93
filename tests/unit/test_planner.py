"""Planner: TP and replica decisions with reasons, refusals with numbers, the Plan's JSON and table."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import pytest
from pydantic import ValidationError

from serve_app.config import WorkloadSection, parse_config
from serve_app.planning import catalogue
from serve_app.planning.from_config import cluster_spec, plan_request
from serve_app.planning.latency import estimate_latency
from serve_app.planning.memory import estimate_memory
from serve_app.planning.placement import ClusterSpec, Plan, PlanRequest, plan
from serve_app.planning.result import render_plan_table


def request(
    model: str, gpu: str | None = "H200", gpus: int = 1, nodes: int = 1, **fields: Any
) -> PlanRequest:
    """Builder: a catalogue model on ``nodes`` x ``gpus`` of a catalogue GPU."""
    cluster = ClusterSpec.of(gpu, nodes=nodes, gpus_per_node=gpus) if gpu else ClusterSpec()
    return PlanRequest(model=catalogue.shape(model), cluster=cluster, **fields)


def text(p: Plan) -> str:
    return "\n".join(p.reasons + p.warnings)


@dataclass(frozen=True)
class Scenario:
    name: str
    req: PlanRequest
    fits: bool
    tp: int
    replicas: int
    phrase: str  # a key phrase of the reasons (or warnings) that explains the decision


QWEN8 = "Qwen/Qwen3-8B"
LLAMA70 = "meta-llama/Llama-3.1-70B-Instruct"
SCENARIOS = [
    Scenario(
        "8b-one-h200",
        request(QWEN8, max_model_len=8192),
        True,
        1,
        1,
        "the model fits one GPU",
    ),
    Scenario(
        "8b-eight-h200-relaxed-slo-prefers-single-gpu-replicas",
        request(QWEN8, gpus=8, max_model_len=8192, ttft_p95_ms=2000, tpot_p50_ms=50),
        True,
        1,
        8,
        "8 independent single-GPU replicas",
    ),
    Scenario(
        "8b-two-nodes-of-four",
        request(QWEN8, gpus=4, nodes=2, max_model_len=8192, workload=WorkloadSection(prompt_tokens=2048)),
        True,
        1,
        8,
        "most output throughput per GPU",
    ),
    Scenario(
        "8b-tight-tpot-needs-a-tp-group",
        request(QWEN8, gpus=8, max_model_len=8192, tpot_p50_ms=5),
        True,
        4,
        2,
        "single-GPU replicas cannot meet TPOT p50 <= 5 ms",
    ),
    Scenario(
        "70b-eight-h100-must-shard",
        request(LLAMA70, gpu="H100-80GB", gpus=8, max_model_len=8192, ttft_p95_ms=2000, tpot_p50_ms=50),
        True,
        4,
        2,
        "the model does not fit one GPU",
    ),
    Scenario(
        "70b-one-h100-refused",
        request(LLAMA70, gpu="H100-80GB", max_model_len=8192),
        False,
        1,
        0,
        "won't fit",
    ),
    Scenario(
        "70b-two-a100-default-128k-context-refused",
        request(LLAMA70, gpu="A100-80GB", gpus=2),
        False,
        2,
        0,
        "the largest max_model_len that fits is 24,448",
    ),
    Scenario(
        "70b-two-a100-8k-fits-tight",
        request(LLAMA70, gpu="A100-80GB", gpus=2, max_model_len=8192),
        True,
        2,
        1,
        "max_num_seqs lowered from 256 to 19",
    ),
    Scenario(
        "moe-30b-a3b-fits-one-h100",
        request("Qwen/Qwen3-30B-A3B", gpu="H100-80GB", max_model_len=8192),
        True,
        1,
        1,
        "MoE: weights sized by all 128 experts",
    ),
    Scenario(
        "moe-30b-a3b-two-l40s",
        request("Qwen/Qwen3-30B-A3B", gpu="L40S", gpus=2, max_model_len=8192),
        True,
        2,
        1,
        "does not fit one GPU",
    ),
    Scenario(
        "mixtral-two-h100",
        request("mistralai/Mixtral-8x7B-Instruct-v0.1", gpu="H100-80GB", gpus=2, max_model_len=8192),
        True,
        2,
        1,
        "TP=2 is needed",
    ),
    Scenario(
        "mla-deepseek-v2-lite-one-l40s",
        request("deepseek-ai/DeepSeek-V2-Lite", gpu="L40S", max_model_len=8192),
        True,
        1,
        1,
        "the model fits one GPU",
    ),
    Scenario(
        "8b-on-l4-fits-with-little-kv",
        request(QWEN8, gpu="L4", max_model_len=8192),
        True,
        1,
        1,
        "max_num_seqs lowered from 256 to 18",
    ),
    Scenario(
        "unreachable-slo-picks-closest",
        request(QWEN8, gpu="L4", gpus=2, max_model_len=8192, tpot_p50_ms=1),
        True,
        2,
        1,
        "no tensor-parallel size meets TPOT p50 <= 1 ms",
    ),
    Scenario(
        "requested-tp-honoured",
        request(QWEN8, gpus=8, max_model_len=8192, tensor_parallel_size=2),
        True,
        2,
        4,
        "TP=2 as requested",
    ),
    Scenario(
        "requested-tp-larger-than-node-refused",
        request(QWEN8, gpus=4, max_model_len=8192, tensor_parallel_size=8),
        False,
        8,
        0,
        "needs 8 GPUs in one node; nodes have 4",
    ),
    Scenario(
        "cpu-embedded",
        request("Qwen/Qwen3-0.6B", gpu=None, accelerator="cpu", cpu_kv_cache_space_gib=1, max_model_len=4096),
        True,
        1,
        1,
        "CPU backend",
    ),
]


@pytest.mark.parametrize("s", SCENARIOS, ids=[s.name for s in SCENARIOS])
def test_decision(s: Scenario) -> None:
    p = plan(s.req)
    summary = f"{s.name}: fits={p.fits} tp={p.tensor_parallel_size} replicas={p.replicas}\n{text(p)}"
    assert (p.fits, p.tensor_parallel_size, p.replicas) == (s.fits, s.tp, s.replicas), summary
    assert s.phrase in text(p), summary
    assert p.reasons, "every plan says why"
    if p.fits and p.accelerator == "gpu":
        assert len(p.bundles) == p.tensor_parallel_size
        assert all(b["GPU"] == 1 and b["CPU"] >= 1 for b in p.bundles)
        assert p.placement_strategy == ("STRICT_PACK" if p.tensor_parallel_size > 1 else "PACK")
        assert p.replicas * p.tensor_parallel_size <= s.req.cluster.total_gpus
        assert 1 <= p.max_num_seqs <= s.req.max_num_seqs


# --------------------------------------------------------------------------------------------- refusals
def test_seed_pitfall_unquantized_512_seqs_long_context_is_refused_with_numbers() -> None:
    """The seeds' pitfall: max_num_seqs 512, no quantization, long context -> refused, need vs supply."""
    p = plan(request("Qwen/Qwen3-32B", gpu="H100-80GB", max_model_len=40960, max_num_seqs=512))
    assert not p.fits and p.replicas == 0 and p.bundles == ()
    reasons = text(p)
    assert "won't fit" in reasons and "unquantized bfloat16" in reasons
    # vLLM's template: need vs supply with units, and the computed largest value that fits.
    assert "10.00 GiB KV cache is needed per GPU" in reasons
    assert "larger than the available KV cache memory (8.41 GiB = 34,448 tokens)" in reasons
    assert "the largest max_model_len that fits is 34,432" in reasons
    # The seeds' formula, KV cache = concurrency x context x bytes per token, at both lengths.
    assert (
        "max_num_seqs=512 sequences need 160.00 GiB of KV cache per GPU at the expected 1,280 tokens"
        in reasons
    )
    assert "5,120.00 GiB at max_model_len 40,960" in reasons
    assert "26.9 sequences at the expected context, 0 at max_model_len" in reasons
    # Which settings to change, each with its computed effect.
    assert "lower max_model_len to <= 34,432" in reasons
    assert "quantization='fp8' -> weights 31.97 GiB/GPU" in reasons
    assert "tensor_parallel_size=2 fits" in reasons
    assert "kv_cache_dtype='fp8'" in reasons


def test_weights_larger_than_gpu_refusal_names_budget_and_quantization() -> None:
    p = plan(request(LLAMA70, gpu="H100-80GB", max_model_len=8192))
    reasons = text(p)
    assert "Weights need 131.45 GiB per GPU" in reasons
    assert "budget of 71.27 GiB (gpu_memory_utilization 0.9 x 79.19 GiB)" in reasons
    assert "int4 AWQ/GPTQ checkpoint -> weights 37.07 GiB/GPU" in reasons
    assert "fp8" in reasons and "still short" in reasons  # fp8 alone is not enough on one H100
    assert p.to_json()["fits"] is False


LONG = WorkloadSection(prompt_tokens=4096, output_tokens=1024)


def test_max_num_seqs_is_lowered_to_the_expected_context_not_to_max_model_len() -> None:
    lowered = plan(request(QWEN8, max_model_len=32768, max_num_seqs=512, workload=LONG))
    # 794,064 KV tokens / 5,120 expected tokens = 155.1 sequences; 24 if all reached 32,768 tokens.
    assert lowered.fits and lowered.max_num_seqs == 155 and lowered.max_num_seqs_without_preemption == 24
    assert "max_num_seqs lowered from 512 to 155" in text(lowered)
    assert "155 x 32,768 tokens x 147,456 bytes = 697.50 GiB" in text(lowered)


def test_strict_max_num_seqs_refuses_instead_of_lowering() -> None:
    strict = plan(
        request(QWEN8, max_model_len=32768, max_num_seqs=512, workload=LONG, require_max_num_seqs=True)
    )
    assert not strict.fits and strict.replicas == 0
    assert (
        "155.1 sequences at the expected context, 24 at max_model_len (require_max_num_seqs is set"
        in text(strict)
    )
    assert "lower max_num_seqs to <= 155" in text(strict)
    assert "room for 164.3 of the 512 sequences, still short" in text(strict)  # fp8 weights do not rescue it
    assert "tensor_parallel_size=4 fits" in text(strict)


@pytest.mark.parametrize(
    ("model", "max_model_len", "without_preemption"),
    [
        # Issue 12: bare vLLM runs Qwen3-8B at 256 sequences on an H200; the planner used to cap it at 96.
        (QWEN8, 8192, 96),
        ("meta-llama/Llama-3.1-8B-Instruct", 16384, 54),
        # 387 fit even at max_model_len: nothing counts on preemption.
        (QWEN8, 2048, 387),
    ],
)
def test_max_num_seqs_counts_on_preemption_and_reports_the_guarantee(
    model: str, max_model_len: int, without_preemption: int
) -> None:
    p = plan(request(model, max_model_len=max_model_len))
    assert p.fits and p.max_num_seqs == 256
    assert p.max_num_seqs_without_preemption == without_preemption
    assert p.to_json()["max_num_seqs_without_preemption"] == without_preemption
    counts_on_preemption = [w for w in p.warnings if "counts on preemption" in w]
    if without_preemption < 256:
        assert len(counts_on_preemption) == 1
        assert f"256 x {max_model_len:,} tokens" in counts_on_preemption[0]
        assert f"set max_num_seqs <= {without_preemption}" in counts_on_preemption[0]
    else:
        assert counts_on_preemption == []


def test_cpu_refusal_names_the_cpu_knob() -> None:
    p = plan(
        request("Qwen/Qwen3-0.6B", gpu=None, accelerator="cpu", cpu_kv_cache_space_gib=1, max_model_len=40960)
    )
    assert not p.fits
    assert "largest max_model_len that fits is 9,216" in text(p)
    assert "raise cpu_kv_cache_space_gib to >= 4.39" in text(p)
    assert "quantization" not in text(p)  # GPU-only levers are not offered on CPU


# --------------------------------------------------------------------------------------- plan contents
def test_kv_numbers_of_the_reference_config() -> None:
    p = plan(request(QWEN8, max_model_len=8192, max_num_batched_tokens=2048))
    assert p.kv_bytes_per_token == 144 * 1024
    assert p.kv_cache_tokens_per_replica == pytest.approx(794_704, rel=0.02)
    assert p.max_concurrency_per_replica == pytest.approx(97.01, rel=0.02)
    assert p.weights_gib_per_gpu == pytest.approx(15.27, rel=0.01)


def test_prefix_reuse_and_expected_context_raise_concurrency() -> None:
    base = plan(request(QWEN8, gpu="L40S", max_model_len=8192, workload=WorkloadSection(prompt_tokens=2048)))
    shared = WorkloadSection(prompt_tokens=2048, prefix_reuse_fraction=0.8)
    reuse = plan(request(QWEN8, gpu="L40S", max_model_len=8192, workload=shared))
    assert base.expected_context_tokens == 2048 + 256
    # Shorter than max_model_len, so more sequences fit than at max_model_len.
    assert base.max_concurrency_at_expected_context > base.max_concurrency_per_replica
    assert reuse.max_concurrency_at_expected_context > 3 * base.max_concurrency_at_expected_context
    assert reuse.max_num_seqs > base.max_num_seqs


def test_prefix_reuse_counts_only_with_prefix_caching() -> None:
    shared = WorkloadSection(prompt_tokens=2048, prefix_reuse_fraction=0.8)
    on = plan(request(QWEN8, gpu="L40S", max_model_len=8192, workload=shared))
    off = plan(request(QWEN8, gpu="L40S", max_model_len=8192, workload=shared, enable_prefix_caching=False))
    plain = plan(request(QWEN8, gpu="L40S", max_model_len=8192, workload=WorkloadSection(prompt_tokens=2048)))
    assert off.max_concurrency_at_expected_context == plain.max_concurrency_at_expected_context
    assert on.max_concurrency_at_expected_context > off.max_concurrency_at_expected_context


def test_fp8_kv_cache_doubles_kv_tokens() -> None:
    plain = plan(request(QWEN8, max_model_len=8192))
    fp8 = plan(request(QWEN8, max_model_len=8192, kv_cache_dtype="fp8"))
    assert fp8.kv_bytes_per_token * 2 == plain.kv_bytes_per_token
    assert fp8.kv_cache_tokens_per_replica == pytest.approx(2 * plain.kv_cache_tokens_per_replica, rel=0.001)


def test_speculation_warns_about_ttft_with_numbers() -> None:
    p = plan(request(QWEN8, max_model_len=8192, speculative_method="ngram", num_speculative_tokens=5))
    warning = next(w for w in p.warnings if w.startswith("speculative decoding"))
    assert "trades TTFT for TPOT" in warning and "judge TTFT and TPOT" in warning
    ttft_before, ttft_after = (float(x) for x in re.findall(r"TTFT p95 (\d+) -> (\d+) ms", warning)[0])
    assert ttft_after > ttft_before


def test_draft_model_shrinks_kv_and_adds_weights() -> None:
    base = plan(request(QWEN8, max_model_len=8192))
    draft = plan(
        request(
            QWEN8,
            max_model_len=8192,
            speculative_method="draft_model",
            num_speculative_tokens=5,
            draft_model=catalogue.shape("Qwen/Qwen3-0.6B"),
        )
    )
    assert draft.weights_gib_per_gpu == pytest.approx(base.weights_gib_per_gpu + 1.12, abs=0.01)
    assert draft.kv_bytes_per_token == (144 + 112) * 1024
    assert draft.kv_cache_tokens_per_replica < base.kv_cache_tokens_per_replica


def test_latency_model_is_monotonic_and_tp_speeds_decode() -> None:
    req = request(QWEN8, gpus=2, max_model_len=8192)
    gpu = catalogue.gpu("H200")
    tp1, tp2 = estimate_memory(req.memory_inputs(1)), estimate_memory(req.memory_inputs(2))
    low, high = estimate_latency(req, tp1, gpu, 1), estimate_latency(req, tp1, gpu, 64)
    assert high.tpot_p50_ms > low.tpot_p50_ms and high.ttft_p95_ms > low.ttft_p95_ms
    assert high.output_tokens_per_s > low.output_tokens_per_s
    # Decode at batch 1 streams the weights: ~16.4 GB / (4.8 TB/s x 0.75) + 1 ms overhead.
    assert low.decode_step_ms == pytest.approx(16.4e9 / 3.6e12 * 1e3 + 1.0, rel=0.05)
    assert estimate_latency(req, tp2, gpu, 1).decode_step_ms < low.decode_step_ms


def test_latency_model_times_the_workloads_request() -> None:
    gpu = catalogue.gpu("H200")
    short = request(QWEN8, max_model_len=8192)
    long = request(QWEN8, max_model_len=8192, workload=WorkloadSection(prompt_tokens=4096))
    mem = estimate_memory(short.memory_inputs(1))
    assert (
        estimate_latency(long, mem, gpu, 8).ttft_p95_ms > 2 * estimate_latency(short, mem, gpu, 8).ttft_p95_ms
    )


def test_parallel_drafting_reaches_the_latency_model() -> None:
    spec = dict(
        speculative_method="draft_model",
        num_speculative_tokens=4,
        draft_model=catalogue.shape("Qwen/Qwen3-0.6B"),
        max_model_len=8192,
    )
    serial, parallel = request(QWEN8, **spec), request(QWEN8, **spec, parallel_drafting=True)
    gpu, mem = catalogue.gpu("H200"), estimate_memory(serial.memory_inputs(1))
    one_pass = estimate_latency(parallel, mem, gpu, 1).decode_step_ms
    four_passes = estimate_latency(serial, mem, gpu, 1).decode_step_ms
    # Four drafter passes of a 0.6B model (~1.2 GB read + 0.3 ms each) against one.
    assert four_passes - one_pass == pytest.approx(3 * (1.19e9 / 3.6e12 * 1e3 + 0.3), rel=0.1)


def test_config_reaches_the_plan_request() -> None:
    cfg = parse_config(
        {
            "model": {"source": QWEN8, "max_model_len": 8192},
            "engine": {
                "enable_prefix_caching": False,
                "speculative": {
                    "method": "draft_model",
                    "num_speculative_tokens": 3,
                    "draft_model": "Qwen/Qwen3-0.6B",
                    "parallel_drafting": True,
                },
            },
            "resources": {"gpu_type": "H200"},
            "workload": {"prompt_tokens": 2000, "output_tokens": 100, "prefix_reuse_fraction": 0.5},
        }
    )
    req = plan_request(cfg, cluster_spec(cfg))
    assert req.parallel_drafting and req.speculative is not None and req.speculative.parallel_drafting
    assert req.workload == cfg.workload and req.expected_context_tokens == 2100
    assert req.prefix_reuse_fraction == 0.0  # prefix caching is off: nothing is shared


def test_a_large_overshoot_is_lowered_not_refused() -> None:
    """vLLM serves 256 sequences on an L4 by preempting; the planner lowers it to what the cache holds."""
    p = plan(request(QWEN8, gpu="L4", max_model_len=8192))
    assert p.fits and p.max_num_seqs == 18 and p.max_num_seqs_without_preemption == 2
    strict = plan(request(QWEN8, gpu="L4", max_model_len=8192, require_max_num_seqs=True))
    assert not strict.fits and "lower max_num_seqs to <= 18 or unset require_max_num_seqs" in text(strict)


def test_to_json_keys_and_round_trip() -> None:
    p = plan(request(QWEN8, gpus=2, max_model_len=8192, ttft_p95_ms=1000, tpot_p50_ms=50))
    d = p.to_json()
    for key in (
        "fits",
        "tensor_parallel_size",
        "replicas",
        "kv_cache_tokens_per_replica",
        "max_concurrency_per_replica",
        "bundles",
        "weights_gib_per_gpu",
        "kv_bytes_per_token",
        "reasons",
        "warnings",
        "placement_strategy",
        "max_num_seqs",
    ):
        assert key in d, key
    assert json.loads(json.dumps(d)) == d  # plain JSON all the way down
    assert d["bundles"] == [{"GPU": 1, "CPU": 1}]
    assert len(d["alternatives"]) == 2


def test_render_plan_table() -> None:
    table = render_plan_table(plan(request(QWEN8, max_model_len=8192)))
    assert "tensor_parallel_size" in table and "KV cache per replica" in table and "reason:" in table
    assert "max_num_seqs            256 (sized for 1,280-token sequences)" in table
    assert "  without preemption    96 (all at max_model_len)" in table
    assert "  at expected context   620.36 at 1,280 tokens" in table
    refused = render_plan_table(plan(request(LLAMA70, gpu="H100-80GB", max_model_len=8192)))
    assert "fits" in refused and "NO" in refused and "won't fit" in refused


def test_cpus_per_replica_go_to_the_first_bundle() -> None:
    p = plan(request(LLAMA70, gpu="H100-80GB", gpus=8, max_model_len=8192, num_cpus_per_replica=4))
    assert p.bundles[0] == {"GPU": 1, "CPU": 4} and all(b == {"GPU": 1, "CPU": 1} for b in p.bundles[1:])


def test_cuda_graph_headroom_warning() -> None:
    p = plan(request(LLAMA70, gpu="H100-80GB", gpus=8, max_model_len=8192, gpu_memory_utilization=0.99))
    assert any("CUDA graphs" in w and "lower it to <=" in w for w in p.warnings)


# ----------------------------------------------------------------------------------------- validation
@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"speculative_method": "draft_model", "num_speculative_tokens": 3}, "needs draft_model"),
        ({"speculative_method": "ngram"}, "num_speculative_tokens must be >= 1"),
        ({"max_num_seqs": 512, "max_num_batched_tokens": 256}, "must be >= max_num_seqs (512)"),
        ({"gpu_memory_utilization": 1.5}, "less than or equal to 0.99"),
        ({"unknown_knob": 1}, "Extra inputs are not permitted"),
    ],
)
def test_request_validation(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=re.escape(message)):
        request(QWEN8, **fields)


def test_gpu_required_on_gpu_accelerator() -> None:
    with pytest.raises(ValidationError, match="cluster.gpu is required"):
        PlanRequest(model=catalogue.shape(QWEN8))
    assert ClusterSpec(gpu="H200").gpu == catalogue.gpu("H200")  # type: ignore[arg-type]
    assert ClusterSpec.of("H200", gpu_memory_gib=140.4).gpu.memory_bytes == int(140.4 * (1 << 30))  # type: ignore[union-attr]


def test_gpus_are_found_by_the_names_nvidia_smi_prints() -> None:
    # What a benchmark's machine reports (loadtests/machine.py catalogue_gpu) and a user may paste.
    assert catalogue.gpu("NVIDIA H100 80GB HBM3") == catalogue.gpu("H100-80GB")
    assert catalogue.gpu("NVIDIA H200") == catalogue.gpu("H200")


def test_plan_is_frozen() -> None:
    p = plan(request(QWEN8, max_model_len=8192))
    with pytest.raises(AttributeError):
        p.replicas = 3  # type: ignore[misc]
