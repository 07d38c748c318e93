"""Memory model: measured vLLM points, published parameter counts, KV bytes per token, vLLM's arithmetic."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from serve_app.planning import catalogue
from serve_app.planning import memory as m
from serve_app.planning import model_bytes as mb
from serve_app.planning.shape import ModelShape, ModelShapeError

GIB = 1 << 30
KIB = 1024
POINTS_DIR = Path(__file__).resolve().parent.parent / "data" / "memory_points"
POINTS = sorted(POINTS_DIR.glob("*.json"))


def shape(name: str) -> ModelShape:
    return catalogue.shape(name)


def inputs_from_fixture(config: dict[str, Any]) -> m.MemoryInputs:
    """Build MemoryInputs from a fixture's "config" (schema: tests/data/memory_points/README.md)."""
    model = (
        ModelShape.from_hf_config(config["hf_config"], name=config.get("model"))
        if "hf_config" in config
        else shape(config["model"])
    )
    gpu = catalogue.gpu(config["gpu"]) if config.get("gpu") else None
    spec = None
    if config.get("speculative"):
        s = config["speculative"]
        draft = shape(s["draft_model"]) if s.get("draft_model") else None
        spec = mb.SpeculativeSpec(s["method"], s["num_speculative_tokens"], draft)
    return m.MemoryInputs(
        model=model,
        gpu_memory_bytes=config.get("gpu_memory_bytes") or (gpu.memory_bytes if gpu else 0),
        gpu_name=gpu.name if gpu else "",
        gpu_memory_utilization=config.get("gpu_memory_utilization", 0.9),
        tensor_parallel_size=config.get("tensor_parallel_size", 1),
        dtype=config.get("dtype", "auto"),
        quantization=config.get("quantization"),
        kv_cache_dtype=config.get("kv_cache_dtype", "auto"),
        max_model_len=config.get("max_model_len"),
        max_num_seqs=config.get("max_num_seqs", 256),
        max_num_batched_tokens=config.get("max_num_batched_tokens"),
        speculative=spec,
        accelerator=config.get("accelerator", "gpu"),
        cpu_kv_cache_space_gib=config.get("cpu_kv_cache_space_gib"),
        kv_cache_memory_bytes=config.get("kv_cache_memory_bytes"),
        enforce_eager=config.get("enforce_eager", False),
        subtract_cudagraph_estimate=config.get("subtract_cudagraph_estimate", False),
    )


# ------------------------------------------------------------------------------------ measured points
def test_reference_point_fixture_exists() -> None:
    names = [p.name for p in POINTS]
    assert "h200_qwen3_8b_bf16.json" in names, "the lab reference point must stay a fixture"


@pytest.mark.parametrize("path", POINTS, ids=[p.stem for p in POINTS])
def test_measured_point(path: Path) -> None:
    """Every fixture: KV tokens within 2 %, weights within 1 % of what vLLM logged (where it logs weights: the
    CPU build does not, and such a fixture says weights_gib null)."""
    point = json.loads(path.read_text())
    assert point.get("source"), f"{path.name}: say where the numbers come from"
    est = m.estimate_memory(inputs_from_fixture(point["config"]))
    measured = point["measured"]
    detail = (
        f"{path.name}: predicted {est.kv_cache_tokens:,} KV tokens, {est.gib('weights_bytes'):.3f} GiB "
        f"weights, {est.gib('activation_peak_bytes'):.2f} GiB activation, {est.gib('non_torch_bytes'):.2f} "
        f"GiB non-torch; measured {measured}"
    )
    assert est.kv_cache_tokens == pytest.approx(measured["kv_tokens"], rel=0.02), detail
    if measured["weights_gib"] is not None:
        assert est.gib("weights_bytes") == pytest.approx(measured["weights_gib"], rel=0.01), detail


