"""Fits the simulated engine's step costs to closed-loop measurements, and writes the calibration file.

A measurement point is a closed-loop run on one replica: ``concurrency`` clients, each sending its next
request when its last one ends, prompts of ``prompt_tokens`` and exactly ``output_tokens`` generated
(``--ignore-eos``), ``requests`` in all; measured TTFT p50, TPOT p50 and output tokens/s. The same run is
replayed on :class:`~autoscale.replica_engine.ReplicaEngine`, and the step costs are fitted (coordinate
search in log space) to the points' relative errors. ``attention_ms_per_kv_token`` stays at the file's
value (the points here cannot tell it from the per-sequence decode cost).

    python -m autoscale.calibrate --points autoscale/data/h200_points.json \\
        [--ladder results/gpu/ladder-random-1024/results.json:1024 ...] \\
        --out autoscale/data/h200_qwen3_8b.json
    python -m autoscale.calibrate --check --points POINTS.json --out CHECK.json   # held-out points, no fit

``--steps PATH...`` fits the step costs, ``attention_ms_per_kv_token`` included, to the replica's step log
during those runs instead (autoscale/step_log.py: linear, one minimum), and the request overhead alone to the
points; how each fit predicts the attainment of H100 replays: results/autoscale/experiments/step_log_fit.txt.

``--vllm-bench PATH...`` adds `vllm bench serve --save-result` runs (closed loop at ``--max-concurrency``,
lengths from their token totals). ``--ladder PATH:PROMPT_TOKENS`` adds every step of a ``headroom ladder``
run (its recommended setting) as a point, with the prompt length the ladder sent and the ladder's
``max_tokens`` as output. Each point lists the metrics the fit matches (``fit``). A closed loop's own TTFT
at high concurrency is kept as a check, not fitted: the real loop falls into waves that the simulated one
does not. Where a run saved each request's send time and TTFT (`vllm bench serve --save-detailed`), the fit
also matches TTFT p50 and p90 with those very arrivals replayed open loop (:func:`replay_arrivals`): the
engine's first tokens under load, apart from the loop's dynamics. On one H100 that brought the simulator's
open-loop attainment from 6-41 points above the measured to 5-18 (results/gpu/2026-12-07/replay). Where it
also kept each request's end-to-end latency, TPOT given the arrivals is reported beside it, not fitted.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import sys
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from autoscale.calibration import DEFAULT_CALIBRATION, EngineCost, EngineLimits, load_calibration
from autoscale.replica_engine import ReplicaEngine, Requests
from autoscale.replica_stats import ReplicaStatsWindow
from autoscale.step_log import fit_step_costs

__all__ = [
    "ARRIVAL_FITTED",
    "Point",
    "arrival_metrics",
    "fit",
    "fit_loss",
    "fit_to_step_logs",
    "main",
    "point_from_vllm_bench_result",
    "replay_arrivals",
    "replay_point",
]

FITTED = ("step_ms", "prefill_ms_per_token", "decode_ms_per_seq", "request_overhead_ms")
METRICS = ("ttft_p50_ms", "tpot_p50_ms", "output_tokens_per_s")
ARRIVAL_FITTED = ("ttft_p50_ms", "ttft_p90_ms")
"""Matched given each request's real send time; TPOT so is a check only: fitting it too improved the
calibration runs but not held-out ones (results/autoscale/experiments/tpot_given_arrivals.txt)."""


@dataclass(frozen=True, slots=True)
class Point:
    """One closed-loop measurement (``None`` where a metric was not measured)."""

    label: str
    source: str
    concurrency: int
    prompt_tokens: int
    output_tokens: int
    requests: int
    ttft_p50_ms: float | None = None
    tpot_p50_ms: float | None = None
    output_tokens_per_s: float | None = None
    fit: tuple[str, ...] = METRICS
    """The metrics the fit matches; the others are kept as a check."""
    arrivals_s: tuple[float, ...] = ()
    """When each request was sent, from the first (where the run saved it, as `vllm bench serve
    --save-detailed` does): the fit also replays these arrivals (:func:`replay_arrivals`)."""
    ttfts_ms: tuple[float, ...] = ()
    """Each request's measured TTFT, in the order of ``arrivals_s``."""
    tpots_ms: tuple[float, ...] = ()
    """Each request's measured time per output token after the first, in the order of ``arrivals_s`` (empty
    where the run did not keep each request's end-to-end latency)."""

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Point:
        known = {k: d[k] for k in cls.__slots__ if k in d}
        unknown = set(known.get("fit", ())) - set(METRICS)
        if unknown:
            raise ValueError(f"point {d.get('label')!r}: fit lists unknown metrics {sorted(unknown)}")
        n_arrivals = len(known.get("arrivals_s", ()))
        if n_arrivals != len(known.get("ttfts_ms", ())):
            raise ValueError(f"point {d.get('label')!r}: arrivals_s and ttfts_ms differ in length")
        if known.get("tpots_ms") and len(known["tpots_ms"]) != n_arrivals:
            raise ValueError(f"point {d.get('label')!r}: arrivals_s and tpots_ms differ in length")
        per_request = {k: tuple(known.get(k, ())) for k in ("arrivals_s", "ttfts_ms", "tpots_ms")}
        return cls(**{**known, "fit": tuple(known.get("fit", METRICS)), **per_request})

    def summary(self, cost: EngineCost, limits: EngineLimits) -> dict[str, Any]:
        """The point as result files show it (its per-request lists left out), with what the simulated
        engine gives: in its own closed loop, and given the measured arrivals."""
        row = {k: v for k, v in asdict(self).items() if k not in ("arrivals_s", "ttfts_ms", "tpots_ms")}
        row["simulated"] = replay_point(self, cost, limits)
        if self.arrivals_s:
            row["given_arrivals"] = {
                "measured": arrival_metrics(self.ttfts_ms, self.tpots_ms),
                "simulated": replay_arrivals(self, cost, limits),
            }
        return row


