"""Bench and calibration results as files: JSON (everything), a markdown table, PNG plots.

Summaries are per (method, dataset) plus an ``all`` row per method.  Speedups are
medians of per-prompt ratios (each against the baseline on the same prompt, moments
apart), which is robust to a shared machine's drift; time splits are sums over prompts.
"""
from __future__ import annotations

import json
import statistics
from pathlib import Path
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from .. import atomic_file
from .results import ROUND_FIELDS, BenchResult, PromptRecord

if TYPE_CHECKING:
    from ..calibration import CostCurve


def summarize(result: BenchResult) -> list[dict[str, Any]]:
    rows = []
    methods = list(dict.fromkeys(r.method for r in result.records))
    datasets = list(dict.fromkeys(r.dataset for r in result.records))
    for m in methods:
        for d in datasets + ["all"]:
            recs = [r for r in result.records if r.method == m and (d == "all" or r.dataset == d)]
            if recs:
                rows.append(_summary(m, d, recs))
    return rows


def _summary(method: str, dataset: str, recs: list[PromptRecord]) -> dict[str, Any]:
    wall = sum(r.wall_s for r in recs)
    new = sum(r.new_tokens for r in recs)
    row: dict[str, Any] = {
        "method": method,
        "dataset": dataset,
        "prompts": len(recs),
        "new_tokens": new,
        "tokens_per_s": statistics.median(r.tokens_per_s for r in recs),
        "speedup": statistics.median(r.speedup for r in recs),
        "equal": sum(r.equal for r in recs),
        "same_text_as": {o: sum(o in r.same_text_as for r in recs)
                         for o in dict.fromkeys(o for r in recs for o in r.same_text_as)},
        "mean_accepted_length": None,
        "split": None,
        "bytes_per_token": None,
    }
    prefill = [r.prefill_s for r in recs if r.prefill_s is not None]
    if len(prefill) == len(recs):
        decode = [(r.new_tokens - 1) / (r.wall_s - r.prefill_s) for r in recs
                  if r.new_tokens > 1 and r.wall_s > r.prefill_s]
        row["decode_tokens_per_s"] = statistics.median(decode) if decode else None
    engine = [r.engine for r in recs if r.engine]
    steps = sum(e.get("verify_steps", 0) for e in engine)
    if len(engine) == len(recs) and steps:  # llama-server's counters: drafted rounds, accepted drafts
        row["mean_accepted_length"] = 1 + sum(e["accepted"] for e in engine) / steps
    stats = [r.stats for r in recs if r.stats]
    if len(stats) == len(recs):
        rounds = sum(s["rounds"] for s in stats)
        drafted = [a for r in recs for a in r.accepted]
        if drafted:  # mean accepted length counts the bonus token (records.RunStats convention)
            row["mean_accepted_length"] = sum(a + 1 for a in drafted) / len(drafted)
        parts = {key: sum(s[key] for s in stats) for key in ("prefill_s", "verify_s", "draft_s", "overhead_s")}
        parts["other_s"] = max(0.0, wall - sum(parts.values()))  # API, text assembly, resets
        row["split"] = {k[:-2]: v / wall for k, v in parts.items()} if wall > 0 else None
        row["bytes_per_token"] = sum(s["bytes_to_target"] + s["bytes_to_draft"] for s in stats) / max(new, 1)
        row["rounds"] = rounds
    return row


def _fmt(v: Any, spec: str = ".2f") -> str:
    return "-" if v is None else format(v, spec)


def _tree(shape: dict | None) -> str:
    if not shape:
        return "-"
    return f"{shape['total_tokens']} tokens, depth {shape['depth']}, top-{shape['top_k']}"