def test_reference_point_breakdown() -> None:
    """Qwen3-8B, H200, util 0.9, max_model_len 8192: each logged term, not only the total."""
    est = m.estimate_memory(
        inputs_from_fixture(json.loads((POINTS_DIR / "h200_qwen3_8b_bf16.json").read_text())["config"])
    )
    assert est.kv_bytes_per_token == 144 * KIB
    assert est.requested_bytes / GIB == pytest.approx(125.82, abs=0.005)  # "worker requested memory"
    assert est.gib("weights_bytes") == pytest.approx(15.27, abs=0.005)
    assert est.gib("activation_peak_bytes") == pytest.approx(1.19, abs=0.01)
    assert est.gib("non_torch_bytes") == pytest.approx(0.22, abs=0.005)
    assert est.gib("cudagraph_bytes") == pytest.approx(0.61, abs=0.01)
    assert not est.cudagraph_subtracted  # vLLM 0.26 captures graphs after sizing the KV cache
    assert est.gib("kv_cache_available_bytes") == pytest.approx(109.14, abs=0.01)
    assert est.kv_cache_tokens == pytest.approx(794_704, rel=0.001)
    assert est.max_concurrency == pytest.approx(97.01, abs=0.02)


def test_h200_memory_is_what_torch_reports() -> None:
    assert catalogue.gpu("H200").memory_bytes == 150_109_880_320  # measured total_memory, 139.80 GiB


# --------------------------------------------------------------------------------- parameter counts
@pytest.mark.parametrize(
    ("name", "published_params"),
    [
        ("Qwen/Qwen3-0.6B", 0.6e9),
        ("Qwen/Qwen3-8B", 8.19e9),
        ("Qwen/Qwen3-32B", 32.8e9),
        ("meta-llama/Llama-3.1-8B-Instruct", 8.03e9),
        ("meta-llama/Llama-3.1-70B-Instruct", 70.6e9),
        ("mistralai/Mistral-7B-Instruct-v0.3", 7.25e9),
        ("mistralai/Mixtral-8x7B-Instruct-v0.1", 46.7e9),
        ("Qwen/Qwen3-30B-A3B", 30.5e9),
        ("deepseek-ai/DeepSeek-V2-Lite", 15.7e9),
    ],
)
def test_parameter_count_matches_model_card(name: str, published_params: float) -> None:
    assert mb.parameter_count(shape(name)) == pytest.approx(published_params, rel=0.01)


@pytest.mark.parametrize(
    ("name", "published_active"),
    [("Qwen/Qwen3-30B-A3B", 3.3e9), ("mistralai/Mixtral-8x7B-Instruct-v0.1", 12.9e9)],
)
def test_moe_active_parameters(name: str, published_active: float) -> None:
    assert mb.active_parameter_count(shape(name)) == pytest.approx(published_active, rel=0.03)


def test_moe_weights_count_every_expert() -> None:
    # The seed: MoE weight memory follows TOTAL parameters; 30B-A3B weighs like a 30B dense model.
    moe = mb.weight_bytes_per_gpu(shape("Qwen/Qwen3-30B-A3B"))
    assert moe / GIB == pytest.approx(30.53e9 * 2 / GIB, rel=0.01)
    assert moe > 3 * mb.weight_bytes_per_gpu(shape("Qwen/Qwen3-8B"))


@pytest.mark.parametrize(
    ("name", "tp", "dtype", "quantization", "expected_gib"),
    [
        ("Qwen/Qwen3-8B", 1, "auto", None, 15.27),  # measured
        ("Qwen/Qwen3-0.6B", 1, "auto", None, 1.12),  # measured (tied embeddings)
        ("Qwen/Qwen3-8B", 1, "float32", None, 30.53),
        ("meta-llama/Llama-3.1-70B-Instruct", 8, "auto", None, 16.46),
        # fp8 / int4 quantize only decoder linears; embeddings and lm_head stay bf16 (1.16 GiB each here).
        ("Qwen/Qwen3-8B", 1, "auto", "fp8", 8.80),
        ("Qwen/Qwen3-8B", 1, "auto", "awq", 5.69),
    ],
)
def test_weight_bytes(name: str, tp: int, dtype: str, quantization: str | None, expected_gib: float) -> None:
    got = mb.weight_bytes_per_gpu(shape(name), tp, dtype, quantization) / GIB
    assert got == pytest.approx(expected_gib, rel=0.005)


