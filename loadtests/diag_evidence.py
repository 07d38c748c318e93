"""The overhead diagnostic's evidence, read and compared without servers: pure, tested directly.

- Environment differences between two processes (secrets redacted), and the variables that change how an
  engine runs (threads, devices, allocators).
- CPU time by thread, grouped by thread name (py-spy and /proc name threads the same way).
- py-spy's raw (collapsed) profiles: where each thread spent its busy samples, and the share of a thread's
  samples with a given frame anywhere on the stack (`python -m loadtests.diag_evidence share ...`).
- HAProxy's stats CSV: sessions per backend server, and whether the backup server (the head node's Serve
  proxy, the slow two-hop path) took any.
- The findings: each hypothesis of issue 12 with what the numbers say about it.
"""

from __future__ import annotations

import csv
import io
import re
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

_SECRET = re.compile(r"TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL|API_KEY|ACCESS_KEY|PRIVATE", re.IGNORECASE)
# Variables that change how an engine process runs: thread pools, devices, allocators, vLLM and torch.
_ENGINE_VARS = re.compile(
    r"^(OMP_|MKL_|OPENBLAS_|KMP_|GOMP_|CUDA_|NCCL_|TORCH|PYTORCH_|VLLM_|TORCHINDUCTOR_|LD_PRELOAD|MALLOC_|"
    r"PYTHONHASHSEED|TOKENIZERS_PARALLELISM|RAYON_|NVIDIA_|TRITON_)"
)


_THREAD_VARS = ("OMP_", "MKL_", "OPENBLAS_", "KMP_", "GOMP_", "TORCHINDUCTOR_COMPILE_THREADS")


def redact(key: str, value: str | None) -> str | None:
    if value is None:
        return None
    return "<redacted>" if _SECRET.search(key) else value[:300]


def env_diff(a: Mapping[str, str], b: Mapping[str, str]) -> dict[str, list[str | None]]:
    """Variables set differently in `a` and `b` (absent = None): {key: [a's value, b's value]}."""
    keys = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
    return {k: [redact(k, a.get(k)), redact(k, b.get(k))] for k in keys}


def is_engine_var(key: str) -> bool:
    """Whether a variable can change an engine's speed (thread pools, devices, allocators, vLLM, torch)."""
    return bool(_ENGINE_VARS.match(key))


def engine_vars(diff: Mapping[str, list[str | None]]) -> dict[str, list[str | None]]:
    """The part of an env_diff that can change an engine's speed."""
    return {k: v for k, v in diff.items() if is_engine_var(k)}


def thread_cpu_by_name(
    before: Mapping[int, tuple[str, float]], after: Mapping[int, tuple[str, float]]
) -> list[dict[str, Any]]:
    """CPU seconds each thread name used between two samples {tid: (name, cpu_s)}, busiest first.
    Threads that started in between count from zero; threads that ended are not counted."""
    used: dict[str, float] = defaultdict(float)
    count: Counter[str] = Counter()
    for tid, (name, cpu_s) in after.items():
        used[name] += cpu_s - before.get(tid, (name, 0.0))[1]
        count[name] += 1
    rows = [{"thread": n, "threads": count[n], "cpu_s": round(s, 4)} for n, s in used.items()]
    return sorted(rows, key=lambda r: -r["cpu_s"])


_RAW_LINE = re.compile(r"^(?P<stack>.*) (?P<count>\d+)$")


def pyspy_profile(raw: Iterable[str], top: int = 12) -> dict[str, Any]:
    """py-spy `record --format raw --threads` output: busy samples per thread and their top leaf frames.

    Each line is `thread (TID): NAME;frame;...;leaf COUNT` (py-spy records only active samples unless
    --idle), so a thread's count over rate x duration is the share of the time it was running Python."""
    threads: dict[str, Counter[str]] = defaultdict(Counter)
    for line in raw:
        parsed = _thread_and_frames(line)
        if parsed is None:
            continue
        name, stack, count = parsed
        threads[name][stack[-1] if stack else "(no python frame)"] += count
    out = {}
    for name, leaves in threads.items():
        total = sum(leaves.values())
        out[name] = {"samples": total, "top": [[leaf, n] for leaf, n in leaves.most_common(top)]}
    return dict(sorted(out.items(), key=lambda kv: -kv[1]["samples"]))


