"""The tuning ladder's files: results.json (typed, loadtests/ladder_results.py), report.md, one plot per
profile, gzipped raw files; and the merge of partial runs (`headroom ladder --merge A --merge B`), which is
how a ladder too long for one sitting (a 10-minute GPU call) is measured in parts (`--part k/m`)."""

from __future__ import annotations

import dataclasses
import gzip
import json
import math
import os
import shlex
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import TypeAdapter

from loadtests.ladder_results import (
    MIN_REPEATS,
    Knee,
    LadderPlan,
    LadderResults,
    ProfileAnalysis,
    RunResult,
    SettingSummary,
    analyze,
    knee,
    stop_note,
)

RESULTS = "results.json"
_ADAPTER = TypeAdapter(LadderResults)
# Options that select or place a part of a run, and the repeat count: a command to rerun units sets its own.
_PART_OPTIONS = ("--part", "--only", "--out", "--merge", "--repeats")


def dump(results: LadderResults) -> dict[str, Any]:
    return dataclasses.asdict(results)


def load(data: dict[str, Any]) -> LadderResults:
    return _ADAPTER.validate_python(data)


def read(path: Path) -> LadderResults:
    """A results.json, or the folder that holds one."""
    path = path / RESULTS if path.is_dir() else path
    return load(json.loads(path.read_text()))


def run_knee(run: RunResult, plan: LadderPlan) -> Knee:
    return knee(run.steps, run.steps_planned, plan.ttft_slo_ms, run.kv_ceiling)


def base_command(command: str) -> str:
    """The ladder's command line without the options that pick a part or a folder."""
    words, out = shlex.split(command), []
    skip = False
    for word in words:
        if skip:
            skip = False
            continue
        if word in _PART_OPTIONS:
            skip = True
            continue
        if not word.startswith(tuple(f"{o}=" for o in _PART_OPTIONS)):
            out.append(word)
    return shlex.join(out)


def analyses(results: LadderResults) -> list[ProfileAnalysis]:
    repeats = max(results.plan.repeats, MIN_REPEATS)
    return analyze(results, f"{base_command(results.commands[0])} --repeats {repeats}")


def summary_lines(results: LadderResults) -> list[str]:
    """Each profile's recommendation in one line (what `headroom ladder` prints at the end)."""
    lines = []
    for analysis in analyses(results):
        rec = analysis.recommendation
        knee_text = rec.max_num_seqs.text() if rec.max_num_seqs else "-"
        features = ", ".join(rec.features) or "none"
        lines.append(
            f"{analysis.profile}: {rec.setting} (features kept: {features}), max_num_seqs {knee_text}"
        )
    return lines


def compress(raw: Path) -> Path:
    """raw.jsonl -> raw.jsonl.gz (mtime 0: the same records give the same bytes); the original is removed."""
    target = raw.with_name(raw.name + ".gz")
    with open(raw, "rb") as src, gzip.GzipFile(target, "wb", mtime=0) as dst:
        shutil.copyfileobj(src, dst)
    raw.unlink()
    return target


def merge(parts: Sequence[Path], out: Path) -> LadderResults:
    """The parts' runs as one result (their plans must be the same but for the repeat count, which can be
    raised to add repeats); raw files stay where they are, referenced relative to `out`."""
    loaded = [(p if p.is_dir() else p.parent, read(p)) for p in parts]
    plan = dataclasses.replace(loaded[0][1].plan, repeats=max(part.plan.repeats for _, part in loaded))
    runs: list[RunResult] = []
    seen: set[tuple[str, int, str]] = set()
    for folder, part in loaded:
        if dataclasses.replace(part.plan, repeats=plan.repeats) != plan:
            raise ValueError(
                f"{folder}: a different ladder (plan) than {loaded[0][0]}; only parts of one run merge"
            )
        for run in part.runs:
            key = (run.setting, run.repeat, run.profile)
            if key in seen:
                raise ValueError(
                    f"{folder}: {run.setting} repeat {run.repeat} on {run.profile} is in two parts"
                )
            seen.add(key)
            raw = os.path.relpath((folder / run.raw_file).resolve(), out.resolve())
            runs.append(dataclasses.replace(run, raw_file=raw))
    first = loaded[0][1]
    return LadderResults(
        plan=plan,
        runs=runs,
        machine=first.machine,
        versions=first.versions,
        commands=[c for _, part in loaded for c in part.commands],
        units_planned=[u for _, part in loaded for u in part.units_planned],
    )


