"""headroom's and vLLM's Prometheus metrics, read from Ray's metrics export as Prometheus scrapes it."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.integration

MAIN = {"application": "main", "deployment": "LLMServer"}


def test_request_histograms_count_each_request(cluster):
    before = {
        name: cluster.metric_sum(name, **MAIN)
        for name in (
            "ray_headroom_ttft_seconds_count",
            "ray_headroom_tpot_seconds_count",
            "ray_headroom_e2e_latency_seconds_count",
            "ray_headroom_output_tokens_sum",
        )
    }
    ok_before = cluster.metric_sum("ray_headroom_requests_total", status="200", **MAIN)
    client = cluster.client()
    for i in range(5):
        stream = client.chat.completions.create(
            model="tiny-qwen3",
            messages=[{"role": "user", "content": f"metrics probe {i}"}],
            max_tokens=20,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        assert len([c for c in stream if c.choices and c.choices[0].delta.content]) > 1
    cluster.wait_for_metric(
        "ray_headroom_ttft_seconds_count", before["ray_headroom_ttft_seconds_count"] + 5, **MAIN
    )
    cluster.wait_for_metric(
        "ray_headroom_tpot_seconds_count", before["ray_headroom_tpot_seconds_count"] + 5, **MAIN
    )
    cluster.wait_for_metric(
        "ray_headroom_e2e_latency_seconds_count", before["ray_headroom_e2e_latency_seconds_count"] + 5, **MAIN
    )
    cluster.wait_for_metric(
        "ray_headroom_output_tokens_sum", before["ray_headroom_output_tokens_sum"] + 100, **MAIN
    )
    cluster.wait_for_metric("ray_headroom_requests_total", ok_before + 5, status="200", **MAIN)
    metrics = cluster.metrics()
    assert any(lab.get("application") == "main" for lab, _ in metrics["ray_headroom_requests_in_flight"])
    # TTFT observations are plausible: positive and well under a minute on this tiny model.
    ttft_sum = cluster.metric_sum("ray_headroom_ttft_seconds_sum", **MAIN)
    ttft_count = cluster.metric_sum("ray_headroom_ttft_seconds_count", **MAIN)
    assert 0 < ttft_sum / ttft_count < 60


def test_error_statuses_are_counted(cluster):
    import httpx

    before = cluster.metric_sum("ray_headroom_requests_total", status="400", **MAIN)
    httpx.post(
        f"{cluster.base_url}/v1/chat/completions",
        json={"model": "tiny-qwen3", "messages": [{"role": "user", "content": "x"}], "max_tokens": -5},
        timeout=30,
    )
    cluster.wait_for_metric("ray_headroom_requests_total", before + 1, status="400", **MAIN)


def test_vllm_engine_metrics_are_exported(cluster):
    cluster.client().completions.create(model="tiny-qwen3", prompt="engine metrics", max_tokens=4)
    cluster.wait_for_metric("ray_vllm_time_to_first_token_seconds_count", 1, model_name="tiny-qwen3")
    names = set(cluster.metrics())
    for name in (
        "ray_vllm_num_requests_running",
        "ray_vllm_num_requests_waiting",
        "ray_vllm_kv_cache_usage_perc",
    ):
        assert name in names