def replay_point(point: Point, cost: EngineCost, limits: EngineLimits) -> dict[str, float]:
    """The point's closed-loop run on the simulated engine: every client starts at time 0."""
    n = point.requests + point.concurrency
    req = Requests.create([0.0] * n, [point.prompt_tokens] * n, [point.output_tokens] * n)
    engine = ReplicaEngine(cost, limits, req, ReplicaStatsWindow(30.0), 0.0)
    for rid in range(point.concurrency):
        engine.submit(rid, 0.0)
    sent, done = point.concurrency, 0
    while done < point.requests and engine.step():
        finished = engine.window.engine.finished
        for _ in range(finished - done):
            if sent < n:
                req.arrival_s[sent] = engine.clock
                engine.submit(sent, engine.clock)
                sent += 1
        done = finished
    fin = np.array(req.finished_s[: point.requests])
    ttft = np.array(req.ttft_ms[: point.requests])
    arr = np.array(req.arrival_s[: point.requests])
    tpot = ((fin - arr) * 1000.0 + cost.request_overhead_ms - ttft) / max(1, point.output_tokens - 1)
    return {
        "ttft_p50_ms": float(np.median(ttft)),
        "tpot_p50_ms": float(np.median(tpot)),
        "output_tokens_per_s": point.requests * point.output_tokens / float(np.nanmax(fin)),
    }


def arrival_metrics(ttfts_ms: Sequence[float], tpots_ms: Sequence[float] = ()) -> dict[str, float]:
    """What the fit matches given a run's arrivals: TTFT p50 and p90, and TPOT p50 where there are TPOTs."""
    p50, p90 = np.percentile(np.asarray(ttfts_ms, dtype=float), [50.0, 90.0])
    out = {"ttft_p50_ms": float(p50), "ttft_p90_ms": float(p90)}
    if len(tpots_ms):
        out["tpot_p50_ms"] = float(np.median(np.asarray(tpots_ms, dtype=float)))
    return out