def markdown(result: BenchResult) -> str:
    meta = result.meta
    lines = [
        f"# hetero-spec bench: {meta['model']}",
        "",
        f"- target: {meta['target_label']}",
        f"- draft: {meta['draft'] or '-'}; k = {meta['k']}; tree = {_tree(meta.get('tree'))}; "
        f"prompt-lookup tokens = {meta['prompt_lookup_tokens']}; KV cells {meta.get('kv_type', 'f16')}",
        f"- machine: {meta['machine']}",
        f"- {meta['n_prompts']} prompts per dataset, {meta['max_new_tokens']} new tokens, greedy; {meta['date']}",
        f"- {meta['timing']}",
        "",
        "| method | dataset | tok/s | speedup | decode tok/s | mean acc. len | prefill | verify | draft | overhead "
        "| other | bytes/token | equal to raw |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in summarize(result):
        sp = r["split"] or {}
        pct = lambda k: "-" if not sp else f"{100 * sp[k]:.0f}%"  # noqa: E731
        lines.append(
            f"| {r['method']} | {r['dataset']} | {r['tokens_per_s']:.1f} | {r['speedup']:.2f}x | "
            f"{_fmt(r.get('decode_tokens_per_s'), '.1f')} | {_fmt(r['mean_accepted_length'])} | {pct('prefill')} | "
            f"{pct('verify')} | {pct('draft')} | {pct('overhead')} | {pct('other')} | "
            f"{_fmt(r['bytes_per_token'], '.0f')} | {r['equal']}/{r['prompts']} |"
        )
    methods = list(meta["methods"])
    alls = {r["method"]: r for r in summarize(result) if r["dataset"] == "all"}
    lines += ["", "Identical text, method against method (all prompts):", "",
              "| | " + " | ".join(methods) + " |", "|---|" + "---:|" * len(methods)]
    for m in methods:
        r = alls[m]
        cells = ["-" if o == m else f"{r['same_text_as'].get(o, 0)}/{r['prompts']}" for o in methods]
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    lines += ["", "Methods:", ""] + [f"- `{m}`: {d}" for m, d in meta["methods"].items()]
    text_only = sorted({r.method for r in result.records if r.compared_by == "text"})
    if text_only:
        lines += ["", f"Compared with raw by text (their API returns no ids): {', '.join(text_only)}; "
                      "all others by token ids."]
    if meta.get("not_run"):
        lines += ["", "Not run:", ""] + [f"- `{m}`: {why}" for m, why in meta["not_run"].items()]
    if result.projections:
        lines += ["", *projection_markdown(result.projections)]
    return "\n".join(lines) + "\n"


def projection_markdown(rows: list[dict[str, Any]]) -> list[str]:
    """The projections table: replayed rounds priced by a cost curve, beside the measured decode speedup."""
    out = ["## Projected speedups (PROJECTIONS, not measurements)", "",
           "Each prompt's recorded rounds replayed against a cost curve: a round costs t(rows)/t(1) plus its draft "
           "steps x draft step / t(1) (and, if it ran the draft, the switch from the target once); plain decoding "
           "costs 1 per token.  Decode only (prefill excluded), orchestrator overhead excluded.  `measured decode` is "
           "this run's decode speedup over raw on the same prompts; curve `this-run`: calibration passes timed "
           "between this run's prompts, its target times scaled per prompt to raw's own decode time there (the "
           "context length moves them; the draft's times are kept).", "",
           "| curve | method | dataset | projected speedup | measured decode speedup | tokens/round |",
           "|---|---|---|---:|---:|---:|"]
    for r in rows:
        out.append(f"| {r['curve']} | {r['method']} | {r['dataset']} | {r['projected_speedup']:.2f}x | "
                   f"{_fmt(r.get('measured_decode_speedup'))}{'x' if r.get('measured_decode_speedup') else ''} | "
                   f"{r['tokens_per_round']:.2f} |")
    return out


def bench_dict(result: BenchResult) -> dict[str, Any]:
    """Everything as JSON-ready data: meta, summary rows, every prompt's record, projections."""
    meta = dict(result.meta, round_fields=list(ROUND_FIELDS))
    return {"meta": meta, "summary": summarize(result), "prompts": [asdict(r) for r in result.records],
            "projections": result.projections}


def write_bench(result: BenchResult, out: str | Path) -> list[Path]:
    """bench.json, bench.md, speedup.png and accepted_length.png under ``out``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "bench.json", out / "bench.md"]
    paths[0].write_text(json.dumps(bench_dict(result), indent=1))
    paths[1].write_text(markdown(result))
    paths.append(plot_speedup(result, out / "speedup.png"))
    hist = plot_accepted(result, out / "accepted_length.png")
    if hist is not None:
        paths.append(hist)
    return paths


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_speedup(result: BenchResult, path: Path) -> Path:
    plt = _pyplot()
    rows = [r for r in summarize(result) if r["method"] != "raw"]
    methods = list(dict.fromkeys(r["method"] for r in rows))
    datasets = list(dict.fromkeys(r["dataset"] for r in rows))
    width = 0.8 / max(len(methods), 1)
    fig, ax = plt.subplots(figsize=(1.6 + 1.3 * len(datasets), 4))
    for j, m in enumerate(methods):
        vals = [next((r["speedup"] for r in rows if r["method"] == m and r["dataset"] == d), 0) for d in datasets]
        ax.bar([i + j * width for i in range(len(datasets))], vals, width, label=m)
    ax.axhline(1.0, color="black", lw=0.8, ls="--")
    ax.set_xticks([i + width * (len(methods) - 1) / 2 for i in range(len(datasets))], datasets)
    ax.set_ylabel("speedup over raw llama.cpp (median of per-prompt ratios)")
    ax.set_title(f"{result.meta['model']} ({'cost-equivalent' if 'cost-equivalent' in result.meta['target_label'] else 'real'})"
                 f", {result.meta['max_new_tokens']} tokens", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    atomic_file.save_figure(fig, path, dpi=110)
    plt.close(fig)
    return path


def plot_accepted(result: BenchResult, path: Path) -> Path | None:
    """Histogram of accepted drafts per round, one bar group per speculative method; None if none ran."""
    spec = [m for m in result.meta.get("speculative", [])]
    data = {m: [a for r in result.records if r.method == m for a in r.accepted] for m in spec}
    data = {m: v for m, v in data.items() if v}
    if not data:
        return None
    plt = _pyplot()
    top = max(max(v) for v in data.values())
    width = 0.8 / len(data)
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for j, (m, vals) in enumerate(data.items()):
        frac = [vals.count(a) / len(vals) for a in range(top + 1)]
        ax.bar([a + j * width for a in range(top + 1)], frac, width, label=f"{m} (mean len {1 + statistics.fmean(vals):.2f})")
    ax.set_xticks([a + width * (len(data) - 1) / 2 for a in range(top + 1)], [str(a) for a in range(top + 1)])
    ax.set_xlabel("accepted draft tokens per round")
    ax.set_ylabel("fraction of rounds")
    ax.legend(fontsize=8)
    fig.tight_layout()
    atomic_file.save_figure(fig, path, dpi=110)
    plt.close(fig)
    return path


def plot_curve(curve: "CostCurve", path: str | Path) -> Path:
    """t(n)/t(1) measured, its monotone upper envelope, and the linear n for reference."""
    plt = _pyplot()
    ns = sorted(curve.verify_ms)
    env = curve.envelope_ms()
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(ns, [curve.verify_ratio(n) for n in ns], "o-", ms=3, label="t(n)/t(1) measured")
    ax.plot(ns, [env[n] / curve.verify_ms[1] for n in ns], "--", label="monotone upper envelope")
    if curve.draft_step_ms > 0:
        ax.plot(ns, [(curve.verify_ms[1] + n * curve.draft_step_ms) / curve.verify_ms[1] for n in ns], ":",
                label=f"t(1) + n draft steps ({curve.draft_step_ms:.2f} ms each)")
    ax.set_xlabel("rows verified in one decode (n)")
    ax.set_ylabel("cost relative to one row")
    ax.set_title(f"{curve.model}\nt(1) = {curve.verify_ms[1]:.1f} ms; {curve.machine}", fontsize=7)
    ax.legend(fontsize=8)
    fig.tight_layout()
    atomic_file.save_figure(fig, path, dpi=110)
    plt.close(fig)
    return Path(path)
