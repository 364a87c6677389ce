"""``hetero-spec bench`` and ``hetero-spec calibrate``: parse options, call one function each.

``hetero-spec bench MODEL [DRAFT]`` is the speed benchmark (``bench speed``); the other measurements
that are product features are its named subcommands: ``curve`` (the verification cost curve, the same
command as ``calibrate``), ``project`` (a bench.json on other cost curves), ``server`` (the HTTP server
under load, against llama-server) and ``training`` (training runs against training minutes).
"""
from __future__ import annotations

from pathlib import Path

import click

from ..config import DEFAULT_KV_TYPE, DRAFT_DTYPES, KV_TYPES, MAX_THREADS, TreeSpec
from ..errors import HeteroSpecError

_FILE = click.Path(exists=True, dir_okay=False, path_type=Path)


def _split(value: str) -> tuple[str, ...]:
    return tuple(v.strip() for v in value.split(",") if v.strip())


class BenchGroup(click.Group):
    """A group whose first argument, when it names no subcommand, goes to ``speed``: so ``hetero-spec bench
    MODEL [DRAFT] ...`` keeps meaning what it always did.  Subcommands that live in other modules are
    imported only when listed or named ("module:attribute"), keeping the CLI's start light; ``bench server``
    imports httpx (the ``[server]`` extra) only when it runs."""

    DEFAULT = "speed"
    LAZY = {
        "project": "hetero_spec.bench.project_cli:project",
        "server": "hetero_spec.bench.server_load:server_load",
        "training": "hetero_spec.bench.training_curves:training_curves",
    }

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *self.LAZY})

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name in self.LAZY and name not in self.commands:
            import importlib

            module, attr = self.LAZY[name].split(":")
            self.add_command(getattr(importlib.import_module(module), attr), name)
        return super().get_command(ctx, name)

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if args and args[0] not in self.list_commands(ctx) and args[0] not in ctx.help_option_names:
            args = [self.DEFAULT, *args]
        return super().parse_args(ctx, args)


@click.group(cls=BenchGroup, subcommand_metavar="[speed] MODEL [DRAFT] [OPTIONS] | COMMAND [ARGS]...",
             context_settings={"help_option_names": ["-h", "--help"]})
def bench() -> None:
    """Measure speed against llama.cpp and the rest of what users run.

    \b
    hetero-spec bench MODEL [DRAFT] [OPTIONS]   the speed benchmark (bench speed --help for its options)
    hetero-spec bench curve MODEL [DRAFT]       the verification cost curve (as calibrate)
    hetero-spec bench project BENCH_JSON        a bench run projected on other cost curves
    hetero-spec bench server MODEL [DRAFT]      the HTTP server under load, against llama-server
    hetero-spec bench training HISTORY...       training runs against training minutes (a plot)
    """


@bench.command("speed")
@click.argument("model", type=_FILE)
@click.argument("draft", required=False, type=_FILE)
@click.option("--datasets", default="mt_bench,humaneval,gsm8k,alpaca", show_default=True,
              help="comma-separated: shipped set names or paths to JSONL files with a 'turns' list per line")
@click.option("--n-prompts", default=8, show_default=True, type=click.IntRange(1), help="first N prompts of each")
@click.option("--repeats", default=1, show_default=True, type=click.IntRange(1),
              help="passes over the prompts, each in the mirror order of the last; each method keeps its fastest "
                   "run per prompt (a shared machine's slow spells add time, never remove it)")
@click.option("--max-new-tokens", default=128, show_default=True, type=click.IntRange(1))
@click.option("--k", default=3, show_default=True, type=click.IntRange(1, 31), help="draft tokens per round (chain)")
@click.option("--methods", default="raw,llama-cpp,prompt-lookup,chain", show_default=True,
              help="comma-separated from the registry (raw is always run: it is the baseline); also "
                   "llama-server, llama.cpp-ngram, llama.cpp-draft, llama.cpp-eagle3 (scripts/build_llama_cpp.sh), "
                   "and fixed trees by shape: tree-t{tokens}-d{depth}-k{top_k}")
@click.option("--threads", "-t", default=0, type=click.IntRange(0, MAX_THREADS), help="threads for every method (0 = physical cores)")
@click.option("--ctx", default=2048, show_default=True, type=click.IntRange(64), help="context size")
@click.option("--draft-device", default="cpu", show_default=True)
@click.option("--draft-dtype", type=click.Choice(DRAFT_DTYPES), default="auto", show_default=True)
@click.option("--lookup-tokens", default=2, show_default=True, type=click.IntRange(1),
              help="prompt-lookup draft length (llama-cpp-python advises 2 on CPU-only machines)")