def replay_arrivals(point: Point, cost: EngineCost, limits: EngineLimits) -> dict[str, float]:
    """The point's requests sent to the simulated engine when they were really sent (open loop), so TTFT
    and TPOT are the engine model's alone: a real closed loop falls into waves that the simulated one does
    not (results/gpu/README.md), and fitted to the closed loops' own TTFT that would bend the step costs.
    TPOT comes back where the point has each request's (``tpots_ms``)."""
    n = len(point.arrivals_s)
    req = Requests.create(list(point.arrivals_s), [point.prompt_tokens] * n, [point.output_tokens] * n)
    engine = ReplicaEngine(cost, limits, req, ReplicaStatsWindow(30.0), 0.0)
    for rid, t in enumerate(point.arrivals_s):
        engine.advance(t)
        engine.submit(rid, t)
    while engine.step():
        pass
    ttft = np.asarray(req.ttft_ms)
    last_ms = (np.asarray(req.finished_s) - np.asarray(req.arrival_s)) * 1000.0 + cost.request_overhead_ms
    decode_ms = last_ms - ttft
    return arrival_metrics(ttft, decode_ms / max(1, point.output_tokens - 1) if point.tpots_ms else ())


def fit_loss(
    points: Sequence[Point],
    cost: EngineCost,
    limits: EngineLimits,
    given_arrivals: Sequence[str] = ARRIVAL_FITTED,
) -> float:
    """What :func:`fit` minimises: squared log ratios, simulated to measured, over each point's metrics."""
    total = 0.0
    for p in points:
        sim = replay_point(p, cost, limits)
        for m in p.fit:
            measured = getattr(p, m)
            if measured is not None:
                total += math.log(sim[m] / measured) ** 2
        if p.arrivals_s:
            measured, sim_given = arrival_metrics(p.ttfts_ms, p.tpots_ms), replay_arrivals(p, cost, limits)
            total += sum(math.log(sim_given[m] / measured[m]) ** 2 for m in given_arrivals if m in measured)
    return total


def fit(
    points: Sequence[Point],
    start: EngineCost,
    limits: EngineLimits,
    rounds: int = 6,
    given_arrivals: Sequence[str] = ARRIVAL_FITTED,
    fitted: Sequence[str] = FITTED,
) -> EngineCost:
    """Coordinate search in log space over ``fitted`` (the others stay at ``start``'s), halving the step each
    round; ``given_arrivals``: the metrics matched with each point's arrivals replayed (of
    :func:`arrival_metrics`)."""
    best, best_loss = start, fit_loss(points, start, limits, given_arrivals)
    step = math.log(2.0)
    for _ in range(rounds):
        improved = True
        while improved:
            improved = False
            for name in fitted:
                for sign in (1.0, -1.0):
                    trial = replace(best, **{name: getattr(best, name) * math.exp(sign * step)})
                    loss = fit_loss(points, trial, limits, given_arrivals)
                    if loss < best_loss - 1e-12:
                        best, best_loss, improved = trial, loss, True
        step /= 2.0
    return best


def fit_to_step_logs(
    points: Sequence[Point], start: EngineCost, limits: EngineLimits, logs: Sequence[Any]
) -> tuple[EngineCost, EngineLimits]:
    """The step costs fitted to replicas' step logs (``engine_steps``' ``{kv_cache_tokens, steps}``, one or
    several engines of one config: autoscale/step_log.py) and the request overhead alone to ``points``; and
    ``limits`` with the smallest of those engines' KV caches (a simulated replica holds no more than any real
    one did). Raises ValueError for a log without the KV cache's size."""
    if not logs or not all(
        isinstance(log, Mapping) and {"kv_cache_tokens", "steps"} <= set(log) for log in logs
    ):
        raise ValueError("each step log must be engine_steps' {kv_cache_tokens, steps}")
    limits = replace(limits, kv_cache_tokens=min(int(log["kv_cache_tokens"]) for log in logs))
    step = fit_step_costs(logs)
    return fit(points, replace(start, **step), limits, fitted=("request_overhead_ms",)), limits


