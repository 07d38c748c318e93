"""headroom's and vLLM's Prometheus metrics, read from Ray's metrics export as Prometheus scrapes it, and the
replica's engine step log."""

from __future__ import annotations

import time

import pytest

from autoscale.replica_stats import NUM_REQUESTS_RUNNING

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


def test_the_replica_logs_each_engine_step_it_served(cluster):
    """The step log a calibration fits step costs to (`engine_steps`): the steps of these requests, in order,
    with every prompt and generated token counted once."""
    from ray import serve

    handle = serve.get_app_handle("main")
    deadline = time.monotonic() + 30
    # Earlier tests' requests have left the engine (their last step is logged before the idle report).
    while handle.record_autoscaling_stats.remote().result(timeout_s=10)[NUM_REQUESTS_RUNNING] > 0:
        assert time.monotonic() < deadline, "main's engine still runs earlier requests"
        time.sleep(0.1)
    since = time.time()
    client = cluster.client()
    probe = {"model": "tiny-qwen3", "max_tokens": 6, "extra_body": {"ignore_eos": True}}
    usages = [client.completions.create(prompt=f"step log probe {i} " * 8, **probe).usage for i in range(3)]
    log = handle.engine_steps.remote(since).result(timeout_s=10)
    steps = log["steps"]
    times = [s["at_s"] for s in steps]
    assert times == sorted(times) and since < times[0] and times[-1] < time.time()
    assert sum(s["prompt_tokens"] for s in steps) == sum(u.prompt_tokens for u in usages)
    assert sum(s["generation_tokens"] for s in steps) == sum(u.completion_tokens for u in usages) == 18
    # One request at a time: each step started from at most one running sequence.
    assert {s["num_running"] for s in steps} <= {0, 1}
    # The KV cache's size turns each step's usage (a fraction of its blocks) into tokens: the one request
    # decoding holds at least its prompt, and at most its prompt and output rounded up to whole blocks.
    held = max(s["kv_cache_usage"] for s in steps) * log["kv_cache_tokens"]
    largest = max(usages, key=lambda u: u.total_tokens)
    block = log["block_size"]
    assert largest.prompt_tokens <= round(held) <= -(-largest.total_tokens // block) * block


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
    """vLLM's engine gauges reach Ray's export. Ray drops a gauge that was not set again within its TTL, and
    an idle engine sets none, so each gauge is polled for after this request sets it: an earlier version
    waited for a counter that earlier tests had already raised and read the gauges once, before the export
    (it failed in a fresh-clone run)."""
    labels = {"model_name": "tiny-qwen3"}
    ttft_count = "ray_vllm_time_to_first_token_seconds_count"
    before = cluster.metric_sum(ttft_count, **labels)
    cluster.client().completions.create(model="tiny-qwen3", prompt="engine metrics", max_tokens=4)
    cluster.wait_for_metric(ttft_count, before + 1, **labels)
    gauges = {
        "ray_vllm_num_requests_running",
        "ray_vllm_num_requests_waiting",
        "ray_vllm_kv_cache_usage_perc",
    }
    seen: set[str] = set()
    deadline = time.time() + 30
    while seen != gauges and time.time() < deadline:
        exported = cluster.metrics()
        seen |= {
            g for g in gauges if any(lab.get("model_name") == "tiny-qwen3" for lab, _ in exported.get(g, []))
        }
        time.sleep(0.5)
    assert seen == gauges, f"not exported within 30 s: {sorted(gauges - seen)}"


def test_per_token_histogram_is_exported_only_where_the_config_asks_for_it(cluster):
    """vLLM's inter-token-latency histogram (one observation per generated token) is left out by default
    (deployment.inter_token_latency_histogram: false, the main app) and exported where it is on (the draft
    app); the per-request TPOT histogram is exported either way."""
    itl = "ray_vllm_inter_token_latency_seconds_count"
    tpot = "ray_vllm_request_time_per_output_token_seconds_count"
    main, drafted = {"model_name": "tiny-qwen3"}, {"model_name": "tiny-qwen3-drafted"}
    itl_before, tpot_before = cluster.metric_sum(itl, **drafted), cluster.metric_sum(tpot, **main)
    for prefix, model in (("", "tiny-qwen3"), ("/draft", "tiny-qwen3-drafted")):
        out = cluster.client(prefix).completions.create(
            model=model, prompt="per-token metrics", max_tokens=8, extra_body={"ignore_eos": True}
        )
        assert out.usage.completion_tokens == 8
    cluster.wait_for_metric(itl, itl_before + 1, **drafted)  # speculation may emit several tokens a step
    cluster.wait_for_metric(tpot, tpot_before + 1, **main)
    assert not [lab for lab, _ in cluster.metrics().get(itl, []) if lab.get("model_name") == "tiny-qwen3"]
