"""The simulator's numbers: the engine's step costs (a calibration file) and the deployment's limits.

An engine step that prefills ``P`` prompt tokens and decodes ``D`` sequences holding ``K`` context tokens
takes ``step_ms + prefill_ms_per_token * P + decode_ms_per_seq * D + attention_ms_per_kv_token * K``; a
request's first token reaches the client ``request_overhead_ms`` after the step that sampled it (HTTP,
tokenization, detokenization, IPC). The constants live in a JSON file (autoscale/data/*.json), each with
its status (``measured``: fitted to the measurements named in ``source``; ``assumed``: not measured) so a
GPU run can replace the file (``python -m autoscale.calibrate``) without touching code.

The limits come from the plan (``max_num_seqs``, the KV cache, the step's token budget) and the deployment
(``max_ongoing_requests``): data the benchmark reads from a JSON the CLI glue writes
(loadtests/autoscale_inputs.py), because autoscale does not import the planner.

Pure: json and dataclasses.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Literal

__all__ = [
    "DEFAULT_CALIBRATION",
    "Admission",
    "Calibration",
    "Constant",
    "EngineCost",
    "EngineLimits",
    "load_calibration",
]

DATA_DIR = Path(__file__).resolve().parent / "data"
DEFAULT_CALIBRATION = DATA_DIR / "h200_qwen3_8b.json"

Status = Literal["measured", "assumed"]


@dataclass(frozen=True, slots=True)
class EngineCost:
    """Costs of one engine step and of a request's way in and out, in milliseconds."""

    step_ms: float
    prefill_ms_per_token: float
    decode_ms_per_seq: float
    attention_ms_per_kv_token: float
    request_overhead_ms: float

    def __post_init__(self) -> None:
        for f in fields(self):
            if getattr(self, f.name) < 0:
                raise ValueError(f"EngineCost.{f.name} ({getattr(self, f.name)}) must be >= 0")
        if self.step_ms <= 0:
            raise ValueError(f"EngineCost.step_ms ({self.step_ms}) must be > 0")


@dataclass(frozen=True, slots=True)
class EngineLimits:
    """What bounds concurrency on one replica: the plan's engine limits and Serve's admission limit."""

    max_num_seqs: int
    max_num_batched_tokens: int
    kv_cache_tokens: int
    max_ongoing_requests: int

    def __post_init__(self) -> None:
        for f in fields(self):
            if getattr(self, f.name) < 1:
                raise ValueError(f"EngineLimits.{f.name} ({getattr(self, f.name)}) must be >= 1")


@dataclass(frozen=True, slots=True)
class Admission:
    """What happens to a request that finds every replica at ``max_ongoing_requests``, and what its
    client does then.

    ``retry_after_s`` None: it waits at Serve's router until a replica has room (Serve without a queue
    bound). A number: the replica refuses it at once with 503 + Retry-After (headroom's
    ``security.overload``, on in configs/base.yaml), and the client sends it again that many seconds
    later, at most ``client_retries`` times (the official openai client retries 5xx twice by default,
    honouring Retry-After). A refused attempt reaches the replica's HTTP layer, so the replica counts it
    as an arrival, as the live replica does (serve_app/serving/asgi.py counts before it admits)."""

    retry_after_s: float | None = None
    client_retries: int = 2

    def __post_init__(self) -> None:
        if self.retry_after_s is not None and self.retry_after_s <= 0:
            raise ValueError(f"Admission.retry_after_s ({self.retry_after_s}) must be > 0 or None")
        if self.client_retries < 0:
            raise ValueError(f"Admission.client_retries ({self.client_retries}) must be >= 0")

    @property
    def refuses(self) -> bool:
        return self.retry_after_s is not None


@dataclass(frozen=True, slots=True)
class Constant:
    value: float
    status: Status
    source: str


@dataclass(frozen=True, slots=True)
class Calibration:
    """An engine's step costs with the provenance of every constant."""

    name: str
    constants: Mapping[str, Constant]
    points: tuple[Mapping[str, Any], ...] = ()
    """The measurements the constants were fitted to (closed-loop runs), kept for the record."""
    notes: str = ""

    @property
    def cost(self) -> EngineCost:
        names = [f.name for f in fields(EngineCost)]
        missing = [n for n in names if n not in self.constants]
        if missing:
            raise ValueError(f"calibration {self.name!r} lacks {', '.join(missing)}")
        return EngineCost(**{n: self.constants[n].value for n in names})

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "constants": {k: asdict(c) for k, c in self.constants.items()},
            "points": [dict(p) for p in self.points],
            "notes": self.notes,
        }

    def with_cost(self, cost: EngineCost, status: Status, source: str) -> Calibration:
        consts = {k: Constant(v, status, source) for k, v in asdict(cost).items()}
        return Calibration(self.name, {**self.constants, **consts}, self.points, self.notes)


def _constant(name: str, raw: Any) -> Constant:
    if not isinstance(raw, Mapping) or not {"value", "status", "source"} <= set(raw):
        raise ValueError(f"calibration constant {name!r} needs value, status and source, got {raw!r}")
    if raw["status"] not in ("measured", "assumed"):
        raise ValueError(f"calibration constant {name!r}: status must be measured or assumed")
    return Constant(float(raw["value"]), raw["status"], str(raw["source"]))


def load_calibration(path: str | Path = DEFAULT_CALIBRATION) -> Calibration:
    """Reads a calibration file (the format :meth:`Calibration.to_dict` writes)."""
    data = json.loads(Path(path).read_text())
    consts = {k: _constant(k, v) for k, v in data.get("constants", {}).items()}
    cal = Calibration(str(data.get("name", Path(path).stem)), consts, tuple(data.get("points", ())))
    cal.cost  # noqa: B018  (validates: every constant present and in range)
    return Calibration(cal.name, consts, cal.points, str(data.get("notes", "")))
