"""The config overlays loadtests/gpu/run.sh lays over the GPU model (half-gpu.yaml on a one-GPU machine,
EXTRA_CONFIG's) validate there, and change only what they are for: a typo in one would surface only on
the GPU machine, after minutes of set-up."""

from __future__ import annotations

import pytest

from serve_app.config.loading import load_config_files

MODEL = ("configs/base.yaml", "loadtests/gpu/qwen3-8b.yaml")


@pytest.mark.parametrize(
    ("overlay", "changed"),
    [
        ("loadtests/gpu/half-gpu.yaml", lambda c: c.engine.gpu_memory_utilization),
        ("loadtests/gpu/no-access-log.yaml", lambda c: c.deployment.access_log),
    ],
)
def test_gpu_overlay_validates_and_changes_its_field(overlay, changed):
    base = load_config_files(*MODEL)
    laid = load_config_files(*MODEL, overlay)
    assert changed(laid) != changed(base)
    others = {"engine", "deployment"}
    assert laid.model_dump(exclude=others) == base.model_dump(exclude=others)
