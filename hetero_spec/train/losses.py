"""Distillation losses: the EAGLE recipe and DarterSD's multi-objective loss.

p is the target's distribution, recomputed from the frozen GGUF head on the target's
feature f_{t+1} (no logits are stored); q is the draft's, from its predicted feature.
With a reduced vocabulary both live on the draft's head rows, p renormalised there:
the draft cannot propose other ids, so their mass carries no gradient signal.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class LossWeights:
    """Defaults and the reasoning behind them are in docs/training.md."""

    recipe: str = "darter"  # "darter" | "eagle" (eagle also serves the dovetail variant)
    kl: float = 1.0  # distribution alignment KL(p || q): what acceptance actually depends on
    logit: float = 0.1  # logit matching on the target's top-k (centred MSE)
    logit_topk: int = 8
    feature: float = 0.5  # feature regression: keeps multi-step feature rollouts on the target's manifold
    gate: float = 0.05  # gate regularisation toward a sparse keep ratio
    keep_ratio: float = 0.7
    ce: float = 0.1  # eagle: SmoothL1(feature) + 0.1 * cross-entropy
    temperature: float = 1.0
    token_weighting: bool = True  # darter: weight tokens by the target's confidence
    step_decay: float = 0.8  # weight of unrolled step j is decay**j


def kl_divergence(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """Per-row KL(p || q) [N] from log-probabilities [N, V]; zero iff p == q."""
    return (log_p.exp() * (log_p - log_q)).sum(-1)


def centred_topk_mse(p_logits: torch.Tensor, q_logits: torch.Tensor, k: int) -> torch.Tensor:
    """Per-row MSE [N] between draft and target logits on the target's top-k ids, each centred
    (logits are shift-invariant, so only their differences should be matched)."""
    idx = p_logits.topk(min(k, p_logits.shape[-1]), dim=-1).indices
    a, b = p_logits.gather(-1, idx), q_logits.gather(-1, idx)
    return ((a - a.mean(-1, keepdim=True)) - (b - b.mean(-1, keepdim=True))).pow(2).mean(-1)


def gate_regularization(log_gates: list[torch.Tensor], valid: torch.Tensor, keep_ratio: float) -> torch.Tensor:
    """(mean gate - keep_ratio)^2 per block, averaged: pulls gates off 1 (plain attention) toward a
    sparse keep ratio, and resists collapse to 0, which a pure sparsity (L1) penalty would reward."""
    if not log_gates:
        return torch.zeros((), device=valid.device)
    w = valid.float()
    terms = [((g.exp() * w).sum() / w.sum().clamp_min(1) - keep_ratio) ** 2 for g in log_gates]
    return torch.stack(terms).mean()


@dataclass
class StepLoss:
    total: torch.Tensor  # scalar, already weighted
    parts: dict[str, float]
    correct: int  # argmax q == argmax p: the draft picks the target's choice among the head rows
    count: int


def step_loss(
    pred: torch.Tensor,
    target_feat: torch.Tensor,
    mask: torch.Tensor,
    head: torch.Tensor,
    w: LossWeights,
) -> StepLoss:
    """pred/target_feat [B, T, d]; mask [B, T] bool; head [V', d] (the draft's head rows).

    Accuracy is scored against the target's own argmax (p from f_{t+1}), never the data's next
    token: on text the target did not write that is someone else's choice, and verification
    checks the target's."""
    sel = mask.nonzero(as_tuple=True)
    if sel[0].numel() == 0:
        z = pred.sum() * 0.0
        return StepLoss(z, {}, 0, 0)
    f_hat, f = pred[sel].float(), target_feat[sel].float()
    q_logits = f_hat @ head.t().float()
    with torch.no_grad():
        p_logits = (f @ head.t().float()) / w.temperature
        log_p = F.log_softmax(p_logits, dim=-1)
    log_q = F.log_softmax(q_logits / w.temperature, dim=-1)
    feat = F.smooth_l1_loss(f_hat, f, reduction="none").mean(-1)
    if w.recipe == "eagle":
        per_token = feat + w.ce * (-(log_p.exp() * log_q).sum(-1))
        parts = {"feature": feat.mean().item()}
    else:
        kl = kl_divergence(log_p, log_q)
        logit = centred_topk_mse(p_logits, q_logits, w.logit_topk)
        per_token = w.kl * kl + w.logit * logit + w.feature * feat
        parts = {"kl": kl.mean().item(), "logit": logit.mean().item(), "feature": feat.mean().item()}
    if w.recipe == "darter" and w.token_weighting:
        # Tokens the target is sure of are the ones a draft can realistically get accepted on;
        # weighting by p's confidence spends capacity there instead of on near-coin-flips.
        conf = log_p.exp().amax(-1)
        per_token = per_token * (conf / conf.mean().clamp_min(1e-6))
    correct = int((q_logits.argmax(-1) == p_logits.argmax(-1)).sum())
    return StepLoss(per_token.mean(), parts, correct, int(sel[0].numel()))
