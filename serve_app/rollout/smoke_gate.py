"""The smoke gate (pure): a short load's summary judged against the config's SLO.

The load itself is not run here: `rollout()` takes a SmokeRunner, and the CLI passes loadtests' (this layer
does not import loadtests). The gate reads only the keys of loadtests' measurement-core summary
(`requests`, `ok`, `error_rate`, `ttft_p95_ms`, `tpot_p50_ms`), whichever module computes it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from serve_app.config import SLOSection


@dataclass(frozen=True)
class SmokeOptions:
    """The short Locust run that gates a rollout."""

    users: int = 2
    duration_s: float = 10.0
    max_tokens: int = 32
    profile: str = "random"
    api: str = "chat"
    request_timeout_s: float = 60.0


SmokeRunner = Callable[[str, str, Path, SmokeOptions], Mapping[str, Any]]
"""Runs the smoke load against (base_url, served model name, raw file, options) and returns its summary
(the measurement core's summary keys above). The CLI passes loadtests.smoke.run_smoke_load: the load
generator lives in loadtests, which this layer does not import."""


@dataclass(frozen=True)
class GateResult:
    """Whether the smoke load met the SLO, why not, and the numbers judged (ms, a rate)."""

    passed: bool
    reasons: tuple[str, ...]
    numbers: dict[str, Any]


def _num(value: Any) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return math.nan
    return number


def gate(summary: Mapping[str, Any], slo: SLOSection) -> GateResult:
    """The smoke load against the config's SLO: TTFT p95, TPOT p50 and error rate (the measurement core's
    summary). No finished request, or no TPOT where requests produced tokens, fails: an unmeasured target
    is not met."""
    requests, ok = int(summary.get("requests") or 0), int(summary.get("ok") or 0)
    error_rate = _num(summary.get("error_rate"))
    ttft, tpot = _num(summary.get("ttft_p95_ms")), _num(summary.get("tpot_p50_ms"))
    numbers = {
        "requests": requests,
        "ok": ok,
        "error_rate": None if math.isnan(error_rate) else round(error_rate, 4),
        "ttft_p95_ms": None if math.isnan(ttft) else round(ttft, 2),
        "tpot_p50_ms": None if math.isnan(tpot) else round(tpot, 2),
    }
    reasons: list[str] = []
    if requests == 0:
        reasons.append("no request finished during the smoke load")
    else:
        if error_rate > slo.max_error_rate:
            reasons.append(
                f"error rate {error_rate:.1%} ({requests - ok} of {requests}) > slo.max_error_rate "
                f"{slo.max_error_rate:.1%}"
            )
        if ok == 0:
            reasons.append("no request succeeded, so TTFT and TPOT were not measured")
        else:
            if math.isnan(ttft) or ttft > slo.ttft_p95_ms:
                reasons.append(f"TTFT p95 {_ms(ttft)} > slo.ttft_p95_ms {slo.ttft_p95_ms:g} ms")
            if math.isnan(tpot) or tpot > slo.tpot_p50_ms:
                reasons.append(f"TPOT p50 {_ms(tpot)} > slo.tpot_p50_ms {slo.tpot_p50_ms:g} ms")
    return GateResult(not reasons, tuple(reasons), numbers)


def _ms(value: float) -> str:
    return "not measured" if math.isnan(value) else f"{value:.1f} ms"
