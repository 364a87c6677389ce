"""Attention statistics of a trained draft (DarterSD's observation: a few context tokens carry
most of the draft's attention, the rest is noise that Boolean-mask denoising can drop)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from .. import atomic_file
from ..draft.model import DraftModel
from ..features import iter_sequences

NEGLIGIBLE = 0.01  # attention weight below which a key counts as negligible
MIN_HISTORY = 8  # queries with fewer historical keys say little about concentration


@torch.no_grad()
def attention_probs(
    model: DraftModel, features: torch.Tensor, next_tokens: torch.Tensor
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Teacher-forced pass over one sequence; per block the attention [n_heads, T, T] (gate applied)
    and the importance gates s [T] (empty without a gate)."""
    T = features.shape[0]
    x, attn_in = model.fusion(model.real_input(features[None]), model.embed[next_tokens][None])
    cos, sin = model.rope_cos[:T], model.rope_sin[:T]
    causal = torch.full((T, T), float("-inf")).triu(1)
    out, gates = [], []
    for blk in model.blocks:
        q, k, v, g = blk.project(x, cos, sin, attn_in)
        attn_in = None
        rep = q.shape[1] // k.shape[1]
        ke, ve = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        scores = q @ ke.transpose(-1, -2) * q.shape[-1] ** -0.5 + causal
        if g is not None:
            scores = scores + g[:, None, None, :]
            gates.append(g[0].exp())
        probs = scores.softmax(-1)
        out.append(probs[0])
        a = (probs @ ve).transpose(1, 2).reshape(1, T, -1)
        x = blk.after_attention(x, a)
    return out, gates


def attention_report(model: DraftModel, features_dir: str | Path, *, n_sequences: int, png: Path | None) -> dict:
    model.eval().float()
    top3_share, negligible, gates = [], [], []
    for i, seq in enumerate(iter_sequences(features_dir)):
        if i >= n_sequences:
            break
        T = min(len(seq), 1024)
        f = torch.from_numpy(seq.hidden[:T].astype(np.float32))
        ids = torch.from_numpy(seq.input_ids[:T].astype(np.int64))
        nxt = torch.cat((ids[1:], ids[-1:]))
        probs_per_block, gate_per_block = attention_probs(model, f, nxt)
        gates += [g.numpy() for g in gate_per_block]
        for probs in probs_per_block:
            for t in range(MIN_HISTORY, T):
                hist = probs[:, t, :t]  # [heads, t] weights on earlier tokens
                mass = hist.sum(-1).clamp_min(1e-9)
                top3_share.append((hist.topk(3, dim=-1).values.sum(-1) / mass).mean().item())
                negligible.append((hist < NEGLIGIBLE).float().mean().item())
    if not top3_share:
        return {"queries": 0}
    report = {
        "queries": len(top3_share),
        "top3_share_of_historical_attention": float(np.mean(top3_share)),
        "negligible_key_fraction": float(np.mean(negligible)),
        "negligible_threshold": NEGLIGIBLE,
    }
    if gates:
        g = np.concatenate(gates)
        report["gate_mean"] = float(g.mean())
        report["gate_below_0.5"] = float((g < 0.5).mean())
    if png is not None:
        _plot(top3_share, png)
    return report


def _plot(top3_share: list[float], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.2))
    ax.hist(top3_share, bins=40, range=(0, 1))
    ax.axvline(float(np.mean(top3_share)), color="k", ls="--", label=f"mean {np.mean(top3_share):.2f}")
    ax.set(xlabel="share of historical attention on the top-3 tokens", ylabel="queries")
    ax.legend()
    fig.tight_layout()
    atomic_file.save_figure(fig, png, dpi=110)
    plt.close(fig)
