"""The markdown tables README.md and docs/ quote, regenerated from the data files under results/.

Every figure the documentation quotes comes from a file in this repository: a ``hetero-spec bench``
``bench.json`` (copied under ``results/bench/`` with the command that made it), the JSON a measurement
script wrote with ``--out`` / ``--json``, a recorded script output (``record`` below), or a shipped
draft's own training summary.  Each table names its file, the command and the CPU.  In the docs a
table sits between ``<!-- results:NAME -->`` and ``<!-- /results -->``; ``tests/test_docs.py`` fails
when a block differs from what this script makes of the files.

    python scripts/results_tables.py list                  # table names and the files they read
    python scripts/results_tables.py show headline         # one table, to stdout
    python scripts/results_tables.py write                 # rewrite every block in README.md and docs
    python scripts/results_tables.py check                 # exit 1 if a block is stale
    python scripts/results_tables.py plot                  # results/plots/speedup-by-set.png
    python scripts/results_tables.py add bench-out/bench.json NAME --command "hetero-spec bench ..."
    python scripts/results_tables.py record results/exactness/NAME.json 'python scripts/x.py "$(python scripts/default_model.py)"'
    python scripts/results_tables.py summaries results/training/NAME.json run-a.safetensors ... --command "hetero-spec train ..."
"""
from __future__ import annotations

import json
import os
import platform
import re
import statistics
import struct
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import click

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "results"
PROVENANCE = RESULTS / "provenance.json"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "drafts" / "README.md"]
BLOCK = re.compile(r"(<!-- results:([\w-]+) -->\n)(.*?)(<!-- /results -->)", re.S)
SETS7 = ["grounded", "multiturn", "agentic", "mt_bench", "humaneval", "gsm8k", "alpaca", "all"]
SETS4 = ["mt_bench", "humaneval", "gsm8k", "alpaca", "all"]

# The runs the tables read (paths relative to results/).
WITH_DRAFT = "bench/smollm2-q4_0-epyc-7sets-darter.json"
NO_DRAFT = "bench/smollm2-q4_0-epyc-7sets-no-draft.json"
CHAIN = "bench/smollm2-q4_0-xeon-amx-vm-chain-k3-darter.json"
CHAIN_STEEP = "bench/smollm2-q4_0-xeon-amx-vm-chain-k3-darter-steep.json"  # the same command on a steeper t(n)
CURVE_STEEP = "calibration/smollm2-q4_0-darter-xeon-amx-vm-steep.json"
SUFFIX_STEEP = "bench/smollm2-q4_0-xeon-amx-vm-7sets-no-draft-steep.json"  # 20 prompts a set, the steeper host
SUFFIX_CURVE_STEEP = "calibration/smollm2-q4_0-xeon-amx-vm-steep.json"  # no draft, the same host, the same session
SUFFIX_REPLAY = "suffix/replay-steep.json"  # scripts/replay_suffix.py on that curve
DRAFT_STEP = "draft_step/smollm2-q4_0-xeon-amx-vm.json"
DRAFT_STEP_EPYC = "draft_step/smollm2-q4_0-epyc.json"  # the same, with --positions 1200
TREE_DRAFT = "draft_step/smollm2-q4_0-epyc-tree-draft.json"  # scripts/bench_tree_draft.py: native against torch
KERNELS = "kernels/smollm2-q4_0-xeon-amx-vm.json"
SERVER_ONE = "server/smollm2-q4_0-xeon-amx-vm-one-client.json"
SERVER_SLOTS = "server/smollm2-q4_0-xeon-amx-vm-batched-8-clients.json"
SERVER_SLOTS_STEEP = "server/smollm2-q4_0-xeon-amx-vm-batched-8-clients-steep.json"  # the same command, steeper host
SERVER_SLOTS_EPYC = "server/smollm2-q4_0-epyc-batched-8-clients.json"  # the same parts and the 1-client one, AMD EPYC
SERVER_SLOTS_SAMPLED = "server/smollm2-q4_0-epyc-batched-8-clients-sampled.json"  # the load sampled, seeded (EPYC)
ENGINE = "server/smollm2-q4_0-xeon-amx-vm-engine-draft.json"
CROSS = "server/smollm2-q4_0-xeon-amx-vm-cross-thread.txt"
DRAFTS = ["smollm2-135m-darter.safetensors", "smollm2-135m-eagle3.safetensors", "smollm2-135m-eagle.safetensors"]
MADE = "make_draft/smollm2-q4_0-1h.report.json"  # make-draft --hours 1 on the default model
TIME_TO_DRAFT = "make_draft/time-to-draft.json"  # scripts/project_make_draft.py on MADE_NOW and TINY_MADE
MADE_STOPPED = "make_draft/smollm2-q4_0-epyc-1h-stop-loops.report.json"  # the same with loops left ungenerated
MADE_NOW = "make_draft/smollm2-q4_0-epyc-1h.report.json"  # ... and the corpus's larger share of the hour (the default)
MADE_NOW_BENCH = "bench/smollm2-q4_0-epyc-made-1h.json"
TINY_MADE = "make_draft/tiny-llama-q8_0.report.json"
SHAPES = "bench/smollm2-q4_0-epyc-laptop-shapes-darter.json"  # fixed shapes, projected on laptop-7b-q4_0
STEP_DECAY_RUNS = "training/step-decay-seed1.json"  # trainer summaries of the four runs (``summaries`` below)
STEP_DECAY = [("darter", "0.8"), ("darter", "0.5"), ("eagle3", "0.8"), ("eagle3", "0.5")]
MAKE_PROMPTS = "make_draft/smollm2-q4_0-epyc-make-prompts.json"  # scripts/bench_make_prompts.py
STOP_LOOPS = "make_draft/smollm2-q4_0-epyc-stop-loops.json"  # scripts/bench_corpus.py --stop-loops
CORPUS_MIX_RUNS = "training/corpus-mix-seed1.json"  # trainer summaries: ShareGPT alone, half of it, half + own requests
# (run name, what its corpus holds), in the table's order
CORPUS_MIX = [("sharegpt", "ShareGPT conversations"), ("half", "the first of them (ShareGPT's first shard)"),
              ("mix", "that shard and requests the target wrote itself (general, Python, math)")]


@dataclass(frozen=True)
class Source:
    """Where a table's figures come from: the file, the command that wrote it and the CPU it ran on."""

    path: str
    command: str
    cpu: str

    def line(self) -> str:
        return f"`{self.path}`: `{self.command}` on {self.cpu}."