def points_from_ladder(path: str, prompt_tokens: int) -> list[Point]:
    """Every step of a ladder result's recommended (else last) run, as closed-loop points."""
    data = json.loads(Path(path).read_text())
    runs = data["runs"]
    wanted = (data.get("recommendation") or {}).get("setting")
    run = next((r for r in runs if r.get("setting") == wanted), runs[-1])
    return [
        Point(
            label=f"ladder {run['setting']} c={s['concurrency']}",
            source=path,
            concurrency=int(s["concurrency"]),
            prompt_tokens=prompt_tokens,
            output_tokens=int(data["max_tokens"]),
            requests=int(s["ok"]),
            ttft_p50_ms=s.get("ttft_p50_ms"),
            tpot_p50_ms=s.get("tpot_p50_ms"),
            output_tokens_per_s=s.get("output_tokens_per_s"),
            fit=METRICS if int(s["concurrency"]) == 1 else ("tpot_p50_ms", "output_tokens_per_s"),
        )
        for s in run["steps"]
        if s.get("ok")
    ]


_UNREADABLE_STEP_LOG = (OSError, ValueError, EOFError, zlib.error)
"""What a missing, cut or corrupt step log raises (bad JSON is a ValueError; the rest come from gzip)."""


def _read_step_log(path: Path) -> Any:
    """A step log as the replay saves it: JSON, gzipped in its results (steps_*.json.gz)."""
    data = path.read_bytes()
    return json.loads(gzip.decompress(data) if data[:2] == b"\x1f\x8b" else data)


def point_from_vllm_bench(path: str) -> Point:
    """One `vllm bench serve --save-result` run (closed loop at --max-concurrency) as a point."""
    return point_from_vllm_bench_result(json.loads(Path(path).read_text()), path)


def point_from_vllm_bench_result(d: Mapping[str, Any], source: str) -> Point:
    """:func:`point_from_vllm_bench` from the saved result's contents."""
    done = int(d["completed"])
    c = int(d["max_concurrency"])
    n = len(d.get("start_times") or [])
    e2els, outs = d.get("e2els") or [math.nan] * n, d.get("output_lens") or [0] * n
    sent = sorted(
        (t, f, (e - f) / (o - 1) if o > 1 else math.nan)
        for t, f, e, o in zip(d.get("start_times") or [], d.get("ttfts") or [], e2els, outs, strict=False)
        if f > 0
    )
    tpots = tuple(x * 1000.0 for *_, x in sent)
    if not all(math.isfinite(x) for x in tpots):
        tpots = ()
    return Point(
        label=f"vllm bench c={c}, {d['total_input_tokens'] / done:.0f}/{d['total_output_tokens'] / done:.0f}",
        source=source,
        concurrency=c,
        prompt_tokens=round(d["total_input_tokens"] / done),
        output_tokens=round(d["total_output_tokens"] / done),
        requests=done,
        ttft_p50_ms=d["median_ttft_ms"],
        tpot_p50_ms=d["median_tpot_ms"],
        output_tokens_per_s=d["output_throughput"],
        fit=METRICS if c == 1 else ("tpot_p50_ms", "output_tokens_per_s"),
        arrivals_s=tuple(t - sent[0][0] for t, *_ in sent),
        ttfts_ms=tuple(f * 1000.0 for _, f, _ in sent),
        tpots_ms=tpots,
    )


def _why(e: Exception) -> str:
    """An input error in a line: a missing key named as one (a KeyError's own text is just the key)."""
    return f"no {e}" if isinstance(e, KeyError) else str(e) or type(e).__name__