@click.option("--tree-tokens", default=12, show_default=True, type=click.IntRange(1, 31),
              help="drafted nodes per tree (methods tree, auto-tree)")
@click.option("--tree-depth", default=6, show_default=True, type=click.IntRange(1, 31), help="tree depth")
@click.option("--tree-top-k", default=2, show_default=True, type=click.IntRange(1, 8), help="children per expansion")
@click.option("--kv-type", type=click.Choice(KV_TYPES), default=DEFAULT_KV_TYPE, show_default=True,
              help="KV cells of every method (q8_0 keeps verification bit-identical to plain decoding; f16 is llama.cpp's default)")
@click.option("--llama-draft-model", type=_FILE,
              help="draft GGUF for llama.cpp-draft (same vocabulary as MODEL, e.g. the plain SmolLM2 Q4_0 "
                   "for a cost-equivalent target)")
@click.option("--eagle3-gguf", type=_FILE, help="EAGLE-3 draft GGUF for llama.cpp-eagle3")
@click.option("--llama-args", default="", help="extra llama-server arguments for the llama.cpp* methods "
                                                "(space-separated, e.g. '--spec-ngram-simple-size-n 4')")
@click.option("--project", "curves", multiple=True, metavar="CURVE",
              help="also project each speculative method's recorded rounds onto a cost curve: a shipped "
                   "name (this-machine, laptop-7b-q4_0), a calibration JSON, or this-run (a calibration pass "
                   "timed after every prompt, so the curve sees the machine when the prompts did); repeatable")
@click.option("--template", type=click.Choice(["gguf", "plain"]), default="gguf", show_default=True,
              help="gguf: prompts in the model's chat template; plain: 'User: ...\\n\\nAssistant:' raw text, for base "
                   "models without a template")
@click.option("--out", default="bench-out", show_default=True, type=click.Path(file_okay=False, path_type=Path))
def speed(model, draft, datasets, n_prompts, repeats, max_new_tokens, k, methods, threads, ctx, draft_device, draft_dtype,
          lookup_tokens, tree_tokens, tree_depth, tree_top_k, kv_type, llama_draft_model, eagle3_gguf, llama_args,
          curves, template, out) -> None:
    """Time raw llama.cpp, llama-cpp-python, llama.cpp's own speculation and hetero-spec side by side."""
    from tqdm import tqdm

    from ..target.llama_target import default_threads
    from .baselines import BenchTarget
    from .harness import BenchConfig, load_dataset, run_bench
    from .projection import THIS_RUN, load_curve, project_result, this_run_curve
    from .report import markdown, write_bench

    cfg = BenchConfig(
        target=BenchTarget(model, draft, threads=threads or default_threads(), n_ctx=ctx, k=k,
                           draft_device=draft_device, draft_dtype=draft_dtype, lookup_tokens=lookup_tokens,
                           tree=TreeSpec(tree_tokens, tree_depth, tree_top_k), kv_type=kv_type,
                           llama_draft_model=llama_draft_model, eagle3_gguf=eagle3_gguf,
                           llama_args=tuple(llama_args.split())),
        datasets=_split(datasets), methods=_split(methods), n_prompts=n_prompts, max_new_tokens=max_new_tokens,
        template=template, calibrate=THIS_RUN in curves, repeats=repeats,
    )
    if not cfg.datasets or not cfg.methods:
        raise HeteroSpecError("--datasets and --methods need at least one entry each")
    # bad names fail here, before minutes of benchmarking; this run's own curve comes after it
    loaded = dict(load_curve(c) for c in curves if c != THIS_RUN)
    for d in cfg.datasets:
        load_dataset(d, n_prompts)  # a bad name or file fails here, before any model loads
    with tqdm(desc="bench", unit="run") as bar:
        def step(method: str) -> None:
            bar.set_postfix_str(method)
            bar.update(1)

        def planned(total: int) -> None:
            bar.total = total
            bar.refresh()

        result = run_bench(cfg, progress=step, planned=planned)
    if cfg.calibrate:
        loaded = {THIS_RUN: this_run_curve(result)} | loaded
    result.projections = project_result(result, loaded) if loaded else []
    paths = write_bench(result, out)
    click.echo(markdown(result))
    click.echo("wrote " + ", ".join(str(p) for p in paths), err=True)


