"""The replica's vLLM stat logger leaves out vLLM's per-token histogram and keeps every other one."""

from __future__ import annotations

from vllm.v1.metrics.ray_wrappers import RayHistogramWrapper

from serve_app.serving.engine import PER_TOKEN_HISTOGRAMS, RayStatLoggerWithoutPerToken


def make(name: str):
    return RayStatLoggerWithoutPerToken._histogram_cls(
        name=name, documentation="test", buckets=[0.01, 0.1], labelnames=["model_name", "engine"]
    )


def test_the_per_token_histogram_records_nothing_and_registers_nothing() -> None:
    assert {"vllm:inter_token_latency_seconds"} == PER_TOKEN_HISTOGRAMS
    itl = make("vllm:inter_token_latency_seconds")
    child = itl.labels("tiny", "0")  # vLLM makes one child per engine and observes through it
    assert not isinstance(child, RayHistogramWrapper)
    assert not hasattr(child, "metric")  # no Ray metric behind it
    assert child.observe(0.005) is None


def test_every_other_histogram_is_vllms_ray_histogram() -> None:
    for name in ("vllm:request_time_per_output_token_seconds", "vllm:time_to_first_token_seconds"):
        histogram = make(name)
        assert isinstance(histogram, RayHistogramWrapper)
        assert histogram.metric._name == name.replace(":", "_")