def check(points: Sequence[Point], source: str, cost: EngineCost, limits: EngineLimits, out: Path) -> int:
    """Held-out points replayed on a calibration as it is: measured beside simulated, and the ratio."""
    rows = [p.summary(cost, limits) for p in points]
    out.write_text(
        json.dumps({"calibration": source, "limits": asdict(limits), "points": rows}, indent=2) + "\n"
    )
    for r in rows:
        sim, given = r["simulated"], r.get("given_arrivals")
        print(
            f"{r['label']:<50} "
            + "  ".join(
                f"{m} {r[m]:.1f} sim {sim[m]:.1f} (x{sim[m] / r[m]:.2f})" for m in METRICS if r[m] is not None
            )
            + "".join(
                f"  {m} given arrivals {given['measured'][m]:.1f} sim {given['simulated'][m]:.1f} "
                f"(x{given['simulated'][m] / given['measured'][m]:.2f})"
                for m in (given["measured"] if given else ())
            )
        )
    print(f"wrote {out}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m autoscale.calibrate", description=__doc__.split("\n\n")[0])
    ap.add_argument("--points", help="JSON list of closed-loop points (see Point)")
    ap.add_argument("--ladder", action="append", default=[], metavar="PATH:PROMPT_TOKENS")
    ap.add_argument("--vllm-bench", nargs="+", default=[], metavar="PATH", help="vllm bench serve results")
    ap.add_argument("--start", default=str(DEFAULT_CALIBRATION), help="calibration to start from")
    ap.add_argument("--out", required=True, help="calibration file to write (with --check: the check's)")
    ap.add_argument(
        "--check",
        action="store_true",
        help="no fit: replay the points on --start's costs and write what the simulator gives beside them",
    )
    ap.add_argument(
        "--steps",
        nargs="+",
        default=[],
        metavar="PATH",
        help="the replica's step logs during the points' runs (engine_steps, as "
        "loadtests/gpu/autoscale_replay.py saves them, gzipped or not): the step costs are fitted to them "
        "(autoscale/step_log.py), the request overhead to the points",
    )
    ap.add_argument("--name", help="what the fitted engine is (GPU, model, vLLM); default: --start's name")
    ap.add_argument("--max-num-seqs", type=int, default=256, help="engine max_num_seqs of the measured runs")
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument(
        "--kv-cache-tokens",
        type=int,
        default=794_064,
        help="the measured engine's (with --steps: the smallest of the logs')",
    )
    args = ap.parse_args(argv)
    if args.name is not None and not args.name.strip():
        ap.error("--name: must not be empty")

    try:
        points = (
            [Point.from_dict(p) for p in json.loads(Path(args.points).read_text())] if args.points else []
        )
    except (OSError, ValueError, TypeError, KeyError) as e:  # unreadable, not JSON, not a list of points
        ap.error(f"--points: {_why(e)}")
    for spec in args.ladder:
        path, _, tokens = spec.rpartition(":")
        try:
            points += points_from_ladder(path, int(tokens))
        except (OSError, ValueError, TypeError, KeyError, IndexError) as e:
            ap.error(f"--ladder {spec}: not PATH:PROMPT_TOKENS of a headroom ladder result ({_why(e)})")
    for path in args.vllm_bench:
        try:
            points.append(point_from_vllm_bench(path))
        except (OSError, ValueError, TypeError, KeyError, ZeroDivisionError) as e:
            ap.error(f"--vllm-bench {path}: not a `vllm bench serve --save-result` file ({_why(e)})")
    if not points:
        ap.error("give --points, --ladder or --vllm-bench")
    limits = EngineLimits(args.max_num_seqs, args.max_num_batched_tokens, args.kv_cache_tokens, 100_000)
    start = load_calibration(args.start)
    if args.check:
        return check(points, args.start, start.cost, limits, Path(args.out))
    sources = sorted({p.source for p in points})
    if args.steps:
        try:  # the smallest logged engine's KV cache, over the flag's
            logs = [_read_step_log(Path(path)) for path in args.steps]
            cost, limits = fit_to_step_logs(points, start.cost, limits, logs)
        except _UNREADABLE_STEP_LOG as e:
            ap.error(f"--steps: {_why(e)}")
        cal = start.with_cost(cost, "measured", "fitted to " + "; ".join(sorted({*sources, *args.steps})))
    else:
        cost = fit(points, start.cost, limits)
        cal = start.with_cost(cost, "measured", "fitted to " + "; ".join(sources))
        attention = start.constants["attention_ms_per_kv_token"]
        cal = replace(cal, constants={**cal.constants, "attention_ms_per_kv_token": attention})
    rows = [p.summary(cal.cost, limits) for p in points]
    cal = replace(cal, name=args.name or cal.name, points=tuple(rows))
    out = Path(args.out)
    out.write_text(json.dumps(cal.to_dict(), indent=2) + "\n")
    for r in rows:
        sim = r["simulated"]
        print(
            f"{r['label']:<40} "
            + "  ".join(f"{m} {r[m]!s:>8} sim {sim[m]:8.1f}" for m in METRICS if r[m] is not None)
        )
    print(f"wrote {out}: {json.dumps(asdict(cal.cost))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