def write(results: LadderResults, out: Path, command: str | None = None) -> None:
    """results.json, report.md and ladder-<profile>.png in `out`."""
    out.mkdir(parents=True, exist_ok=True)
    found = analyses(results)
    (out / RESULTS).write_text(json.dumps(dump(results), indent=1, default=str))
    for analysis in found:
        plot(results, analysis, out / f"ladder-{analysis.profile}.png")
    (out / "report.md").write_text(markdown(results, found))


# ------------------------------------------------------------------------------------------ Markdown


def _num(value: float, fmt: str) -> str:
    return "-" if value is None or math.isnan(value) else f"{value:{fmt}}"


def markdown(results: LadderResults, found: Sequence[ProfileAnalysis]) -> str:
    plan = results.plan
    measured = sorted({f"{r.setting}@{r.repeat}" for r in results.runs})
    lines = [
        f"# Tuning ladder: {plan.model}",
        "",
        f"Machine: {results.machine}. Versions: "
        + ", ".join(f"{k} {v}" for k, v in results.versions.items())
        + ".",
        f"Profiles {', '.join(f'`{p}`' for p in plan.profiles)}; {plan.max_tokens} output tokens per "
        f"request; seed {plan.seed}; TTFT p95 SLO {plan.ttft_slo_ms:g} ms. Settings, cumulative: "
        + " -> ".join(s.name for s in plan.settings if not s.speculative)
        + "".join(f"; {s.name} on {s.parent}" for s in plan.settings if s.speculative)
        + f". Each setting {plan.repeats} times on a fresh engine, in interleaved order; each engine "
        f"served every profile. Engines measured: {len(measured)} of {len(results.units_planned)} planned.",
        "Steps (users:seconds): the given ones, then doubling until a step passes the KV-estimated ceiling, "
        "capped by --max-steps; a run ends at its first step over the SLO. "
        + "; ".join(f"`{p}`: `{s}`" for p, s in plan.steps.items())
        + ". Numbers are medians over the repeats with their range (min-max), exact percentiles from the raw "
        "files, each step's first 2 s excluded.",
    ]
    if plan.random_weights:
        lines.append(
            "The model's weights are random (an embedded model or model.dummy_weights): timings and memory "
            "are real; speculative decoding shows its mechanics, not whether it pays on real text."
        )
    for analysis in found:
        lines += profile_section(results, analysis)
    lines += ["", "## Commands", "", *[f"- `{c}`" for c in results.commands], ""]
    return "\n".join(lines)