def load(rel: str) -> Any:
    path = RESULTS / rel
    return json.loads(path.read_text()) if path.suffix == ".json" else path.read_text()


def provenance() -> dict[str, dict[str, str]]:
    """Command and CPU of the files that do not carry them inside (text output, older JSON)."""
    data = json.loads(PROVENANCE.read_text()) if PROVENANCE.exists() else {}
    return {k: v for k, v in data.items() if not k.startswith("_")}


def source(rel: str) -> Source:
    """The command and CPU recorded in the file itself, else in results/provenance.json."""
    data = load(rel) if rel.endswith(".json") else None
    command = cpu = None
    if isinstance(data, dict):
        meta = data.get("meta", data)
        command = meta.get("command")
        cpu = meta.get("cpu") or meta.get("machine")
    extra = provenance().get(rel, {})
    command, cpu = command or extra.get("command"), extra.get("cpu") or cpu
    if not command or not cpu:
        raise click.ClickException(f"results/{rel}: no command or CPU recorded (in the file or in {PROVENANCE.name})")
    return Source(f"results/{rel}", command, cpu)


def sources_footer(*rels: str) -> str:
    return "\n".join(f"- {source(r).line()}" for r in rels)


def summary(rel: str) -> dict[tuple[str, str], dict[str, Any]]:
    return {(row["method"], row["dataset"]): row for row in load(rel)["summary"]}