def _thread_and_frames(line: str) -> tuple[str, list[str], int] | None:
    m = _RAW_LINE.match(line.strip())
    if not m:
        return None
    frames = m["stack"].split(";")
    head = frames[0]
    name = head.split(": ", 1)[1] if head.startswith("thread (") and ": " in head else head
    return name, frames[1:], int(m["count"])


def frame_share(raw: Iterable[str], thread: str, frames: Sequence[str]) -> dict[str, list[int]]:
    """For each of `frames` (a substring of a frame, e.g. 'loggers.py:1219'), [samples of the threads whose
    name starts with `thread` that have it anywhere on their stack, all samples of those threads]: the
    inclusive share, which a leaf count (pyspy_profile) misses when the time is spent below the frame."""
    hits = dict.fromkeys(frames, 0)
    total = 0
    for line in raw:
        parsed = _thread_and_frames(line)
        if parsed is None or not parsed[0].startswith(thread):
            continue
        _, stack, count = parsed
        total += count
        for f in frames:
            if any(f in frame for frame in stack):
                hits[f] += count
    return {f: [n, total] for f, n in hits.items()}


def haproxy_servers(stats_csv: str) -> list[dict[str, Any]]:
    """Rows of HAProxy's `/stats;csv` for backend servers: backend, server, sessions total, backup, status."""
    text = stats_csv.lstrip("# ")
    rows = []
    for r in csv.DictReader(io.StringIO(text)):
        if r.get("svname") in ("FRONTEND", "BACKEND", None) or r.get("pxname") == "stats":
            continue
        rows.append(
            {
                "backend": r["pxname"],
                "server": r["svname"],
                "sessions_total": int(r.get("stot") or 0),
                "backup": r.get("bck") == "1",
                "status": r.get("status"),
            }
        )
    return rows


def backup_sessions(before: Sequence[Mapping[str, Any]], after: Sequence[Mapping[str, Any]]) -> int:
    """Sessions the backup servers took between two stats samples."""
    start = {(r["backend"], r["server"]): r["sessions_total"] for r in before}
    return sum(r["sessions_total"] - start.get((r["backend"], r["server"]), 0) for r in after if r["backup"])


# --------------------------------------------------------------------------------------------------------
# Findings
# --------------------------------------------------------------------------------------------------------

GRAPH_CEILING_TOKENS = 512  # vLLM's default max_cudagraph_capture_size on Hopper (compilation.py)