def test_quantization_bytes_per_weight() -> None:
    s = shape("Qwen/Qwen3-8B")
    assert mb.resolve_quantization(s, None, "bfloat16").bytes_per_weight == 2
    assert mb.resolve_quantization(s, "fp8", "bfloat16").bytes_per_weight == 1
    # int4 + an fp16 scale and a packed zero point per 128 weights
    assert mb.resolve_quantization(s, "gptq", "bfloat16").bytes_per_weight == pytest.approx(0.5 + 2.5 / 128)
    checkpoint = dict(catalogue.get("Qwen/Qwen3-8B"))
    checkpoint["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    scheme = mb.resolve_quantization(ModelShape.from_hf_config(checkpoint), None, "bfloat16")
    assert scheme.method == "fp8" and scheme.bytes_per_weight == pytest.approx(1 + 4 / 16384)
    with pytest.raises(ValueError, match="not modelled"):
        mb.resolve_quantization(s, "squeezellm", "bfloat16")


def test_tp_shards_weights_but_replicates_small_parts() -> None:
    s = shape("Qwen/Qwen3-8B")
    tp1, tp2 = mb.weight_breakdown_per_gpu(s, 1), mb.weight_breakdown_per_gpu(s, 2)
    assert tp2.linear_params * 2 == tp1.linear_params
    assert tp2.embedding_params * 2 == tp1.embedding_params
    assert tp2.unquantized_params == tp1.unquantized_params  # layernorms, q/k norms: every rank holds them


def test_replicated_kv_heads_cost_weights_too() -> None:
    # Qwen3-30B-A3B has 4 KV heads: at TP=8 each rank holds a whole head, so k/v weights total 2x the model's.
    s = shape("Qwen/Qwen3-30B-A3B")
    total = mb.weight_breakdown_per_gpu(s, 1).linear_params
    assert mb.weight_breakdown_per_gpu(s, 8).linear_params * 8 > total


@pytest.mark.parametrize(
    ("vocab", "padded"),
    [(151936, 151936), (32000, 32000), (32001, 32064), (128256, 128256), (102400, 102400)],
)
def test_vocab_padding_as_vllm(vocab: int, padded: int) -> None:
    assert mb.padded_vocab_size(vocab) == padded


def test_mla_keeps_decode_copies_of_kv_b_proj() -> None:
    b = mb.weight_breakdown_per_gpu(shape("deepseek-ai/DeepSeek-V2-Lite"), 1)
    assert b.mla_absorbed_params == 27 * 512 * 16 * (128 + 128)


# ------------------------------------------------------------------------------------ KV cache bytes
@pytest.mark.parametrize(
    ("name", "tp", "kv_dtype", "expected_bytes"),
    [
        ("Qwen/Qwen3-8B", 1, "auto", 144 * KIB),  # 2 x 36 layers x 8 heads x 128 x 2 bytes
        ("Qwen/Qwen3-8B", 1, "fp8", 72 * KIB),  # fp8 KV halves it
        ("Qwen/Qwen3-8B", 2, "auto", 72 * KIB),  # heads split across ranks
        ("Qwen/Qwen3-8B", 8, "auto", 18 * KIB),  # 8 heads / 8 ranks = 1
        ("meta-llama/Llama-3.1-70B-Instruct", 1, "auto", 320 * KIB),
        ("meta-llama/Llama-3.1-70B-Instruct", 8, "auto", 40 * KIB),
        ("Qwen/Qwen3-0.6B", 1, "auto", 112 * KIB),
        ("Qwen/Qwen3-30B-A3B", 1, "auto", 96 * KIB),
        ("Qwen/Qwen3-30B-A3B", 4, "auto", 24 * KIB),
        # 4 KV heads at TP=8: vLLM replicates, each rank keeps one head, so no further halving.
        ("Qwen/Qwen3-30B-A3B", 8, "auto", 24 * KIB),
        ("mistralai/Mixtral-8x7B-Instruct-v0.1", 2, "auto", 64 * KIB),
        # MLA: one latent of kv_lora_rank + qk_rope_head_dim = 576 per layer, the same on every rank.
        ("deepseek-ai/DeepSeek-V2-Lite", 1, "auto", 27 * 576 * 2),
        ("deepseek-ai/DeepSeek-V2-Lite", 2, "auto", 27 * 576 * 2),
        ("deepseek-ai/DeepSeek-V2-Lite", 1, "fp8", 27 * 576),
    ],
)
def test_kv_bytes_per_token(name: str, tp: int, kv_dtype: str, expected_bytes: int) -> None:
    assert mb.kv_bytes_per_token_per_gpu(shape(name), tp, kv_dtype) == expected_bytes


@pytest.mark.parametrize(("tp", "heads"), [(1, 8), (2, 4), (4, 2), (8, 1)])
def test_kv_heads_split_then_replicated(tp: int, heads: int) -> None:
    assert mb.kv_heads_per_gpu(shape("meta-llama/Llama-3.1-70B-Instruct"), tp) == heads
    assert mb.kv_heads_per_gpu(shape("Qwen/Qwen3-30B-A3B"), tp) == max(1, 4 // tp)
    assert mb.kv_heads_per_gpu(shape("deepseek-ai/DeepSeek-V2-Lite"), tp) == 1


# ------------------------------------------------------------------------------- vLLM's block arithmetic
def test_reported_tokens_and_concurrency_follow_vllm() -> None:
    # 49,669 blocks of 16 at max_model_len 8192 -> "794,704 tokens", "97.01x".
    assert m.vllm_reported_kv_tokens(49_669, 16, 8192) == 794_704
    assert m.max_concurrency_for_length(49_669, 16, 8192) == pytest.approx(97.01, abs=0.005)
    # A length that is not a multiple of the block: vLLM scales by cdiv(L, 16) blocks per request.
    assert m.vllm_reported_kv_tokens(1000, 16, 1000) == int(1000 / 63 * 1000)
    assert m.largest_max_model_len(1000, 16) == 999 * 16  # one null block held back


def test_prefix_reuse_raises_concurrency() -> None:
    # Half of every 4096-token request is a shared prefix: stored once, so each request adds only 128 blocks.
    plain = m.max_concurrency_for_length(10_000, 16, 4096)
    shared = m.max_concurrency_for_length(10_000, 16, 4096, prefix_reuse_fraction=0.5)
    assert plain == pytest.approx(10_000 / 256)
    assert shared == pytest.approx((10_000 - 128) / 128)
    # Only whole blocks are shared: a 20-token prefix shares one 16-token block, not 1.25.
    assert m.max_concurrency_for_length(100, 16, 40, prefix_reuse_fraction=0.5) == pytest.approx(
        (100 - 1) / 2
    )


@pytest.mark.parametrize(
    ("tokens", "expected_bytes"),
    [
        # phase 1: embedding-table transient + 2 hidden rows per token (measured 1.19 / 1.29 GiB)
        (2048, 151936 * 4096 * 2 + 2048 * 2 * 4096 * 2),
        (8192, 151936 * 4096 * 2 + 8192 * 2 * 4096 * 2),
        # phase 2: MLP peak, (3 I + 4 H) per batched token (measured 1.59 GiB, predicted 1.62)
        (16384, 16384 * (3 * 12288 + 4 * 4096) * 2),
    ],
)
def test_activation_peak_formula(tokens: int, expected_bytes: int) -> None:
    assert m.activation_peak_bytes(shape("Qwen/Qwen3-8B"), tokens) == expected_bytes


def test_activation_peak_splits_with_tp() -> None:
    s = shape("Qwen/Qwen3-8B")
    assert m.activation_peak_bytes(s, 16384, 2) < m.activation_peak_bytes(s, 16384, 1)


def test_default_step_budget_is_vllms_openai_server_default() -> None:
    h200, a100 = catalogue.gpu("H200"), catalogue.gpu("A100-80GB")
    assert m.default_max_num_batched_tokens(h200.memory_bytes, "H200") == 8192
    assert m.default_max_num_batched_tokens(a100.memory_bytes, "A100-80GB") == 2048
    assert m.default_max_num_batched_tokens(200 * GIB, "B200") == 16384
    assert m.default_max_num_batched_tokens(0, accelerator="cpu", world_size=2) == 4096
    assert (
        m.default_max_num_batched_tokens(
            h200.memory_bytes, "H200", max_model_len=32768, enable_chunked_prefill=False
        )
        == 32768
    )


def test_cudagraph_capture_sizes_as_vllm() -> None:
    sizes = m.cudagraph_capture_sizes(256, 8192)
    assert len(sizes) == 51 and sizes[:4] == [1, 2, 4, 8] and sizes[-1] == 512
    assert m.cudagraph_capture_sizes(64, 2048)[-1] == 128
    assert m.cudagraph_bytes(shape("Qwen/Qwen3-8B"), 256, 8192, enforce_eager=True) == 0


def _h200_inputs(**overrides: Any) -> m.MemoryInputs:
    h200 = catalogue.gpu("H200")
    fields: dict[str, Any] = dict(
        model=shape("Qwen/Qwen3-8B"),
        gpu_memory_bytes=h200.memory_bytes,
        gpu_name="H200",
        max_model_len=8192,
        max_num_batched_tokens=2048,
    )
    fields.update(overrides)
    return m.MemoryInputs(**fields)


def test_newer_vllm_subtracts_the_graph_estimate() -> None:
    base = m.estimate_memory(_h200_inputs())
    newer = m.estimate_memory(_h200_inputs(subtract_cudagraph_estimate=True))
    assert base.kv_cache_available_bytes - newer.kv_cache_available_bytes == base.cudagraph_bytes


def test_fp8_kv_doubles_tokens() -> None:
    base = m.estimate_memory(_h200_inputs())
    fp8 = m.estimate_memory(_h200_inputs(kv_cache_dtype="fp8"))
    assert fp8.kv_cache_tokens == pytest.approx(2 * base.kv_cache_tokens, rel=0.001)


def test_tp2_halves_kv_per_token_and_adds_nccl_allowance() -> None:
    tp1 = m.estimate_memory(_h200_inputs())
    tp2 = m.estimate_memory(_h200_inputs(tensor_parallel_size=2))
    assert tp2.kv_bytes_per_token * 2 == tp1.kv_bytes_per_token
    assert tp2.non_torch_bytes > tp1.non_torch_bytes
    assert tp2.kv_cache_tokens > 2 * tp1.kv_cache_tokens  # half the weights per GPU too


def test_draft_model_costs_weights_and_kv() -> None:
    draft = shape("Qwen/Qwen3-0.6B")
    base = m.estimate_memory(_h200_inputs())
    spec = m.estimate_memory(_h200_inputs(speculative=mb.SpeculativeSpec("draft_model", 5, draft)))
    assert spec.draft_weights_bytes == mb.weight_bytes_per_gpu(draft)
    # The drafter's layers share the block pool: every block holds target (144 KiB) + draft (112 KiB) tokens.
    assert spec.kv_bytes_per_token == (144 + 112) * KIB
    assert spec.kv_cache_tokens < 0.6 * base.kv_cache_tokens


def test_ngram_costs_nothing_and_eagle_head_is_small() -> None:
    base = m.estimate_memory(_h200_inputs())
    ngram = m.estimate_memory(_h200_inputs(speculative=mb.SpeculativeSpec("ngram", 5)))
    eagle = m.estimate_memory(_h200_inputs(speculative=mb.SpeculativeSpec("eagle", 3)))
    assert ngram.kv_cache_tokens == base.kv_cache_tokens and ngram.draft_weights_bytes == 0
    assert 0.3 * GIB < eagle.draft_weights_bytes < 1 * GIB  # one decoder layer + fc, lm_head shared
    assert eagle.draft_kv_bytes_per_token == 4 * KIB  # one layer of the target's KV
    with pytest.raises(ValueError, match="draft model's shape"):
        m.estimate_memory(_h200_inputs(speculative=mb.SpeculativeSpec("draft_model", 5)))


def test_cpu_backend_uses_given_space_and_128_token_blocks() -> None:
    est = m.estimate_memory(
        m.MemoryInputs(
            model=shape("Qwen/Qwen3-0.6B"), accelerator="cpu", cpu_kv_cache_space_gib=1.0, max_model_len=4096
        )
    )
    assert est.block_size == 128
    assert est.num_blocks == GIB // (128 * 112 * KIB)  # 73 blocks
    assert est.kv_cache_tokens == 73 * 128
    with pytest.raises(ValueError, match="cpu_kv_cache_space_gib"):
        m.estimate_memory(m.MemoryInputs(model=shape("Qwen/Qwen3-0.6B"), accelerator="cpu"))


def test_too_big_model_leaves_no_kv() -> None:
    est = m.estimate_memory(
        m.MemoryInputs(
            model=shape("meta-llama/Llama-3.1-70B-Instruct"),
            gpu_memory_bytes=catalogue.gpu("H100-80GB").memory_bytes,
            max_model_len=8192,
        )
    )
    assert est.kv_cache_available_bytes < 0 and est.num_blocks == 0 and est.kv_cache_tokens == 0
    assert not est.fits_one_request


# ------------------------------------------------------------------------------------- model shapes
def test_shape_fields_from_families() -> None:
    mixtral = shape("mistralai/Mixtral-8x7B-Instruct-v0.1")
    assert (mixtral.num_experts, mixtral.moe_intermediate_size, mixtral.num_experts_per_tok) == (8, 14336, 2)
    ds = shape("deepseek-ai/DeepSeek-V2-Lite")
    assert ds.is_mla and ds.kv_lora_rank == 512 and ds.qk_rope_head_dim == 64 and ds.q_lora_rank is None
    assert ds.num_experts == 64 and ds.shared_expert_intermediate_size == 2 * 1408
    assert ds.num_dense_layers == 1 and ds.num_moe_layers == 26
    llama = shape("meta-llama/Llama-3.1-8B-Instruct")
    assert llama.head_dim == 128 and not llama.is_moe and not llama.qk_norm
    assert shape("Qwen/Qwen3-8B").qk_norm


def test_nested_text_config_is_flattened() -> None:
    inner = catalogue.get("Qwen/Qwen3-8B")
    outer = {
        "architectures": ["SomeVLForConditionalGeneration"],
        "model_type": "some_vl",
        "text_config": inner,
        "torch_dtype": "bfloat16",
    }
    s = ModelShape.from_hf_config(outer)
    assert s.architectures == ("SomeVLForConditionalGeneration",)
    assert (s.hidden_size, s.num_hidden_layers, s.num_key_value_heads) == (4096, 36, 8)


def test_head_dim_defaults_and_missing_fields() -> None:
    cfg = {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32, "vocab_size": 32000}
    s = ModelShape.from_hf_config(cfg)
    assert s.head_dim == 128 and s.num_key_value_heads == 32 and s.intermediate_size == 4 * 4096
    with pytest.raises(ModelShapeError, match="hidden_size"):
        ModelShape.from_hf_config({"num_hidden_layers": 2})


def test_from_dir_reads_config_and_legacy_gptq(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(catalogue.get("Qwen/Qwen3-8B")))
    (tmp_path / "quantize_config.json").write_text(json.dumps({"bits": 4, "group_size": 128}))
    s = ModelShape.from_dir(tmp_path)
    assert s.quantization_config is not None and s.quantization_config["quant_method"] == "gptq"
    assert mb.resolve_quantization(s, None, "bfloat16").method == "gptq"
    with pytest.raises(ModelShapeError, match="no config.json"):
        ModelShape.from_dir(tmp_path / "missing")


# ------------------------------------------------------------------------------------------ catalogue
def test_catalogue_names_and_copies() -> None:
    assert "Qwen/Qwen3-8B" in catalogue.names() and len(catalogue.names()) >= 9
    d = catalogue.get("Qwen/Qwen3-8B")
    d["hidden_size"] = 1
    assert catalogue.get("Qwen/Qwen3-8B")["hidden_size"] == 4096
    assert catalogue.get("qwen3-8b")["num_hidden_layers"] == 36  # bare name, any case


def test_catalogue_key_error_suggests() -> None:
    with pytest.raises(KeyError) as err:
        catalogue.get("Qwen/Qwen3-8")
    assert "Did you mean 'Qwen/Qwen3-8B'" in str(err.value) and "Known:" in str(err.value)
    with pytest.raises(KeyError, match="H200"):
        catalogue.gpu("H2000")
    assert catalogue.gpu("nvidia h100").name == "H100-80GB"
