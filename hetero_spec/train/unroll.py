"""Multi-step unrolled forward (EAGLE-3's "training-time test"), all chains in parallel.

At inference the draft's j-th proposal after a real prefix ending at s attends to the real
cells 0..s and to the j cells its own chain wrote at s+1..s+j, computed from its own
predicted features.  Training only on real features (step 0) leaves that regime unseen.
Here every position s starts a chain: step j feeds the prediction of step j-1 back in
(with the real next token, since a chain only matters while it agrees with the target),
and its queries attend to step-0 keys p <= s plus, diagonally, the keys of steps 1..j of
the same chain.  Step j at chain s predicts f_{s+j+1}, whose head distribution covers
x_{s+j+2}.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..draft.model import DraftModel


@dataclass
class StepOutput:
    features: torch.Tensor  # [B, T, n_embd]: step j's prediction of f_{s+j+1} for every chain start s
    log_gates: list[torch.Tensor]  # per block [B, T] log s of the keys this step wrote (empty without a gate)


def unrolled_forward(
    model: DraftModel, features: torch.Tensor, next_tokens: torch.Tensor, valid: torch.Tensor, steps: int,
    holes: torch.Tensor | None = None,
) -> list[StepOutput]:
    """features [B, T, n_in] the target's rows (f_t or its taps); next_tokens [B, T] x_{t+1}; valid [B, T]
    bool (False = padding); holes [B]: positions before holes[b] are no keys (0 = none)."""
    B, T, _ = features.shape
    dev = features.device
    pos = torch.arange(T, device=dev)
    causal = torch.where(pos[None, :] <= pos[:, None], 0.0, float("-inf"))  # [T(query s), T(key p)]
    key_pad = torch.where(valid, 0.0, float("-inf"))[:, None, None, :]  # [B, 1, 1, T]
    base_bias = causal[None, None] + key_pad
    if holes is not None and bool((holes > 0).any()):
        # keys before holes[b] do not exist at inference (lazy prefill); a query there sees only itself
        hidden = (pos[None, :] < holes[:, None])[:, None, :] & (pos[:, None] != pos[None, :])[None]  # [B, T, T]
        base_bias = base_bias.masked_fill(hidden[:, None], float("-inf"))
    outputs: list[StepOutput] = []
    chain_keys: list[list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = [[] for _ in model.blocks]
    real_keys: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    g_in, tok_in = model.real_input(features), next_tokens
    for j in range(steps):
        x, attn_in = model.fusion(g_in, model.embed[tok_in])
        idx = (pos + j).clamp_max(model.cfg.max_positions - 1)
        cos, sin = model.rope_cos[idx], model.rope_sin[idx]
        gates = []
        for b, blk in enumerate(model.blocks):
            q, k, v, g = blk.project(x, cos, sin, attn_in)
            attn_in = None
            g = g if g is not None else torch.zeros(B, T, device=dev)
            gates.append(g)
            if j == 0:
                real_keys.append((k, v, g))
                a = _attend(q, k, v, base_bias + g[:, None, None, :], [])
            else:
                chain_keys[b].append((k, v, g))
                k0, v0, g0 = real_keys[b]
                a = _attend(q, k0, v0, base_bias + g0[:, None, None, :], chain_keys[b])
            x = blk.after_attention(x, a)
        pred = model.feature_out(x)
        outputs.append(StepOutput(pred, gates if model.cfg.gate == "darter" else []))
        # next step: chain s continues at position s+j+1 with its own g (pre-norm state or predicted f)
        g_in = model.drafted_input(x, pred)
        tok_in = _shift_left(next_tokens, j + 1)
    return outputs


def _attend(q, k0, v0, bias0, diag: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """q [B, nh, T, hd]; k0/v0 [B, nkv, T, hd]; bias0 [B, 1, T, T]; diag: per earlier chain step (k, v, log-gate)
    at the same chain index.  Returns [B, T, nh*hd]."""
    B, nh, T, hd = q.shape
    rep = nh // k0.shape[1]
    scale = hd**-0.5
    k0e, v0e = k0.repeat_interleave(rep, dim=1), v0.repeat_interleave(rep, dim=1)
    scores = [torch.matmul(q, k0e.transpose(-1, -2)) * scale + bias0]  # [B, nh, T, T]
    values = []
    for k, v, g in diag:
        ke, ve = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        scores.append(((q * ke).sum(-1, keepdim=True) * scale) + g[:, None, :, None])  # [B, nh, T, 1]
        values.append(ve)
    probs = torch.cat(scores, dim=-1).float().softmax(dim=-1).to(q.dtype)
    out = torch.matmul(probs[..., :T], v0e)
    for i, ve in enumerate(values):
        out = out + probs[..., T + i : T + i + 1] * ve
    return out.transpose(1, 2).reshape(B, T, nh * hd)


def _shift_left(x: torch.Tensor, n: int) -> torch.Tensor:
    """x[:, t] -> x[:, t+n], padding the end by repeating the last column (those rows are masked out)."""
    return torch.cat((x[:, n:], x[:, -1:].expand(-1, min(n, x.shape[1]))), dim=1)[:, : x.shape[1]]
