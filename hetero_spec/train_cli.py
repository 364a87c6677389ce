"""`hetero-spec train` and `hetero-spec analyze-attention`: wiring between the GGUF and train/.

train/ never touches llama.cpp; this module reads the target's fingerprint, embedding and
head from the GGUF and hands them over as tensors.
"""
from __future__ import annotations

import json
import signal
import sys
from dataclasses import replace
from pathlib import Path

import click

from .cli_types import FiniteFloat
from .config import MAX_THREADS
from .errors import HeteroSpecError


def _target_parts(model: Path):
    import numpy as np
    import torch

    from .target.gguf_weights import load_target_weights
    from .target.llama_target import LlamaTarget, TargetOptions

    with LlamaTarget(model, TargetOptions(n_ctx=64, embeddings=False)) as t:
        fp = t.fingerprint
    w = load_target_weights(model)
    emb = torch.from_numpy(np.array(w.embedding, dtype=np.float32))
    head = emb if w.tied else torch.from_numpy(np.array(w.head, dtype=np.float32))
    return fp, emb, head


@click.command()
@click.argument("features", nargs=-1, required=True, type=click.Path(file_okay=False, path_type=Path))
@click.option("--target", "model", required=True, type=click.Path(dir_okay=False, path_type=Path),
              help="the GGUF whose features these are (its head and embedding are borrowed)")
@click.option("--out", required=True, type=click.Path(dir_okay=False, path_type=Path), help="draft .safetensors")
@click.option("--variant", type=click.Choice(["darter", "dovetail", "eagle", "eagle3"]), default="darter",
              show_default=True, help="eagle3: EAGLE-3's decoder input (exportable to llama.cpp); needs --taps")
@click.option("--taps", default="", help="target blocks whose input the draft reads (EAGLE-3 fusion), e.g. 2,15,27; "
                                          "the features must hold them (generate-corpus --taps)")
@click.option("--hole-prob", default=0.3, show_default=True, type=FiniteFloat(0, 1),
              help="share of sequences trained with their prompt hidden, as after the runtime's lazy prefill")
@click.option("--blocks", type=click.IntRange(1), help="decoder blocks (default from the variant)")
@click.option("--reduced-vocab", default=8192, show_default=True, type=click.IntRange(0), help="0 = full head")
@click.option("--epochs", default=4, show_default=True, type=click.IntRange(1))
@click.option("--max-steps", default=0, show_default=True, type=click.IntRange(0))
@click.option("--time-budget", default=0.0, show_default=True, type=FiniteFloat(0), help="minutes of training, then save and stop")
@click.option("--budget-clock", type=click.Choice(["wall", "cpu"]), default="wall", show_default=True,
              help="what --time-budget counts: wall time of the steps, or their CPU time per thread (a shared "
                   "machine does not shrink a cpu budget's work)")
@click.option("--lr", default=1e-3, show_default=True, type=FiniteFloat(0))
@click.option("--batch-tokens", default=4096, show_default=True)
@click.option("--grad-accum", default=1, show_default=True)
@click.option("--unroll", default=3, show_default=True, help="multi-step unrolled training steps (1 = off)")
@click.option("--chain-sample", default=1.0, show_default=True, type=FiniteFloat(0.01, 1.0),
              help="share of chain starts the unrolled steps continue (cheaper unrolling on a CPU)")
@click.option("--noise", default=0.05, show_default=True, type=FiniteFloat(0), help="input feature noise (fraction of RMS)")
@click.option("--max-len", default=1024, show_default=True)
@click.option("--loop-keep", default=0, show_default=True, type=click.IntRange(0),
              help="score only this many tokens of each repetition loop in the answers and cut sequences "
                   "after their last scored token (0 = off; docs/training.md)")
@click.option("--seed", default=0, show_default=True)
@click.option("--device", default="auto", show_default=True)
@click.option("--threads", default=0, show_default=True, type=click.IntRange(0, MAX_THREADS), help="CPU threads (0 = all)")
@click.option("--precision", type=click.Choice(["auto", "bf16", "fp32"]), default="auto", show_default=True,
              help="auto: bf16 autocast on CUDA and on CPUs with native bf16 (AVX512-BF16/AMX)")
@click.option("--eval-every", default=0, show_default=True, type=click.IntRange(0),
              help="steps between held-out evaluations (0: after each epoch)")
@click.option("--checkpoint-every", default=200, show_default=True, type=click.IntRange(1))
@click.option("--resume", is_flag=True, help="continue from OUT's checkpoint folder")
@click.option("--init-from-target", is_flag=True,
              help="start the draft's last block from the target's last block (dequantized from the GGUF)")