def profile_section(results: LadderResults, analysis: ProfileAnalysis) -> list[str]:
    plan, rec = results.plan, analysis.recommendation
    knee_text = rec.max_num_seqs.text() if rec.max_num_seqs else "-"
    lines = [
        "",
        f"## Profile `{analysis.profile}`",
        "",
        f"![ladder](ladder-{analysis.profile}.png)",
        "",
        "### Recommendation",
        "",
        f"- setting: **{rec.setting}**; features kept: {', '.join(rec.features) or 'none'}",
        f"- max_num_seqs: **{knee_text}** (the highest step that held TTFT p95 <= {plan.ttft_slo_ms:g} ms in "
        "every repeat of that setting)",
        *[f"- {note}" for note in rec.notes],
    ]
    if analysis.verdicts:
        lines += [
            "",
            "### Verdicts",
            "",
            f"A feature is kept when a gain leaves the noise band (the larger "
            f"relative range of the two settings' {MIN_REPEATS}+ repeats) and nothing gets worse beyond "
            "it; judged at the highest concurrency every repeat of both settings measured.",
            "",
        ]
        lines += [
            f"- **{v.feature}** ({v.setting} against {v.against}): {v.reason}" for v in analysis.verdicts
        ]
    lines += knee_table(analysis.summaries, plan.ttft_slo_ms)
    spec = [s for s in analysis.summaries if s.spec_decode is not None]
    if spec:
        lines += [
            "",
            "### Speculative decoding, vLLM's own counters",
            "",
            "| setting | drafts | draft tokens | accepted tokens | acceptance rate | mean accepted length |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for s in spec:
            c = s.spec_decode
            assert c is not None
            lines.append(
                f"| {s.setting.name} | {c.drafts:,.0f} | {c.draft_tokens:,.0f} | {c.accepted_tokens:,.0f} "
                f"| {_num(c.acceptance_rate, '.1%')} | {_num(c.mean_accepted_length, '.2f')} |"
            )
    lines += steps_table(analysis.summaries)
    return lines


def knee_table(summaries: Sequence[SettingSummary], slo_ms: float) -> list[str]:
    lines = [
        "",
        "### Knee and the KV-estimated ceiling",
        "",
        "| setting | repeats | knee, each repeat | knee, every repeat | KV-estimated ceiling "
        "| knee / ceiling | peak memory GiB | why the runs stopped |",
        "|---|---:|---|---:|---:|---:|---|---|",
    ]
    for s in summaries:
        k = s.knee
        ratio = s.knee_to_ceiling
        ratio_text = "-" if math.isnan(ratio) else (">= " if k and k.at_least else "") + f"{ratio:.2g}"
        why = sorted({stop_note(kn, slo_ms) for kn in s.knees})
        cells = [
            s.setting.name,
            str(s.repeats),
            ", ".join(kn.text() for kn in s.knees) or "-",
            k.text() if k else "-",
            f"{s.kv_ceiling:,}" if s.kv_ceiling is not None else "-",
            ratio_text,
            s.peak_memory_gib.text(".2f"),
            "; ".join(why),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        "The ceiling is how many requests of the measured mean size (prompt + output tokens) the "
        "planner's KV cache holds; the knee is usually lower, because TTFT degrades before the cache "
        "fills.",
    ]
    return lines


def steps_table(summaries: Sequence[SettingSummary]) -> list[str]:
    """Every setting's steps: medians over the repeats (min-max)."""
    lines = [
        "",
        "### Steps",
        "",
        "| setting | concurrency | repeats | TTFT p50 ms | TTFT p95 ms | TPOT p50 ms | output tok/s "
        "| errors (max) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for s in summaries:
        for step in s.steps:
            m = step.metrics
            lines.append(
                f"| {s.setting.name} | {step.concurrency} | {step.repeats} | {m['ttft_p50_ms'].text()} | "
                f"{m['ttft_p95_ms'].text()} | {m['tpot_p50_ms'].text('.2f')} | "
                f"{m['output_tokens_per_s'].text('.0f')} | {step.error_rate_max:.1%} |"
            )
    return lines


# ------------------------------------------------------------------------------------------ plot


def plot(results: LadderResults, analysis: ProfileAnalysis, path: Path) -> None:
    """TTFT p95, TPOT p50 and throughput against concurrency (median, range as error bars), peak memory."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    (ttft, tpot), (tput, mem) = axes
    for s in analysis.summaries:
        for ax, key in ((ttft, "ttft_p95_ms"), (tpot, "tpot_p50_ms"), (tput, "output_tokens_per_s")):
            c = [step.concurrency for step in s.steps]
            spreads = [step.metrics[key] for step in s.steps]
            med = [sp.median for sp in spreads]
            err = [[sp.median - sp.low for sp in spreads], [sp.high - sp.median for sp in spreads]]
            ax.errorbar(c, med, yerr=err, marker="o", capsize=3, label=s.setting.name)
    concurrencies = sorted({step.concurrency for s in analysis.summaries for step in s.steps})
    ttft.axhline(results.plan.ttft_slo_ms, color="red", linewidth=0.8, label="TTFT SLO")
    for ax, title, unit in (
        (ttft, "TTFT p95", "ms"),
        (tpot, "TPOT p50", "ms"),
        (tput, "output throughput", "tok/s"),
    ):
        ax.set(title=title, xlabel="concurrency", ylabel=unit, xscale="log")
        ax.set_xticks(concurrencies, [str(c) for c in concurrencies])
        ax.minorticks_off()
        ax.legend(fontsize=6)
    names = [s.setting.name for s in analysis.summaries]
    mem.bar(names, [s.peak_memory_gib.median for s in analysis.summaries])
    mem.set(title="peak memory (median over repeats)", ylabel="GiB")
    mem.tick_params(axis="x", labelrotation=20, labelsize=7)
    fig.suptitle(f"{results.plan.model}, profile {analysis.profile}: median and range over the repeats")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