def x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def f2(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def set_range(rows: dict[tuple[str, str], dict[str, Any]], method: str, sets: list[str], key: str = "speedup") -> str:
    vals = [rows[(method, s)][key] for s in sets if s != "all" and (method, s) in rows]
    return f"{min(vals):.2f}-{max(vals):.2f}x"


def equal(rows: dict[tuple[str, str], dict[str, Any]], method: str) -> str:
    r = rows[(method, "all")]
    return f"{r['equal']}/{r['prompts']}"


def bench_meta_line(rel: str) -> str:
    m = load(rel)["meta"]
    return (f"SmolLM2-135M-Instruct all-Q4_0 (`{m['model']}`), {m['threads']} threads, KV cells {m['kv_type']}, "
            f"greedy, {m['max_new_tokens']} new tokens, the first {m['n_prompts']} prompts of each set, {m['date']}. "
            "Speedup: median over prompts of tokens/s (wall time with prefill) against `raw` on the same prompt.")


# ---------------------------------------------------------------- tables

def t_headline() -> str:
    d, n, c = summary(WITH_DRAFT), summary(SUFFIX_STEEP), summary(CHAIN)
    one, slots = load(SERVER_ONE)["overhead"], load(SERVER_SLOTS_STEEP)
    rows = [
        ("`run`'s default (`--draft-len auto`), shipped darter draft (draft + suffix trees)",
         x(d[("auto-suffix", "all")]["speedup"]), set_range(d, "auto-suffix", SETS7), equal(d, "auto-suffix"), "a"),
        ("`auto`, no draft model (suffix trees over prompt, output, past outputs)",
         x(n[("auto-suffix", "all")]["speedup"]), set_range(n, "auto-suffix", SETS7), equal(n, "auto-suffix"), "b"),
        ("fixed chain k=3, shipped darter draft", x(c[("chain-k3", "all")]["speedup"]), set_range(c, "chain-k3", SETS4),
         equal(c, "chain-k3"), "c"),
        ("`auto --no-suffix` (draft + prompt lookup) in the same run as the chain", x(c[("auto", "all")]["speedup"]), set_range(c, "auto", SETS4),
         equal(c, "auto"), "c"),
        ("llama.cpp's n-gram speculation (llama-server `--spec-type ngram-simple`)",
         x(d[("llama.cpp-ngram", "all")]["speedup"]), set_range(d, "llama.cpp-ngram", SETS7),
         equal(d, "llama.cpp-ngram"), "a"),
        ("`serve`, one client: decode tokens/s against `run`", f"{one['median_decode_ratio']:.3f}", "-",
         "all" if one["all_texts_equal"] else "no", "d"),
        ("`serve` (4 slots), 8 clients: aggregate tokens/s against llama-server `-np 4`, speculation off / on",
         " / ".join(f"{_batched(slots, 'hetero-spec', spec)['aggregate_tps'] / _batched(slots, 'llama-server', peer)['aggregate_tps']:.2f}x"
                    for spec, peer in (("off", "off"), ("on", _best_ngram(slots)))), "-",
         "all" if all(c.get("texts_equal_one_sequence") for c in slots["batched"]["configs"]
                      if c["server"] == "hetero-spec") else "no", "e"),
    ]
    lines = ["| what | speed against plain llama.cpp decoding, all sets | per set | outputs equal to plain | run |",
             "|---|---:|---:|---:|---|"]
    lines += [f"| {a} | {b} | {s} | {e} | {r} |" for a, b, s, e, r in rows]
    srcs = [source(rel) for rel in (WITH_DRAFT, SUFFIX_STEEP, CHAIN, SERVER_ONE, SERVER_SLOTS_STEEP)]
    cpus = {s.cpu for s in srcs}
    lines.append("")
    if len(cpus) == 1:
        lines.append(f"All on {cpus.pop()}; the commands, and the files that hold their output:")
        lines.append("")
    for tag, src in zip("abcde", srcs):
        where = "" if len({s.cpu for s in srcs}) == 1 else f" on {src.cpu}"
        lines.append(f"- ({tag}) `{src.command}`{where}: `{src.path}`")
    return "\n".join(lines)


def t_speedup_7sets() -> str:
    d, n = summary(WITH_DRAFT), summary(NO_DRAFT)
    methods = [("auto-suffix", d, "`auto-suffix` (darter draft + suffix trees: `run`'s default)"),
               ("auto", d, "`auto` (darter draft + prompt lookup: `run --no-suffix`)"),
               ("auto-suffix", n, "`auto-suffix`, no draft model"),
               ("llama.cpp-ngram", d, "llama.cpp `ngram-simple`"),
               ("llama.cpp-ngram-mod", d, "llama.cpp `ngram-mod`"),
               ("llama.cpp-ngram-cache", d, "llama.cpp `ngram-cache`")]
    lines = ["| method | " + " | ".join(SETS7) + " | mean acc. len (all) | equal to raw |",
             "|---|" + "---:|" * (len(SETS7) + 2)]
    for m, rows, label in methods:
        cells = [x(rows[(m, s)]["speedup"]) for s in SETS7]
        lines.append(f"| {label} | " + " | ".join(cells)
                     + f" | {f2(rows[(m, 'all')]['mean_accepted_length'])} | {equal(rows, m)} |")
    dec = [f"{n[('auto-suffix', s)]['decode_tokens_per_s'] / n[('raw', s)]['decode_tokens_per_s']:.2f}x" for s in SETS7]
    lines.append("| decode tokens/s only, `auto-suffix` no draft model | " + " | ".join(dec) + " | | |")
    return "\n".join(lines) + "\n\n" + bench_meta_line(WITH_DRAFT) + "\n\n" + sources_footer(WITH_DRAFT, NO_DRAFT)


def t_suffix_steep() -> str:
    """Suffix trees without a draft model against llama.cpp's n-gram modes, end to end and decode only."""
    r = summary(SUFFIX_STEEP)
    v = load(SUFFIX_CURVE_STEEP)["verify_ms"]
    curve = ("| t(n)/t(1), n = | 2 | 4 | 8 | 16 | 17 | t(1) |\n|---|---:|---:|---:|---:|---:|---:|\n"
             "| this host | " + " | ".join(f"{v[str(n)] / v['1']:.2f}" for n in (2, 4, 8, 16, 17))
             + f" | {v['1']:.1f} ms |\n\n" + sources_footer(SUFFIX_CURVE_STEEP))
    methods = [("auto-suffix", "`auto-suffix`, no draft model"), ("llama.cpp-ngram", "llama.cpp `ngram-simple`"),
               ("llama.cpp-ngram-mod", "llama.cpp `ngram-mod`"), ("llama.cpp-ngram-cache", "llama.cpp `ngram-cache`")]
    lines = ["| method | " + " | ".join(SETS7) + " | mean acc. len (all) | equal to raw |",
             "|---|" + "---:|" * (len(SETS7) + 2)]
    for m, label in methods:
        lines.append(f"| {label} | " + " | ".join(x(r[(m, s)]["speedup"]) for s in SETS7)
                     + f" | {f2(r[(m, 'all')]['mean_accepted_length'])} | {equal(r, m)} |")
    for m, label in methods:
        dec = [f"{r[(m, s)]['decode_tokens_per_s'] / r[('raw', s)]['decode_tokens_per_s']:.2f}x"
               for s in SETS7]
        lines.append(f"| decode tokens/s only, {label} | " + " | ".join(dec) + " | | |")
    return (curve + "\n\n" + "\n".join(lines) + "\n\n" + bench_meta_line(SUFFIX_STEEP) + "\n\n"
            + sources_footer(SUFFIX_STEEP))


CHAIN_LABELS = {"chain-k3": "`chain-k3`", "auto": "`auto` (draft + prompt lookup, `--no-suffix`)",
                "auto-lookup": "`auto-lookup` (prompt lookup alone)"}


def t_chain_k3(rel: str = CHAIN) -> str:
    c = summary(rel)
    lines = ["| method | " + " | ".join(SETS4) + " | mean acc. len (all) | draft share of wall time | equal to raw |",
             "|---|" + "---:|" * (len(SETS4) + 3)]
    methods = [m for m in ("chain-k3", "auto", "auto-lookup") if (m, "all") in c]  # auto-lookup: lookup-only
    for m in methods:
        split = c[(m, "all")]["split"] or {}
        lines.append(f"| {CHAIN_LABELS[m]} | " + " | ".join(x(c[(m, s)]["speedup"]) for s in SETS4)
                     + f" | {f2(c[(m, 'all')]['mean_accepted_length'])} | {split.get('draft', 0):.0%} | {equal(c, m)} |")
    return "\n".join(lines) + "\n\n" + bench_meta_line(rel) + "\n\n" + sources_footer(rel)


def t_chain_k3_steep() -> str:
    """The chain table on the steeper host, under the verification cost ``hetero-spec calibrate`` measured there."""
    v = load(CURVE_STEEP)["verify_ms"]
    ratios = " | ".join(f"{v[str(n)] / v['1']:.2f}" for n in (2, 3, 4, 8))
    curve = ("| t(n)/t(1), n = | 2 | 3 | 4 | 8 | t(1) |\n|---|---:|---:|---:|---:|---:|\n"
             f"| this host | {ratios} | {v['1']:.1f} ms |\n\n" + sources_footer(CURVE_STEEP))
    return curve + "\n\n" + t_chain_k3(CHAIN_STEEP)


def t_laptop_shapes(rel: str = SHAPES) -> str:
    """Fixed draft-model shapes: measured here, and their rounds replayed on the laptop's roofline curve."""
    data, c = load(rel), summary(rel)
    proj = {(p["method"], p["dataset"]): p for p in data["projections"] if p["curve"] == "laptop-7b-q4_0"}
    tree = data["meta"]["tree"]
    names = {"tree": f": {tree['total_tokens']} nodes, depth {tree['depth']}, {tree['top_k']} children"}
    lines = ["| shape | tokens a round (all) | measured here (all) | "
             + " | ".join(f"projected, {d}" for d in SETS4) + " |", "|---|---:|---:|" + "---:|" * len(SETS4)]
    for m in [m for m in data["meta"]["methods"] if (m, "all") in proj]:
        lines.append(f"| `{m}`{names.get(m, '')} | {f2(c[(m, 'all')]['mean_accepted_length'])} | "
                     f"{x(c[(m, 'all')]['speedup'])} | " + " | ".join(x(proj[(m, d)]["projected_speedup"]) for d in SETS4)
                     + " |")
    return "\n".join(lines) + "\n\n" + bench_meta_line(rel) + "\n\n" + sources_footer(rel)


def t_draft_acceptance() -> str:
    c = summary(CHAIN)
    lines = ["| shipped darter, int8, context rows | " + " | ".join(SETS4) + " |", "|---|" + "---:|" * len(SETS4)]
    lines.append("| chain k=3, mean accepted length | " + " | ".join(f2(c[("chain-k3", s)]["mean_accepted_length"])
                                                                  for s in SETS4) + " |")
    lines.append("| chain k=3, speed against raw | " + " | ".join(x(c[("chain-k3", s)]["speedup"]) for s in SETS4) + " |")
    return "\n".join(lines) + "\n\n" + bench_meta_line(CHAIN) + "\n\n" + sources_footer(CHAIN)


def t_draft_step(rel: str = DRAFT_STEP) -> str:
    d = load(rel)
    lines = ["| setting (`--setting`) | weights | threads | ms per step, after a target decode | back to back "
             "| equal to float32, first proposal / chain |", "|---|---|---:|---:|---:|---:|"]
    for name, s in d["settings"].items():
        lines.append(f"| `{name}` | {s['weights']} | {s['threads']} | {s['ms_per_step_after_target']:.2f} "
                     f"| {s['ms_per_step']:.2f} | {s['equal_k1']:.1%} / {s['equal_chain']:.1%} |")
    positions = max(s["positions"] for s in d["settings"].values())
    return (("\n".join(lines)) + f"\n\nChains of k={d['k']} from real rows, {d['context']} cached positions, "
            f"{d['rounds']} rounds, settings interleaved; equality over the chains from {positions} held-out "
            "positions.\n\n" + sources_footer(rel))


def t_tree_draft() -> str:
    """A greedy tree round's drafting through the native step and through torch, per tree shape."""
    d = load(TREE_DRAFT)
    lines = ["| tree (tokens, depth, top-k) | drafting a round, native / torch | a prompt, native / torch "
             "| mean accepted length | equal to plain decoding |", "|---|---:|---:|---:|---:|"]
    for row in d["trees"]:
        t, n, o = row["tree"], row["native"], row["torch"]
        lines.append(f"| {t['tokens']}, {t['depth']}, {t['top_k']} | {n['draft_ms_per_round']:.2f} / "
                     f"{o['draft_ms_per_round']:.2f} ms | {n['wall_s_per_prompt']:.3f} / {o['wall_s_per_prompt']:.3f} s "
                     f"| {n['mean_accepted_length']:.2f} / {o['mean_accepted_length']:.2f} "
                     f"| {n['equal_to_plain'] + o['equal_to_plain']}/{n['runs'] + o['runs']} |")
    m = d["meta"]
    return ("\n".join(lines) + f"\n\nThe shipped darter on {m['model']}, greedy, {m['max_tokens']} new tokens, the "
            f"first {m['n_prompts']} prompts of {' and '.join(m['sets'])}, {m['repeats']} passes, the two ways taking "
            f"turns; medians.\n\n" + sources_footer(TREE_DRAFT))


def t_kernels() -> str:
    d = load(KERNELS)
    modes = list(d["verify_ms"])
    lines = ["| n | " + " | ".join(f"`{m}` t(n) ms | t(n)/t(1)" for m in modes) + " |",
             "|---:|" + "---:|---:|" * len(modes)]
    ns = sorted({int(n) for m in modes for n in d["verify_ms"][m]})
    for n in ns:
        cells = []
        for m in modes:
            v, one = d["verify_ms"][m][str(n)], d["verify_ms"][m]["1"]
            cells += [f"{v:.2f}", f"{v / one:.2f}"]
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    kern = "; ".join(f"`{m}`: {d['kernels'][m]}" for m in modes)
    return ("\n".join(lines) + f"\n\nMedian of {d['passes']} interleaved passes, {d['threads']} threads; {kern}. "
            f"Plan chosen here: {d['auto_plan']}.\n\n" + sources_footer(KERNELS))


def t_server_one_client() -> str:
    o = load(SERVER_ONE)["overhead"]
    th = o["server_threads"]
    rows = [("decode tokens/s, median: `run` / server (streamed, as the client sees it)",
             f"{o['median_run_decode_tps']:.1f} / {o['median_server_decode_tps']:.1f}"),
            (f"server / `run` decode speed, median of the {len(o['rows'])} interleaved pairs",
             f"{o['median_decode_ratio']:.3f}"),
            ("end to end (request sent to last byte, against `run`'s prefill + decode)", f"{o['median_e2e_ratio']:.3f}"),
            ("greedy texts, server against `run`", "all equal" if o["all_texts_equal"] else "NOT all equal"),
            ("event loop's share of the server's CPU time", f"{th['event_loop_share']:.1%}")]
    lines = ["| | figure |", "|---|---|"] + [f"| {a} | {b} |" for a, b in rows]
    return "\n".join(lines) + "\n\n" + sources_footer(SERVER_ONE)


def _batched(d: dict, server: str, spec: str) -> dict:
    return next(c for c in d["batched"]["configs"] if c["server"] == server and c["spec"] == spec)


def _best_ngram(d: dict) -> str:
    """llama-server's fastest n-gram speculation that finished in the run."""
    ngram = [c for c in d["batched"]["configs"] if c["server"] == "llama-server" and c["spec"] != "off"
             and "aggregate_tps" in c]
    return max(ngram, key=lambda c: c["aggregate_tps"])["spec"]


def t_server_slots(rel: str = SERVER_SLOTS) -> str:
    """The batched part against llama-server; greedy, or sampled (``--temperature``: then our texts are checked
    against our slots with speculation off, request by request seeded alike)."""
    d = load(rel)
    b = d["batched"]
    from hetero_spec.bench.server_load import paired_ratio, peer_of

    sampled = bool(b.get("temperature"))
    check = "seeded texts equal to speculation off" if sampled else "greedy texts equal to one sequence alone"
    lines = ["| server | speculation | aggregate tokens/s | against llama-server: ratio of medians / median per pass "
             f"| time to first token p50 / p95 | {check} |", "|---|---|---:|---|---|---|"]
    one = d["load"]
    lines.append(f"| hetero-spec, one sequence at a time | {'the draft model (`auto`)' if d['draft'] else 'off'} "
                 f"| {one['aggregate_tps']:.1f} | | "
                 f"{one['ttft_s']['p50']:.2f} s / {one['ttft_s']['p95']:.2f} s "
                 f"| {'-' if sampled else '(the reference)'} |")
    names = {"hetero-spec": f"hetero-spec `--parallel {b['parallel']}`", "llama-server": f"llama-server `-np {b['parallel']}`"}
    specs = {("hetero-spec", "on"): "copy drafts priced on the batch", ("llama-server", "off"): "off",
             ("hetero-spec", "off"): "off (`--no-draft`)",
             ("hetero-spec", "draft"): "the draft model and copy drafts, priced on the batch"}
    for c in b["configs"]:
        spec = specs.get((c["server"], c["spec"]), f"`--spec-type {c['spec']}`")
        same = {True: "yes", False: "no", None: "-"}[c.get("texts_equal_undrafted" if sampled
                                                           else "texts_equal_one_sequence")]
        if sampled and (c["server"], c["spec"]) == ("hetero-spec", "off"):
            same = "(the reference)"
        if "aggregate_tps" not in c:
            lines.append(f"| {names[c['server']]} | {spec} | crashed in every pass | | | |")
            continue
        crashed = f" ({len(c['errors'])} of {b['passes']} passes crashed)" if c.get("errors") else ""
        peer = peer_of(c, b["configs"])
        paired = paired_ratio(c, peer) if peer else None
        vs = (f"{c['aggregate_tps'] / peer['aggregate_tps']:.2f}x / " + (f"{paired:.2f}x" if paired is not None else "-")
              + f" (`{peer['spec']}`)") if peer else ""
        lines.append(f"| {names[c['server']]} | {spec} | {c['aggregate_tps']:.1f}{crashed} | {vs} | {c['ttft_p50_s']:.2f} s / "
                     f"{c['ttft_p95_s']:.2f} s | {same} |")
    how = f", sampled at temperature {b['temperature']} (request i with seed i)" if sampled else ""
    return ("\n".join(lines) + f"\n\n{one['clients']} concurrent streaming clients, {one['requests']} requests in all "
            f"(each mt_bench prompt twice){how}, medians of {b['passes']} interleaved passes.\n\n"
            + sources_footer(rel))


def t_server_interleaved(rel: str = SERVER_SLOTS_STEEP) -> str:
    iv = load(rel)["interleaved"]
    lines = ["| second turns | time to first token p50 / p95 | prefill p50 |", "|---|---|---:|"]
    for label, name in (("cache", "prompt cache on (`--cache-ram` 1024, the default)"), ("no_cache", "`--cache-ram 0`")):
        r = iv[label]
        lines.append(f"| {name} | {r['ttft_s']['p50']:.3f} s / {r['ttft_s']['p95']:.3f} s | {r['prefill_s']['p50']:.3f} s |")
    return ("\n".join(lines) + f"\n\n{iv['conversations']} mt_bench conversations through {iv['parallel']} slots (the "
            f"shipped darter drafting), every turn 1 and then every turn 2; texts equal with and without the cache: "
            f"{'yes' if iv['texts_equal'] else 'no'}.\n\n" + sources_footer(rel))


def t_server_engine() -> str:
    lines = ["| slots, rows | generated tokens/s | rows per step | wall / inside `llama_decode` | draft-model rows accepted |",
             "|---|---:|---:|---|---:|"]
    for r in load(ENGINE)["rows"]:
        accepted = f"{r['accepted']} of {r['drafted']}" if r["draft_depth"] else "-"
        lines.append(f"| {r['slots']}, {r['label']} | {r['generated_tps']:.1f} | {r['rows_per_step']:.1f} | "
                     f"{r['wall_s']:.2f} s / {r['decode_s']:.2f} s | {accepted} |")
    return "\n".join(lines) + "\n\n" + sources_footer(ENGINE)


CROSS_LINE = re.compile(r"(same|cross): (.+?): ([\d.]+) tok/s; busy threads: (.+?); threads alive (\d+)")


def t_cross_thread() -> str:
    lines = ["| decodes | tokens/s | voluntary context switches per token (the two busy threads) | threads alive |",
             "|---|---:|---|---:|"]
    for m in CROSS_LINE.finditer(load(CROSS)):
        kind, what, tps, busy, alive = m.groups()
        switches = " / ".join(s.split(" CPU / ")[1].split(" switches")[0] for s in busy.split(", "))
        lines.append(f"| {kind}: {what} | {float(tps):.1f} | {switches} | {alive} |")
    return "\n".join(lines) + "\n\n" + sources_footer(CROSS)


def draft_training(name: str | Path) -> dict[str, Any]:
    """The training summary the trainer writes into the draft file's safetensors metadata (a name under drafts/,
    or a path)."""
    with open(ROOT / "drafts" / name, "rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        meta = json.loads(fh.read(n)).get("__metadata__", {})
    return {"config": json.loads(meta["hetero_spec.draft_config"]), "training": json.loads(meta["hetero_spec.training"])}


def t_drafts() -> str:
    lines = ["| file | architecture | steps (epochs) | training minutes (CPU-minutes) | training tokens "
             "| held-out top-1, unrolled steps 1-4 | estimated accepted length, chain k=4 | in all |",
             "|---|---|---:|---:|---:|---|---:|---|"]
    for name in DRAFTS:
        d = draft_training(name)
        c, t = d["config"], d["training"]
        taps = f", taps {','.join(map(str, c['taps']))}" if c.get("taps") else ""
        arch = f"{c['fusion']} fusion, gate {c['gate']}, {c['n_blocks']} block{taps}, {c['reduced_vocab']}-row head"
        cpu = t.get("train_cpu_seconds")
        minutes = f"{t['train_seconds'] / 60:.0f}" + (f" ({cpu / 60:.0f})" if cpu else "")
        steps = t["eval"].get("step_top1") or [t["eval"]["top1"]]
        runs, all_steps, all_cpu, node = 1, t["steps"], cpu or t["train_seconds"], t.get("init_from")
        while node:  # a run continued with --init-from records the file it started from, recursively
            runs, all_steps = runs + 1, all_steps + node["steps"]
            all_cpu += node.get("train_cpu_seconds") or node["train_seconds"]
            node = node.get("init_from")
        lineage = f"{runs} runs: {all_steps:,} steps, {all_cpu / 3600:.1f} CPU-hours" if runs > 1 else "1 run"
        lines.append(f"| `drafts/{name}` | {arch} | {t['steps']:,} ({t['epochs']}) | {minutes} | {t['train_tokens']:,} "
                     f"| {' / '.join(f'{s:.3f}' for s in steps)} | {t['eval']['accepted_length']:.2f} | {lineage} |")
    return ("\n".join(lines) + "\n\nFrom each file's `hetero_spec.training` metadata: the trainer's closing "
            "summary of the last run on that file, and under `init_from` the runs it continued. Held-out: "
            "teacher-forced against the target's own argmax, on that run's held-out sequences.")


def laptop_chain_k3(rel: str) -> float:
    """A bench file's projected chain-k3 speedup over all sets on the ``laptop-7b-q4_0`` curve."""
    return next(r["projected_speedup"] for r in load(rel)["projections"]
                if r["curve"] == "laptop-7b-q4_0" and r["method"] == "chain-k3" and r["dataset"] == "all")


def step_decay_bench(variant: str, decay: str) -> str:
    return f"bench/smollm2-q4_0-xeon-amx-vm-step-decay-{variant}-{decay}.json"


SET_COLUMNS = "Set columns: mean accepted length of a fixed chain of 4, as `run` drafts (int8, context rows)."


def trained_cells(t: dict, rel: str) -> str:
    """A training run's cells in the recipe tables: steps (CPU-minutes), held-out estimate, and its draft's mean
    accepted length at chain k=4 per set, from the bench file ``rel``."""
    rows = summary(rel)
    return (f"{t['steps']} ({t['train_cpu_seconds'] / 60:.0f}) | {t['eval']['accepted_length']:.2f} | "
            + " | ".join(f2(rows[("chain-k4", d)]["mean_accepted_length"]) for d in SETS4))


def t_step_decay() -> str:
    runs = load(STEP_DECAY_RUNS)["runs"]
    lines = ["| loss | step weighting | steps (CPU-minutes) | held-out estimate, chain k=4 | "
             + " | ".join(SETS4) + " | chain k=3 projected on `laptop-7b-q4_0` |",
             "|---|---|---:|---:|" + "---:|" * (len(SETS4) + 1)]
    for variant, decay in STEP_DECAY:
        rel = step_decay_bench(variant, decay)
        loss = "DarterSD (darter)" if variant == "darter" else "EAGLE-3's (eagle3)"
        lines.append(f"| {loss} | {decay}^j | {trained_cells(runs[f'{variant}-{decay}'], rel)} "
                     f"| {x(laptop_chain_k3(rel))} |")
    first = step_decay_bench(*STEP_DECAY[0])
    return ("\n".join(lines) + f"\n\n{SET_COLUMNS} Each run: one thread, seed 1, the same 25 CPU-minutes "
            "(`--budget-clock cpu`) on the same corpus: the 865 conversations of the `make-draft --hours 1` run "
            "below.\n\n"
            + bench_meta_line(first) + "\n\n" + sources_footer(STEP_DECAY_RUNS, *(step_decay_bench(*r) for r in STEP_DECAY)))


def corpus_mix_bench(name: str) -> str:
    return f"bench/smollm2-q4_0-epyc-corpus-{name}.json"


def t_corpus_mix() -> str:
    runs = load(CORPUS_MIX_RUNS)["runs"]
    lines = ["| corpus | sequences | training tokens | steps (CPU-minutes) | held-out estimate, chain k=4 (own split) | "
             + " | ".join(SETS4) + " |", "|---|---:|---:|---:|---:|" + "---:|" * len(SETS4)]
    for name, what in CORPUS_MIX:
        t = runs[name]
        lines.append(f"| {what} | {t['train_sequences'] + t['held_out_sequences']} | {t['train_tokens']:,} "
                     f"| {trained_cells(t, corpus_mix_bench(name))} |")
    benches = [corpus_mix_bench(n) for n, _ in CORPUS_MIX]
    return ("\n".join(lines) + f"\n\n{SET_COLUMNS} Each run: the recipe's darter (step weighting 0.5^j), one thread, seed 1, lr 1e-3, "
            "the same 25 CPU-minutes (`--budget-clock cpu`), two runs at a time. Each held-out estimate is on its "
            "own corpus's held-out split, so compare runs by the set columns.\n\n"
            + bench_meta_line(benches[0]) + "\n\n" + sources_footer(CORPUS_MIX_RUNS, *benches))


def t_make_draft_time() -> str:
    ttd, made = load(TIME_TO_DRAFT), summary(MADE_NOW_BENCH)[("chain-k3", "all")]
    big = ttd["seven_b"]
    mins = lambda v: f"{v / 60:.1f} min"  # noqa: E731
    hours = lambda v: f"{v / 3600:.1f} h"  # noqa: E731
    taus = lambda xs: " / ".join(f2(v) for v in xs)  # noqa: E731
    lines = ["| target | corpus | training | held-out check | τ at chain k=1..4, measured (estimated) "
             "| chain k=3 here: τ, speed | chain k=3 projected on `laptop-7b-q4_0` |", "|---|---:|---:|---:|---|---|---:|"]
    for m in ttd["measured"]:
        rep = load(m["report"].removeprefix("results/"))
        if m["report"].endswith(MADE_NOW):  # the run benched on its own: here, and replayed on the laptop's curve
            name, here, laptop = ("SmolLM2-135M Q4_0", f"{f2(made['mean_accepted_length'])}, {x(made['speedup'])}",
                                  x(laptop_chain_k3(MADE_NOW_BENCH)))
        else:
            name, here, laptop = f"tiny llama, random weights ({m['target_params'] / 1e6:.1f} M, width {m['n_embd']})", "-", "-"
        lines.append(f"| {name}, `--hours {rep['hours']:g}` (measured) | {mins(m['spent_s']['corpus'])} "
                     f"| {mins(m['spent_s']['train'])} | {mins(m['spent_s']['check'])} "
                     f"| {taus(m['measured_tau_per_step'])} ({taus(m['estimated_tau_per_step'])}) | {here} | {laptop} |")
    base = next(m for m in ttd["measured"] if m["report"] == big["from"])
    lines.append(f"| 7B (LLaMA-2-7B class), SmolLM2's corpus and training tokens, the same 2 vCPUs (projected) "
                 f"| {hours(big['spent_s']['corpus'])} | {hours(big['spent_s']['train'])} "
                 f"| {hours(big['spent_s']['check'])} | not projected | - | - |")
    return ("\n".join(lines) + "\n\nThe 7B row scales each SmolLM2 stage by work per token: the corpus and the "
            f"check by the targets' parameters ({base['target_params'] / 1e6:.0f} M against "
            f"{big['target_params'] / 1e9:.2f} B: {big['ratio']['corpus']:.0f}x), training by the weights a "
            f"token meets in the draft ({base['draft_weights_per_token'] / 1e6:.1f} M against "
            f"{big['draft_weights_per_token'] / 1e6:.0f} M: {big['ratio']['train']:.0f}x).\n\n"
            + bench_meta_line(MADE_NOW_BENCH) + "\n\n" + sources_footer(*(m["report"].removeprefix("results/")
                                                                            for m in ttd["measured"]),
                                                                          TIME_TO_DRAFT, MADE_NOW_BENCH))


def t_make_draft_loops() -> str:
    sets = ("mt_bench", "humaneval", "gsm8k", "alpaca")
    lines = ["| corpus turns | corpus : training time | step weighting | corpus: conversations, answer tokens "
             "| training steps (epochs) | τ at chain k=1..4, measured (estimated) | " + " | ".join(sets) + " |",
             "|---|---|---|---|---|---|" + "---:|" * len(sets)]
    stopped = "stopped where training stops scoring a loop"
    for rel, label in ((MADE, "run to their end or the cap"), (MADE_STOPPED, stopped), (MADE_NOW, stopped)):
        r = load(rel)
        c, t, b = r["corpus"], r["training"], r["budget_s"]
        taus = " / ".join(f2(v) for v in r["measured_tau_per_step"])
        est = " / ".join(f2(v) for v in r["estimated_tau_per_step"])
        share = round(100 * b["corpus"] / (b["corpus"] + b["train"]))
        lines.append(f"| {label} | {share} : {100 - share} | {r['recipe'].get('step_decay', 0.8)}^j "
                     f"| {c['conversations']:,}, {c['assistant_tokens']:,} | {t['steps']:,} ({t['epochs']}) "
                     f"| {taus} ({est}) | " + " | ".join(f2(r["measured_tau_per_set"].get(n)) for n in sets) + " |")
    return ("\n".join(lines) + "\n\nSet columns: τ at chain k=4 on that set's check prompts. Each row is one "
            "`make-draft --hours 1` run with the code of its day (below); the first ran on another host."
            "\n\n" + sources_footer(MADE, MADE_STOPPED, MADE_NOW))


def t_make_prompts() -> str:
    d = load(MAKE_PROMPTS)
    rows = d["rows"]
    lines = ["| requests sampled together (`--n-seq`) | wall time | samples per second | against one at a time |",
             "|---:|---:|---:|---:|"]
    lines += [f"| {r['n_seq']} | {r['wall_s']:.1f} s | {r['samples_per_s']:.2f} | {x(r['speed_vs_first'])} |"
              for r in rows]
    return ("\n".join(lines) + f"\n\n{rows[0]['kept']} requests kept of "
            f"{rows[0]['attempts']} samples (system message: \"{d['system']}\"), at most {d['max_tokens']} tokens each, "
            f"{d['threads']} threads; wall time of the whole command (model load included), median of "
            f"{len(rows[0]['passes'])} interleaved passes; every run wrote the same file: "
            f"{'yes' if d['identical'] else 'no'}.\n\n" + sources_footer(MAKE_PROMPTS))


def t_stop_loops() -> str:
    d = load(STOP_LOOPS)
    keep, med, o = d["options"]["stop_loops"], d["medians"], d["options"]
    base = med["corpus"]["seconds"]
    lines = ["| `generate-corpus` | wall time | answer tokens generated per second | of them scored by `--loop-keep "
             f"{keep}`, per second | conversations ended in a loop | speed |", "|---|---:|---:|---:|---:|---:|"]
    for way, label in (("corpus", "every turn to its end or the cap"), ("corpus-stop", f"`--stop-loops {keep}`")):
        runs = [r for r in d["runs"] if r["way"] == way]
        m = med[way]
        looped = "-" if way == "corpus" else f"{runs[0]['stopped_in_loop']} of {runs[0]['conversations']}"
        lines.append(f"| {label} | {m['seconds']:.0f} s | {m['tok_s']:.0f} | {m['scored_tok_s']:.0f} | {looped} | "
                     f"{x(base / m['seconds'])} |")
    scored = {way: statistics.median(r["scored"] for r in d["runs"] if r["way"] == way) for way in ("corpus", "corpus-stop")}
    return ("\n".join(lines) + f"\n\nThe first {d['conversations']} ShareGPT conversations of the seed-{o['seed']} "
            f"shuffle ({d['prompts']} answered, the rest dropped for bench overlap or a long prompt; a second turn where "
            f"the first ends; up to {o['max_new_tokens']} tokens a turn), {o['n_seq']} at a time, taps 2,15,27, "
            f"{o['threads']} threads; medians of {o['repeats']} interleaved passes. Answer tokens training scores: "
            f"{scored['corpus']:,.0f} running every turn out, {scored['corpus-stop']:,.0f} with the stop "
            f"({1 - scored['corpus-stop'] / scored['corpus']:.1%} fewer: mostly what follows a loop that ends by itself).\n\n"
            + sources_footer(STOP_LOOPS))


def t_recorded(rel: str) -> str:
    d = load(rel)
    return "```text\n" + d["output"].rstrip() + "\n```\n\n" + sources_footer(rel)


TABLES: dict[str, tuple[Callable[[], str], list[str]]] = {
    "headline": (t_headline, [WITH_DRAFT, SUFFIX_STEEP, CHAIN, SERVER_ONE, SERVER_SLOTS_STEEP]),
    "speedup-7sets": (t_speedup_7sets, [WITH_DRAFT, NO_DRAFT]),
    "chain-k3": (t_chain_k3, [CHAIN]),
    "chain-k3-steep": (t_chain_k3_steep, [CURVE_STEEP, CHAIN_STEEP]),
    "draft-acceptance": (t_draft_acceptance, [CHAIN]),
    "laptop-shapes": (t_laptop_shapes, [SHAPES]),
    "draft-step": (t_draft_step, [DRAFT_STEP]),
    "draft-step-epyc": ((lambda: t_draft_step(DRAFT_STEP_EPYC)), [DRAFT_STEP_EPYC]),
    "tree-draft": (t_tree_draft, [TREE_DRAFT]),
    "kernels": (t_kernels, [KERNELS]),
    "server-one-client": (t_server_one_client, [SERVER_ONE]),
    "server-slots": (t_server_slots, [SERVER_SLOTS]),
    "server-slots-steep": ((lambda: t_server_slots(SERVER_SLOTS_STEEP)), [SERVER_SLOTS_STEEP]),
    "server-slots-epyc": ((lambda: t_server_slots(SERVER_SLOTS_EPYC)), [SERVER_SLOTS_EPYC]),
    "server-slots-sampled": ((lambda: t_server_slots(SERVER_SLOTS_SAMPLED)), [SERVER_SLOTS_SAMPLED]),
    "server-interleaved": (t_server_interleaved, [SERVER_SLOTS_STEEP]),
    "server-engine": (t_server_engine, [ENGINE]),
    "cross-thread": (t_cross_thread, [CROSS]),
    "drafts": (t_drafts, [f"../drafts/{n}" for n in DRAFTS]),
    "step-decay": (t_step_decay, [STEP_DECAY_RUNS, *(step_decay_bench(*r) for r in STEP_DECAY)]),
    "corpus-mix": (t_corpus_mix, [CORPUS_MIX_RUNS, *(corpus_mix_bench(n) for n, _ in CORPUS_MIX)]),
    "make-prompts": (t_make_prompts, [MAKE_PROMPTS]),
    "stop-loops": (t_stop_loops, [STOP_LOOPS]),
    "make-draft-loops": (t_make_draft_loops, [MADE, MADE_STOPPED, MADE_NOW]),
    "make-draft-time": (t_make_draft_time, [MADE_NOW, TINY_MADE, TIME_TO_DRAFT, MADE_NOW_BENCH]),
}
TABLES["suffix-steep"] = (t_suffix_steep, [SUFFIX_CURVE_STEEP, SUFFIX_STEEP])
TABLES["suffix-replay"] = ((lambda: t_recorded(SUFFIX_REPLAY)), [SUFFIX_REPLAY])
TABLES["suffix-overhead"] = ((lambda: t_recorded("suffix/overhead-per-round.json")), ["suffix/overhead-per-round.json"])
for _p in sorted((RESULTS / "exactness").glob("*.json")):
    _rel = f"exactness/{_p.name}"
    TABLES[f"exactness-{_p.stem}"] = ((lambda r=_rel: t_recorded(r)), [_rel])


def render(name: str) -> str:
    if name not in TABLES:
        raise click.ClickException(f"no table {name!r}; one of: {', '.join(TABLES)}")
    return TABLES[name][0]().rstrip() + "\n"


def blocks(text: str) -> list[tuple[str, str]]:
    """(name, body) of every results block in a document."""
    return [(m.group(2), m.group(3)) for m in BLOCK.finditer(text)]


def rewrite(text: str) -> str:
    return BLOCK.sub(lambda m: m.group(1) + render(m.group(2)) + m.group(4), text)


@click.group(context_settings={"help_option_names": ["-h", "--help"]}, help=__doc__)
def cli() -> None:
    pass


@cli.command("list")
def list_() -> None:
    """Table names and the files under results/ they read."""
    for name, (_, rels) in TABLES.items():
        click.echo(f"{name}: {', '.join(rels)}")


@cli.command()
@click.argument("name")
def show(name: str) -> None:
    """Print one table."""
    click.echo(render(name), nl=False)


@cli.command()
def write() -> None:
    """Rewrite every results block in README.md, docs/*.md and drafts/README.md from the files."""
    for doc in DOCS:
        old = doc.read_text()
        new = rewrite(old)
        if new != old:
            doc.write_text(new)
            click.echo(f"rewrote {doc.relative_to(ROOT)}")


@cli.command()
def check() -> None:
    """Exit 1 if a block in the docs differs from what the files give."""
    stale = [f"{doc.relative_to(ROOT)}: {name}" for doc in DOCS for name, body in blocks(doc.read_text())
             if body != render(name)]
    if stale:
        raise click.ClickException("stale results blocks (run `python scripts/results_tables.py write`): "
                                   + "; ".join(stale))
    click.echo("all results blocks match their files")


@cli.command()
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path),
              default=RESULTS / "plots" / "speedup-by-set.png", show_default=True)
