"""``hetero-spec bench training``: the held-out curves of several training runs against training
minutes, one colour per run.

Equal wall-clock comparisons (darter against eagle3, drafts/README.md) are read on a time axis:
a variant that costs more per step reaches a given step later, so curves against steps flatter it.

    hetero-spec bench training darter.train/history.json eagle3.train/history.json \
        --label darter --label eagle3 --out drafts/darter-vs-eagle3.png
"""

from __future__ import annotations

import json
from pathlib import Path

import click

from .. import atomic_file


def _evals(path: Path) -> list[dict]:
    """The evaluation records of a trainer's history.json (written beside its checkpoint)."""
    try:
        history = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:  # ValueError covers bad JSON and a binary file's bad UTF-8
        raise click.ClickException(f"{path}: not a readable training history ({type(exc).__name__})") from None
    if not isinstance(history, list):
        raise click.ClickException(f"{path}: not a readable training history (expected a JSON list)")
    evals = [h for h in history if isinstance(h, dict) and "eval" in h and "train_s" in h]
    if not evals:
        raise click.ClickException(f"{path}: no held-out evaluations in this history")
    return evals


@click.command("training")
@click.argument("histories", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--label", "labels", multiple=True, help="One per history, in order (default: the folder name).")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), required=True, help="PNG to write.")
def training_curves(histories: tuple[Path, ...], labels: tuple[str, ...], out: Path) -> None:
    """Plot training runs' held-out acceptance against training minutes (equal wall-clock comparisons)."""
    if labels and len(labels) != len(histories):
        raise click.ClickException(f"{len(labels)} --label for {len(histories)} histories")
    runs = [_evals(path) for path in histories]  # all checked before anything is drawn
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(11, 3.8))
    for i, (path, evals) in enumerate(zip(histories, runs)):
        label = labels[i] if labels else path.parent.name
        minutes = [h["train_s"] / 60 for h in evals]
        colour = f"C{i}"
        ax[0].plot(minutes, [h["eval"]["accepted_length"] for h in evals], "o-", ms=3, color=colour, label=label)
        steps = len(evals[-1]["eval"].get("step_top1", []))
        for j in range(steps):
            ax[1].plot(minutes, [h["eval"]["step_top1"][j] for h in evals], "o-", ms=2, lw=0.8, color=colour,
                       alpha=1.0 - 0.6 * j / max(steps - 1, 1), label=f"{label}, step {j}")
    ax[0].set(xlabel="training minutes", ylabel="held-out accepted length at k=4 (teacher-forced)")
    ax[1].set(xlabel="training minutes", ylabel="held-out top-1 per unrolled step")
    ax[0].legend(fontsize=8)
    ax[1].legend(fontsize=6, ncol=2)
    fig.tight_layout()
    atomic_file.save_figure(fig, out, dpi=110)  # makes the folder
    plt.close(fig)
    click.echo(f"wrote {out}")