def ttft_deltas(sweep: Sequence[Mapping[str, Any]]) -> dict[int, float]:
    """Median over rounds of headroom's TTFT p50 minus bare's, per prompt length (paired by round)."""
    by_len: dict[int, list[float]] = defaultdict(list)
    pairs: dict[tuple[int, int], dict[str, float]] = defaultdict(dict)
    for m in sweep:
        pairs[(m["input_len"], m["round"])][m["server"]] = m["ttft_p50_ms"]
    for (length, _), servers in pairs.items():
        if "vllm" in servers and "headroom" in servers:
            by_len[length].append(servers["headroom"] - servers["vllm"])
    return {n: sorted(v)[len(v) // 2] for n, v in sorted(by_len.items())}


def graph_boundary_finding(deltas: Mapping[int, float]) -> str | None:
    """Does the added TTFT jump where prefill leaves the CUDA graphs (between 448 and 576 tokens)?"""
    below = [d for n, d in deltas.items() if n <= GRAPH_CEILING_TOKENS]
    above = [d for n, d in deltas.items() if n > GRAPH_CEILING_TOKENS]
    if not below or not above:
        return None
    jump = min(above) - max(below)
    shown = ", ".join(f"{n} tokens {d:+.1f} ms" for n, d in deltas.items())
    if jump > 1.0:
        meaning = "jumps: the extra time is in eager (un-graphed) prefill, the engine core's kernel launches"
    else:
        meaning = "does not jump: the extra time does not come from leaving the graphs"
    return (
        f"TTFT p50 added by headroom at c=1: {shown}. Across the {GRAPH_CEILING_TOKENS}-token CUDA-graph "
        f"ceiling it {meaning} ({jump:+.1f} ms)."
    )


def ratio_finding(label: str, bare: float | None, headroom: float | None, unit: str) -> str | None:
    if not bare or headroom is None:
        return None
    return f"{label}: bare {bare:,.1f} {unit}, headroom {headroom:,.1f} {unit} (x{headroom / bare:.2f})."


def swap_finding(
    before: Mapping[int, float], swapped: Mapping[int, float], tolerance_ms: float = 2.0
) -> str | None:
    """After swapping the servers' GPUs: does headroom's added TTFT stay (the server) or move (the GPU)?"""
    common = [n for n in swapped if n in before]
    if not common:
        return None
    shown = ", ".join(f"{n} tokens {swapped[n]:+.1f} ms (before the swap {before[n]:+.1f})" for n in common)
    stays = all(abs(swapped[n] - before[n]) <= tolerance_ms for n in common)
    follows = "the server, not the GPU" if stays else "the GPU, at least in part"
    return f"GPUs swapped, TTFT p50 added by headroom: {shown}: the difference follows {follows}."


def process_findings(facts: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """Differences between the two servers' engine-core processes: environment, niceness, affinity,
    threads. facts: {"vllm": {...}, "headroom": {...}} from the diagnostic's process snapshot."""
    bare, hr = facts.get("vllm"), facts.get("headroom")
    if not bare or not hr:
        return []
    out = []
    for key, label in (("nice", "niceness"), ("affinity", "CPU affinity"), ("sched_policy", "scheduler")):
        if bare.get(key) != hr.get(key):
            out.append(f"engine core {label} differs: bare {bare.get(key)}, headroom {hr.get(key)}.")
    env_bare, env_hr = bare.get("environ"), hr.get("environ")
    if env_bare is None or env_hr is None:
        shown = "; ".join(
            f"{k}={v!r}" for k, v in (env_hr or env_bare or {}).items() if k.startswith(_THREAD_VARS)
        )
        side = "bare" if env_bare is None else "headroom"
        out.append(
            f"engine core environment: {side}'s is unreadable (its process title overwrote it); the other's "
            f"thread variables: {shown or 'none set'}; vLLM's log lines on Torch threads (below) tell more."
        )
    elif diff := engine_vars(env_diff(env_bare, env_hr)):
        shown = "; ".join(f"{k}: bare {a!r}, headroom {b!r}" for k, (a, b) in diff.items())
        out.append(f"engine core environment differs in engine-relevant variables: {shown}.")
    else:
        out.append("engine core environment: no engine-relevant variable differs.")
    if bare.get("num_threads") != hr.get("num_threads"):
        only = sorted(set(hr.get("thread_names", {})) - set(bare.get("thread_names", {})))
        out.append(
            f"engine core threads: bare {bare.get('num_threads')}, headroom {hr.get('num_threads')}"
            + (f"; only in headroom: {', '.join(only)}" if only else "")
            + "."
        )
    return out


def main(argv: Sequence[str] | None = None) -> int:
    import argparse
    from pathlib import Path

    p = argparse.ArgumentParser(description="Inclusive share of frames in py-spy raw profiles.")
    sub = p.add_subparsers(dest="command", required=True)
    share = sub.add_parser("share", help="per profile: a thread's samples with each frame on the stack")
    share.add_argument("profiles", nargs="+", type=Path, help="py-spy record --format raw --threads output")
    share.add_argument("--thread", required=True, help="thread-name prefix ('AsyncIO Thread', 'MainThread')")
    share.add_argument("--frame", action="append", required=True, help="substring of a frame (repeatable)")
    args = p.parse_args(argv)
    for path in args.profiles:
        for frame, (n, total) in frame_share(path.read_text().splitlines(), args.thread, args.frame).items():
            pct = 100 * n / total if total else 0.0
            print(f"{path.name}\t{args.thread}\t{frame}\t{n} of {total} samples\t{pct:.1f}%")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