@click.command()
@click.argument("model", type=_FILE)
@click.argument("draft", required=False, type=_FILE)
@click.option("--threads", "-t", default=0, type=click.IntRange(0, MAX_THREADS), help="target threads (0 = physical cores)")
@click.option("--quick", is_flag=True, help="3 timings per n instead of 9 (what first use does automatically)")
@click.option("--repeats", type=click.IntRange(1), help="timings per n (overrides --quick)")
@click.option("--draft-device", default="cpu", show_default=True)
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path),
              help="JSON file (default: the per-machine cache that --draft-len auto reads)")
@click.option("--plot", type=click.Path(dir_okay=False, path_type=Path),
              help="PNG of the curve (default: beside the JSON)")
def calibrate(model, draft, threads, quick, repeats, draft_device, out, plot) -> None:
    """Measure the target's verification cost t(n)/t(1), n = 1..32, and the draft's step cost."""
    from tqdm import tqdm

    from ..api import calibrate as run
    from ..calibration import timings_count
    from .report import plot_curve

    with tqdm(desc="calibrate", unit="decode", total=timings_count(quick, repeats, draft is not None)) as bar:
        curve, path = run(model, draft, threads=threads, quick=quick, repeats=repeats, out=out,
                          draft_device=draft_device, progress=bar.update)
    png = plot_curve(curve, plot or path.with_suffix(".png"))
    click.echo(f"# {curve.model}\n# {curve.machine}\n# kernels: {curve.kernels}")
    click.echo("n\tt(n) ms\tt(n)/t(1)\tenvelope" + ("\tdraft rows ms" if curve.draft_rows_ms else ""))
    env = curve.envelope_ms()
    for n in sorted(curve.verify_ms):
        line = f"{n}\t{curve.verify_ms[n]:.2f}\t{curve.verify_ratio(n):.2f}\t{env[n] / curve.verify_ms[1]:.2f}"
        if curve.draft_rows_ms:
            line += f"\t{curve.draft_rows_ms.get(n, float('nan')):.2f}"
        click.echo(line)
    if draft is not None:
        click.echo(f"draft step: {curve.draft_step_ms:.3f} ms (+{curve.draft_switch_ms:.3f} ms for a round's first "
                   "step, right after a target decode)")
    click.echo(break_even_lines(curve, draft))
    click.echo(f"wrote {path} and {png}", err=True)


BREAK_EVEN_K = range(1, 9)


def break_even_lines(curve, draft: Path | None) -> str:
    """What a draft must reach to pay on this machine: the break-even mean accepted length per chain length, for
    copies and (with DRAFT) the draft model's chains, beside the draft's own held-out estimate where its file has
    one.  WHY: whether a draft can pay is mostly a property of the machine (t(k+1)/t(1)), known before any bench."""
    from ..draft.checkpoint import read_held_out_acceptance
    from ..spec.policy import break_even, expected_emitted

    def row(label: str, values) -> str:  # None: "-"
        return f"  {label:<40}" + " ".join(f"{'-':>5}" if v is None else f"{v:5.2f}" for v in values)

    def needed(label: str, source: str) -> str:  # None where a round of k drafts cannot emit that many tokens
        values = [break_even(curve, k, source) for k in BREAK_EVEN_K]
        return row(label, [v if v < k + 1 else None for k, v in zip(BREAK_EVEN_K, values)])

    lines = ["break-even mean accepted length (tokens a round) of chains of k drafts, against plain decoding",
             "(-: k + 1 or more, so such chains never pay here):",
             f"  {'k':<40}" + " ".join(f"{k:5d}" for k in BREAK_EVEN_K),
             needed("copied chains (suffix structure, lookup)", "lookup")]
    if draft is not None:
        lines.append(needed("the draft model's chain", "draft"))
        alphas = list(read_held_out_acceptance(draft))
        if alphas:
            lines.append(row("this draft, its trainer's estimate", [expected_emitted(alphas[:k]) for k in BREAK_EVEN_K
                                                                      if k <= len(alphas)]))
            lines.append("  (the trainer's estimate overstates what runs measure: judge by "
                         "hetero-spec bench MODEL DRAFT --methods raw,chain-k3)")
    return "\n".join(lines)


bench.add_command(calibrate, "curve")
