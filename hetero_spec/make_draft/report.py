"""``make-draft``'s closing report: the mean accepted length τ per unrolled step, estimated and measured.

Two views of one question (how many tokens a round yields at chain length k):

* **estimated**: teacher-forced on the corpus's held-out sequences, from the trainer's top-1 per
  unrolled step j given steps < j accepted: τ_k = 1 + Σ_{j<k} Π_{i≤j} top1_i;
* **measured**: the draft as ``run`` runs it on the shipped bench prompts, chain of 4: τ_k is the
  mean of 1 + min(accepted, k) over the rounds that drafted at least k tokens.

The estimate overstates the measurement on a self-distilled corpus (docs/training.md, "Evaluation");
both are reported so that the gap is visible.
"""
from __future__ import annotations

import json
from pathlib import Path

from .. import atomic_file
from .pipeline import looped_turns
from .plan import part_kind


def estimated_tau(step_top1: list[float]) -> list[float]:
    """τ_k for k = 1..len(step_top1) from top-1 per unrolled step (each given the steps before accepted)."""
    out, run, tau = [], 1.0, 1.0
    for p in step_top1:
        run *= p
        tau += run
        out.append(round(tau, 4))
    return out


def measured_tau(rounds: list[list[int]], k_max: int) -> list[float | None]:
    """τ_k for k = 1..k_max from [drafted, accepted] pairs of chain-k_max rounds (None: no round)."""
    out: list[float | None] = []
    for k in range(1, k_max + 1):
        full = [1 + min(a, k) for d, a in rounds if d >= k]
        out.append(round(sum(full) / len(full), 4) if full else None)
    return out


def build_report(plan, state, paths, chain: int) -> dict:
    """The report dict (written as OUT.report.json): what was made, in how long, and how good."""
    corpus = state.stage("corpus")
    train = state.stage("train")["summary"]
    check = state.stage("check")
    ev = train.get("eval") or {}
    every = [r for rs in check["rounds"].values() for r in rs]
    parts = corpus.get("parts", [])
    return {
        "model": plan.model, "draft": str(paths.out), "hours": plan.hours,
        "budget_s": {"corpus": round(plan.budget.corpus_s), "train": round(plan.budget.train_s),
                     "check": round(plan.budget.check_s), "reserve": round(plan.budget.reserve_s)},
        "spent_s": {"corpus": corpus.get("seconds"), "train": train.get("train_seconds"),
                    "check": check.get("seconds")},
        "corpus": {"parts": len(parts), "conversations": sum(p.get("conversations", 0) for p in parts),
                   "tokens": sum(p.get("tokens", 0) for p in parts),
                   "assistant_tokens": sum(p.get("assistant_tokens", 0) for p in parts),
                   # of them, answers to requests the model wrote itself (``--self-prompts``, a share of the budget)
                   "self_prompts": plan.self_prompts,
                   "self_conversations": sum(p.get("conversations", 0) for p in parts if part_kind(p) == "self"),
                   "self_requests_sampled": sum(p.get("sampled", 0) for p in parts),
                   # answer turns ended where training stops scoring a repetition loop (0: the plan ran them out)
                   "stop_loops": plan.stop_loops, "stopped_in_loop": looped_turns(paths, parts)},
        "recipe": {**{k: plan.train[k] for k in ("variant", "taps", "n_blocks", "unroll_steps", "chain_sample",
                                                  "reduced_vocab", "loop_keep", "lr")},
                   "step_decay": plan.train.get("step_decay", 0.8)},
        "training": {k: train.get(k) for k in ("steps", "epochs", "train_seconds", "train_tokens",
                                               "vocab_coverage", "held_out_sequences")},
        "held_out_top1_per_step": ev.get("step_top1"),
        "estimated_tau_per_step": estimated_tau(ev.get("step_top1") or []),
        "measured_tau_per_step": measured_tau(every, chain),
        "measured_tau_per_set": {name: measured_tau(rs, chain)[-1] for name, rs in check["rounds"].items()},
        "check_prompts": check.get("prompts"),
        "plot": str(paths.report_png),
    }


def summary_lines(report: dict) -> list[str]:
    """The report in a few lines for the terminal."""
    fmt = lambda xs: " ".join("-" if x is None else f"{x:.2f}" for x in xs)  # noqa: E731
    per_set = ", ".join(f"{k} {'-' if v is None else f'{v:.2f}'}" for k, v in report["measured_tau_per_set"].items())
    own = report["corpus"].get("self_conversations", 0)  # reports made before --self-prompts have none
    own_part = f"{own} on requests the model wrote; " if own else ""
    looped = report["corpus"].get("stopped_in_loop", 0)  # reports made before --stop-loops have none
    loop_part = f"; {looped} turns ended in a loop" if looped else ""
    return [
        f"wrote {report['draft']}: {report['training']['steps']} steps on {report['corpus']['conversations']} "
        f"conversations ({own_part}{report['corpus']['assistant_tokens']} answer tokens{loop_part})",
        f"tau per unrolled step k=1..{len(report['estimated_tau_per_step'])}, held-out estimate: "
        f"{fmt(report['estimated_tau_per_step'])}",
        f"tau per unrolled step, measured on {report['check_prompts']} bench prompts: "
        f"{fmt(report['measured_tau_per_step'])} ({per_set} at the longest chain)",
        f"report: {Path(report['draft']).with_suffix('.report.json')}, plot: {report['plot']}",
    ]


def plot(report: dict, history_path: Path, png: Path) -> None:
    """τ against chain length (estimated and measured) and the held-out estimate against training
    minutes, into ``png`` (written to a temporary file and renamed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(11, 3.8))
    est, mea = report["estimated_tau_per_step"], report["measured_tau_per_step"]
    ks = list(range(0, len(est) + 1))
    ax[0].plot(ks, [1.0] + est, "o-", label="held-out estimate (teacher-forced)")
    ax[0].plot(list(range(0, len(mea) + 1)), [1.0] + [m if m is not None else float("nan") for m in mea], "s-",
               label=f"measured, {report['check_prompts']} bench prompts")
    ax[0].set(xlabel="chain length k (unrolled draft steps)", ylabel="mean accepted length tau", xticks=ks)
    ax[0].legend(fontsize=8)
    ax[0].grid(alpha=0.3)
    history = json.loads(history_path.read_text()) if history_path.is_file() else []
    evals = [h for h in history if "eval" in h]
    if evals:
        ax[1].plot([h["train_s"] / 60 for h in evals], [h["eval"]["accepted_length"] for h in evals], "o-", ms=3)
    ax[1].set(xlabel="training minutes", ylabel=f"held-out tau estimate, chain {len(est)}")
    ax[1].grid(alpha=0.3)
    fig.suptitle(f"{Path(report['draft']).name}: {report['training']['steps']} steps, "
                 f"{report['corpus']['conversations']} conversations, {report['hours']} h budget", fontsize=9)
    fig.tight_layout()
    try:
        atomic_file.save_figure(fig, png, dpi=110)
    finally:
        plt.close(fig)
