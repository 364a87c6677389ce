"""How long ``make-draft`` takes to a useful draft: measured stages, and a 7B target projected from them.

Reads the reports of finished ``make-draft`` runs (``OUT.report.json``) and the GGUF each was made for,
and writes one JSON for ``scripts/results_tables.py`` (table ``make-draft-time``, docs/make_draft.md).

WHY a projection by work per token: both costly stages are matmuls over every token.  The corpus is the
target decoding (2 x its parameters FLOPs per token, prompt or answer); training runs the draft forward
and backward (about 6 x the weights a token meets: the fusion, the block, the head's rows).  A 7B target
on the same CPU therefore takes its parameter ratio longer per corpus token, and its draft its weight
ratio longer per training token.  Stated, not measured: the same corpus and training tokens, the same
throughput per FLOP on the same CPU (a 7B's larger matmuls run no slower per FLOP; its decode is
memory-bound, which makes the corpus estimate a lower bound on machines with little bandwidth), and
whether the same tokens give a 7B's draft the same acceptance, which no run here can say.

    python scripts/project_make_draft.py results/make_draft/smollm2-q4_0-epyc-1h.report.json \\
        "$(python scripts/default_model.py)" --also results/make_draft/tiny-llama-q8_0.report.json \\
        "$(python scripts/build_tiny_models.py -f llama -q Q8_0)" --out results/make_draft/time-to-draft.json
"""
from __future__ import annotations

import json
from pathlib import Path

import click

from hetero_spec.bench.roofline import LAPTOP_7B_Q4_0
from hetero_spec.config import TargetFingerprint, draft_config_for

SEVEN_B = dict(n_embd=4096, n_vocab=32000, n_layer=32)  # LLaMA-2-7B class, as the laptop roofline


def gguf_params(path: Path) -> tuple[int, int, int, int]:
    """(parameters, n_embd, n_vocab, n_layer) of a GGUF, as llama.cpp loads it (the weights memory-mapped, not read)."""
    import llama_cpp as C

    from hetero_spec.target._ffi import ModelHandle

    model = ModelHandle(Path(path))
    try:
        return (int(C.llama_model_n_params(model.ptr)), C.llama_model_n_embd(model.ptr),
                C.llama_vocab_n_tokens(model.vocab), C.llama_model_n_layer(model.ptr))
    finally:
        model.close()


def draft_weights_per_token(n_embd: int, n_vocab: int, n_layer: int, recipe: dict) -> int:
    """The weights one training token meets in the recipe's draft: every trained matrix plus the head rows."""
    import torch

    from hetero_spec.draft.model import DraftModel
    from hetero_spec.make_draft.plan import choose_taps

    fp = TargetFingerprint("llama", n_embd, n_vocab, "")
    taps = tuple(choose_taps("llama", n_layer)) if recipe.get("taps") else ()
    cfg = draft_config_for(fp, recipe["variant"], n_blocks=recipe["n_blocks"], reduced_vocab=recipe["reduced_vocab"],
                           taps=taps)
    with torch.device("meta"):
        model = DraftModel(cfg)
    trained = sum(p.numel() for p in model.parameters())
    return trained + min(recipe["reduced_vocab"] or n_vocab, n_vocab) * n_embd


def measured(report: Path, model: Path) -> dict:
    """What a finished run spent per stage and reached, with the sizes the projection scales by."""
    rep = json.loads(report.read_text())
    params, n_embd, n_vocab, n_layer = gguf_params(model)
    return {"report": str(report), "target_params": params, "n_embd": n_embd, "n_vocab": n_vocab, "n_layer": n_layer,
            "draft_weights_per_token": draft_weights_per_token(n_embd, n_vocab, n_layer, rep["recipe"]),
            "spent_s": {k: float(v) for k, v in rep["spent_s"].items() if v is not None},
            "corpus_tokens": rep["corpus"]["tokens"], "train_steps": rep["training"]["steps"],
            "measured_tau_per_step": rep["measured_tau_per_step"],
            "estimated_tau_per_step": rep["estimated_tau_per_step"], "recipe": rep["recipe"]}


@click.command()
@click.argument("report", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.argument("model", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--also", nargs=2, multiple=True, type=click.Path(exists=True, dir_okay=False, path_type=Path),
              metavar="REPORT MODEL", help="another finished run to list beside it (not projected)")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), required=True)
def main(report: Path, model: Path, also: tuple[tuple[Path, Path], ...], out: Path) -> None:
    """Stages of REPORT (made for MODEL) and the same budget's work for a 7B target."""
    base = measured(report, model)
    big = draft_weights_per_token(SEVEN_B["n_embd"], SEVEN_B["n_vocab"], SEVEN_B["n_layer"], base["recipe"])
    ratio = {"corpus": LAPTOP_7B_Q4_0.params / base["target_params"], "train": big / base["draft_weights_per_token"],
             "check": LAPTOP_7B_Q4_0.params / base["target_params"]}
    projected = {k: v * ratio[k] for k, v in base["spent_s"].items()}
    data = {
        "measured": [base, *(measured(r, m) for r, m in also)],
        "seven_b": {"from": str(report), "target_params": LAPTOP_7B_Q4_0.params, "draft_weights_per_token": big,
                    "ratio": ratio, "spent_s": projected},
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=1) + "\n")
    click.echo(f"wrote {out}: 7B stages {', '.join(f'{k} {v / 3600:.1f} h' for k, v in projected.items())}")


if __name__ == "__main__":
    main()
