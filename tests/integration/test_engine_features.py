"""Prefix caching and speculative decoding set in YAML reach the engine: shown by the engine's own metrics."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.integration


def test_prefix_caching_reuses_a_shared_prefix(cluster):
    labels = {"model_name": "tiny-qwen3"}
    before = cluster.metric_sum("ray_vllm_prefix_cache_hits_total", **labels)
    # Two full KV blocks (block size 128 on CPU) of shared prefix, then different endings.
    prefix = " ".join(f"rule {i} keeps the cache warm." for i in range(80))
    client = cluster.client()
    for tail in ("first question", "second question"):
        client.completions.create(model="tiny-qwen3", prompt=f"{prefix} {tail}", max_tokens=2)
    cluster.wait_for_metric("ray_vllm_prefix_cache_hits_total", before + 256, **labels)


def _drafts_reach_engine(cluster, prefix: str, model: str) -> None:
    labels = {"model_name": model}
    before = cluster.metric_sum("ray_vllm_spec_decode_num_drafts_total", **labels)
    # Token ids covering most of the tiny vocabulary, so the n-gram proposer finds every token the random
    # model generates earlier in the context (the draft model proposes regardless).
    prompt = list(range(3, 1500))
    cluster.client(prefix).completions.create(
        model=model, prompt=prompt, max_tokens=64, extra_body={"ignore_eos": True}
    )
    cluster.wait_for_metric("ray_vllm_spec_decode_num_drafts_total", before + 1, **labels)


def test_ngram_speculation_reaches_engine(cluster):
    _drafts_reach_engine(cluster, "", "tiny-qwen3")


def test_draft_model_speculation_reaches_engine(cluster):
    _drafts_reach_engine(cluster, "/draft", "tiny-qwen3-drafted")