@click.option("--init-from", type=click.Path(dir_okay=False, path_type=Path),
              help="start from this draft's weights (same architecture; fresh optimizer and lr schedule), e.g. "
                   "to continue a shipped draft on new data")
@click.option("--loss-weights", default="", help="overrides as JSON, e.g. '{\"kl\": 1.0, \"gate\": 0.05}'")
def train(features, model, out, variant, taps, hole_prob, blocks, reduced_vocab, epochs, max_steps, time_budget,
          budget_clock, lr, batch_tokens, grad_accum, unroll, chain_sample, noise, max_len, loop_keep, seed, device,
          threads, precision, eval_every, checkpoint_every, resume, init_from_target, init_from, loss_weights) -> None:
    """Distil a draft for MODEL from exported FEATURES folders (see export-features); several folders
    (say self-distilled and plain data) train together."""
    from .train.loop import TrainConfig
    from .train.loop import train as run_training
    from .train.losses import LossWeights

    try:
        tap_list = tuple(int(x) for x in taps.split(",")) if taps else ()
    except ValueError:
        raise HeteroSpecError(f"--taps takes comma-separated block indices, not {taps!r}") from None
    if variant == "eagle3" and not tap_list:
        raise HeteroSpecError("--variant eagle3 reads target taps: give --taps (e.g. 2,15,27)")
    try:
        overrides = json.loads(loss_weights) if loss_weights else {}
        weights = replace(LossWeights(recipe="eagle" if variant in ("eagle", "dovetail") else "darter"), **overrides)
    except (ValueError, TypeError) as exc:
        raise HeteroSpecError(f"bad --loss-weights: {exc}") from None
    cfg = TrainConfig(variant=variant, taps=tap_list, hole_prob=hole_prob, n_blocks=blocks, reduced_vocab=reduced_vocab,
                      epochs=epochs, max_steps=max_steps, time_budget_s=time_budget * 60, budget_clock=budget_clock,
                      lr=lr, batch_tokens=batch_tokens, grad_accum=grad_accum, unroll_steps=unroll,
                      chain_sample=chain_sample, noise=noise, max_len=max_len, loop_keep=loop_keep, seed=seed,
                      device=device, threads=threads, precision=precision, loss=weights, init_from_target=init_from_target,
                      init_from=str(init_from or ""),
                      eval_every=eval_every, checkpoint_every=checkpoint_every)
    fp, emb, head = _target_parts(model)
    init_block = None
    if init_from_target:
        from .target.gguf_weights import load_block
        from .target.llama_target import LlamaTarget, TargetOptions

        with LlamaTarget(model, TargetOptions(n_ctx=64, embeddings=False)) as t:
            last = t.n_layer - 1
        init_block = load_block(model, last)
    summary = run_training(cfg, list(features), out, embedding=emb, head=head, fingerprint=fp, resume=resume,
                           init_block=init_block)
    if not summary:  # under torchrun, ranks other than 0: rank 0 reports (and saved the draft)
        return
    click.echo(json.dumps({k: v for k, v in summary.items() if k != "config"}, indent=2))
    if summary.get("stopped_by"):
        click.echo(f"stopped by {summary['stopped_by']} after step {summary['steps']}: {out} holds the draft so far; "
                   f"add --resume to continue from its checkpoint", err=True)
        sys.exit(128 + signal.Signals[summary["stopped_by"]].value)  # the shell's convention for a signalled stop


@click.command("analyze-attention")
@click.argument("draft", type=click.Path(dir_okay=False, path_type=Path))
@click.argument("features", type=click.Path(file_okay=False, path_type=Path))
@click.option("--target", "model", required=True, type=click.Path(dir_okay=False, path_type=Path))
@click.option("--sequences", default=32, show_default=True)
@click.option("--png", type=click.Path(dir_okay=False, path_type=Path), help="histogram (default: next to DRAFT)")
def analyze_attention(draft, features, model, sequences, png) -> None:
    """Where the draft's attention goes: mass on the top-3 historical tokens, share of negligible keys."""
    from .draft.checkpoint import load_draft
    from .train.analysis import attention_report

    fp, emb, head = _target_parts(model)
    m = load_draft(draft, fp)
    m.attach_target_weights(emb, head)
    png = png or Path(draft).with_suffix(".attention.png")
    report = attention_report(m, features, n_sequences=sequences, png=png)
    click.echo(json.dumps(report, indent=2))
    click.echo(f"histogram: {png}", err=True)
