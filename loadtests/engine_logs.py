"""What vLLM logged about its memory, read from engine logs, next to what the planner predicted.

vLLM logs the weights each worker loaded ("Model loading took 15.27 GiB") and the KV cache it sized from
what was left ("GPU KV cache size: 794,704 tokens"). A bare `vllm serve` writes both into its own log; a
headroom replica's engine writes into the replica's Ray worker log, and with tensor parallelism the
weights line comes from each rank's Ray worker. Each KV line is paired with the weights lines logged since
the previous KV line of the same log file. How the engine got its torch.compile graphs is read the same
way: compiled in this start ("Compiling a graph for compile range ...") or loaded from the compile cache
that an earlier engine on the machine wrote ("Directly load the compiled graph(s)", "Directly load AOT
compilation"). Two engines compared for speed should have got them the same way (loadtests/bench_overhead.py).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, replace
from datetime import datetime
from pathlib import Path
from typing import Any

_STAMP = r"(\d\d-\d\d \d\d:\d\d:\d\d)"
_WEIGHTS = re.compile(_STAMP + r".*Model loading took ([\d.]+) GiB")
_KV = re.compile(_STAMP + r".*KV cache size: ([\d,]+) tokens")
_KV_GIB = re.compile(_STAMP + r".*Available KV cache memory: ([\d.]+) GiB")
_PROFILE = re.compile(_STAMP + r".*Total non KV cache memory: ([\d.]+)GiB; torch peak memory increase: "
                      r"([\d.]+)GiB; non-torch forward increase memory: ([\d.]+)GiB")  # fmt: skip
_COMPILED = re.compile(_STAMP + r".*Compiling a graph for compile range")
_LOADED = re.compile(_STAMP + r".*Directly load (?:the compiled graph|AOT compilation)")
_PATTERNS = (
    ("weights", _WEIGHTS),
    ("kv", _KV),
    ("kv_gib", _KV_GIB),
    ("profile", _PROFILE),
    ("compiled", _COMPILED),
    ("loaded", _LOADED),
)
COMPILED = "compiled"
LOADED = "loaded from cache"


@dataclass(frozen=True)
class EngineMemory:
    """One engine's memory as vLLM logged it."""

    source: str
    kv_cache_tokens: int
    weights_gib: float | None
    kv_cache_gib: float | None
    activation_peak_gib: float | None
    logged_at: str
    # COMPILED, LOADED, or None where the log shows neither (eager mode, or a log without those lines).
    torch_compile: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _stamp(text: str) -> datetime:
    return datetime.strptime(text, "%m-%d %H:%M:%S")


def _events(lines: Iterable[str]) -> list[tuple[datetime, str, tuple[str, ...]]]:
    events = []
    for line in lines:
        for kind, pattern in _PATTERNS:
            m = pattern.search(line)
            if m:
                events.append((_stamp(m.group(1)), kind, m.groups()[1:]))
    return sorted(events, key=lambda e: (e[0], e[1] != "weights"))