def plot(out: Path) -> None:
    """Speed against raw per set and method, from the same bench files as the tables."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    d, n = summary(WITH_DRAFT), summary(NO_DRAFT)
    series = [("auto, darter + suffix trees (run's default)", d, "auto-suffix"), ("auto, no draft model", n, "auto-suffix"),
              ("llama.cpp ngram-simple", d, "llama.cpp-ngram")]
    fig, ax = plt.subplots(figsize=(9, 4))
    width = 0.8 / len(series)
    for i, (label, rows, m) in enumerate(series):
        ax.bar([j + i * width for j in range(len(SETS7))], [rows[(m, s)]["speedup"] for s in SETS7], width, label=label)
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xticks([j + width for j in range(len(SETS7))], SETS7)
    ax.set_ylabel("tokens/s against raw (median over prompts)")
    ax.set_title(f"SmolLM2-135M Q4_0, {load(WITH_DRAFT)['meta']['machine']}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    click.echo(f"wrote {out}")


@cli.command()
@click.argument("bench_json", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.argument("name")
@click.option("--command", "command", required=True, help="the hetero-spec bench command that wrote BENCH_JSON")
def add(bench_json: Path, name: str, command: str) -> None:
    """Copy a bench.json into results/bench/NAME.json with the command recorded in its meta."""
    data = json.loads(bench_json.read_text())
    if "meta" not in data or "summary" not in data:
        raise click.ClickException(f"{bench_json}: not a hetero-spec bench.json (no meta/summary)")
    data["meta"]["command"] = command
    out = RESULTS / "bench" / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=1) + "\n")
    click.echo(f"wrote {out.relative_to(ROOT)}")


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


@cli.command()
@click.argument("out", type=click.Path(dir_okay=False, path_type=Path))
@click.argument("command")
def record(out: Path, command: str) -> None:
    """Run COMMAND (one bash string, run from the repository root) and keep its output as JSON at OUT.

    The command is stored as written, so write it as a reader would type it
    (``"$(python scripts/default_model.py)"``, not the path that expands to).
    """
    proc = subprocess.run(["bash", "-c", command], cwd=ROOT, capture_output=True, text=True)
    if proc.returncode:
        raise click.ClickException(f"exit {proc.returncode}: {proc.stderr.strip()[-500:]}")
    data = {"command": command, "cpu": f"{cpu_name()}, {os.cpu_count()} CPUs",
            "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "output": proc.stdout}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=1) + "\n")
    click.echo(proc.stdout, nl=False)


@cli.command()
@click.argument("out", type=click.Path(dir_okay=False, path_type=Path))
@click.argument("drafts", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--command", "command", required=True, help="the command that trained the drafts (with NAME for each)")
def summaries(out: Path, drafts: tuple[Path, ...], command: str) -> None:
    """Keep the training summaries of draft files too large to ship (their ``hetero_spec.training`` metadata)
    as JSON at OUT, keyed by file stem."""
    runs = {}
    for path in drafts:
        try:
            runs[path.stem] = draft_training(path.resolve())["training"]
        except (KeyError, ValueError, struct.error) as e:
            raise click.ClickException(f"{path}: no training summary in its metadata ({e})")
    data = {"command": command, "cpu": f"{cpu_name()}, {os.cpu_count()} CPUs", "runs": runs}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=1) + "\n")
    click.echo(f"wrote {out}: {', '.join(runs)}")


if __name__ == "__main__":
    sys.exit(cli())
