"""docs/config-reference.md is generated from the schema's Field descriptions and must be current."""

from __future__ import annotations

from pathlib import Path

from serve_app.config.reference import render
from serve_app.config.schema import HeadroomConfig

REFERENCE = Path(__file__).resolve().parents[2] / "docs" / "config-reference.md"


def test_committed_reference_is_current() -> None:
    assert REFERENCE.read_text() == render(), (
        "docs/config-reference.md is stale: python -m serve_app.config.reference > docs/config-reference.md"
    )


def test_every_field_has_a_row_with_its_description() -> None:
    text = render()
    for path in (
        "model.source",
        "engine.speculative.method",
        "deployment.autoscaling.min_replicas",
        "slo.ttft_p95_ms",
    ):
        assert f"| `{path}` |" in text
    assert HeadroomConfig.model_fields["engine"].description in text