def parse(lines_by_file: dict[str, Iterable[str]], source: str) -> list[EngineMemory]:
    """The engines logged in these files (one server's log, or one Ray session's logs), in time order.

    A file that logs a KV size is one engine process (a replica with its engine core), so its KV lines
    take the weights logged before them in the same file: engines that start at once on other GPUs do not
    mix. Tensor-parallel ranks that run as their own Ray workers log the weights in files of their own;
    an engine whose file has no weights line takes the latest such line logged before its KV line.
    """
    engines: list[tuple[datetime, EngineMemory]] = []
    rank_weights: list[tuple[datetime, float]] = []
    for lines in lines_by_file.values():
        events = _events(lines)
        if not any(kind == "kv" for _, kind, _ in events):
            rank_weights += [(at, float(v[0])) for at, kind, v in events if kind == "weights"]
            continue
        weights: list[float] = []
        kv_gib = peak = None
        compile_kinds: set[str] = set()
        for at, kind, values in events:
            if kind == "weights":
                weights.append(float(values[0]))
            elif kind in ("compiled", "loaded"):
                compile_kinds.add(kind)
            elif kind == "kv_gib":
                kv_gib = float(values[0])
            elif kind == "profile":
                peak = float(values[1])
            else:
                memory = EngineMemory(
                    source=source,
                    kv_cache_tokens=int(values[0].replace(",", "")),
                    # Every TP rank loads an equal shard: any one is the per-GPU value.
                    weights_gib=max(weights) if weights else None,
                    kv_cache_gib=kv_gib,
                    activation_peak_gib=peak,
                    logged_at=at.strftime("%m-%d %H:%M:%S"),
                    torch_compile=_compile_source(compile_kinds),
                )
                engines.append((at, memory))
                weights, kv_gib, peak, compile_kinds = [], None, None, set()
    engines.sort(key=lambda e: e[0])
    out = []
    for at, memory in engines:
        if memory.weights_gib is None:
            earlier = [w for t, w in sorted(rank_weights) if t <= at]
            if earlier:
                memory = replace(memory, weights_gib=earlier[-1])
        out.append(memory)
    return out


def _compile_source(kinds: set[str]) -> str | None:
    # One graph compiled is a compile, even where another came from the cache.
    if "compiled" in kinds:
        return COMPILED
    return LOADED if kinds else None


def read_files(paths: Iterable[Path]) -> dict[str, list[str]]:
    out = {}
    for path in paths:
        try:
            text = path.read_text(errors="replace")
        except OSError:
            continue
        if "KV cache size" in text or "Model loading took" in text:
            out[str(path)] = text.splitlines()
    return out


def ray_session_logs(session_dir: Path = Path("/tmp/ray/session_latest")) -> dict[str, list[str]]:
    """The worker logs of a Ray session (replicas, their engines, TP workers)."""
    return read_files(sorted((session_dir / "logs").glob("worker-*")))


def compare(predicted: dict[str, float], logged: EngineMemory) -> dict[str, Any]:
    """Predicted vs logged KV tokens (target within 2%) and weights per GPU (within 1%)."""
    kv_error = predicted["kv_cache_tokens"] / logged.kv_cache_tokens - 1
    row: dict[str, Any] = {
        **logged.as_dict(),
        "predicted_kv_cache_tokens": predicted["kv_cache_tokens"],
        "kv_error": kv_error,
        "kv_within_2pct": abs(kv_error) <= 0.02,
        "predicted_weights_gib": predicted["weights_gib"],
    }
    if logged.weights_gib is not None:
        # vLLM rounds the logged GiB to two decimals; an error below that rounding is no error.
        diff = abs(predicted["weights_gib"] - logged.weights_gib)
        row["weights_error"] = (predicted["weights_gib"] / logged.weights_gib - 1) if diff > 0.005 else 0.0
        row["weights_within_1pct"] = abs(row["weights_error"]) <= 0.01
    return row


def expected_memory(plan: Any) -> dict[str, float]:
    """What a plan (serve_app.planner.Plan) predicts vLLM will log: KV tokens and weights per GPU."""
    return {"kv_cache_tokens": plan.kv_cache_tokens_per_replica, "weights_gib": plan.weights_gib_per_gpu}


def compare_each(
    expected: Mapping[str, dict[str, float]], engines: Iterable[EngineMemory]
) -> list[dict[str, Any]]:
    """Each engine against the expected layout nearest its KV size (layouts such as TP=1 and TP=2 differ by
    a factor, so the nearest is the engine's own), as rows of compare() with the layout's name."""
    rows = []
    for engine in engines:
        layout = min(
            expected, key=lambda k: abs(math.log(expected[k]["kv_cache_tokens"] / engine.kv_cache_tokens))
        )
        rows.append({"layout": layout, **compare(expected[layout], engine)})
    return rows
