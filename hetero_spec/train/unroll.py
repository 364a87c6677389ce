"""Multi-step unrolled forward (EAGLE-3's "training-time test"), all chains in parallel.

At inference the draft's j-th proposal after a real prefix ending at s attends to the real
cells 0..s and to the j cells its own chain wrote at s+1..s+j, computed from its own
predicted features.  Training only on real features (step 0) leaves that regime unseen.
Here every chain start s runs in parallel: step j feeds the prediction of step j-1 back in
(with the real next token, since a chain only matters while it agrees with the target),
and its queries attend to step-0 keys p <= s plus, diagonally, the keys of steps 1..j of
the same chain.  Step j at chain s predicts f_{s+j+1}, whose head distribution covers
x_{s+j+2}.

**Only the rows that are scored are computed.**  Every position needs its keys and values
(they are the context), but the last block's attention, FFN and output are only needed
where a loss is taken (``queries``: answer tokens, not the prompt), and the unrolled steps
only for the chains continued (``chains``, a sample of the queries).  On a CPU this is what
makes unrolling affordable: with a third of the chains continued, two extra steps cost
about as much as a fifth of one full step instead of two.  Without ``queries`` and
``chains`` every position is a query and a chain, in position order.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..draft.model import DraftModel


@dataclass
class StepOutput:
    features: torch.Tensor  # [B, N, n_embd]: step j's prediction of f_{s+j+1} for each selected chain start s
    pos: torch.Tensor  # [B, N] int64: the chain start s of each row (padding rows: 0)
    live: torch.Tensor  # [B, N] bool: False on the padding of the selection
    # per block, log s of the keys this step wrote (empty without a gate), and which of them exist:
    # step 0 writes a key at every position ([B, T], gate_rows = valid), step j a key per chain ([B, N])
    log_gates: list[torch.Tensor]
    gate_rows: torch.Tensor


def _pack(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The True positions of ``mask`` [B, T], packed to the left of each row in ascending order:
    (positions [B, N] int64, padded with 0; live [B, N] bool)."""
    n = int(mask.sum(1).max()) if mask.numel() else 0
    order = torch.argsort((~mask).to(torch.int8), dim=1, stable=True)[:, :n]
    live = mask.gather(1, order)
    return torch.where(live, order, torch.zeros_like(order)), live


def _rows(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """x [B, T, ...] -> x[b, idx[b, n]] as [B, N, ...]."""
    return x.gather(1, idx.view(*idx.shape, *([1] * (x.dim() - 2))).expand(*idx.shape, *x.shape[2:]))


def unrolled_forward(
    model: DraftModel, features: torch.Tensor, next_tokens: torch.Tensor, valid: torch.Tensor, steps: int,
    holes: torch.Tensor | None = None, queries: torch.Tensor | None = None, chains: torch.Tensor | None = None,
) -> list[StepOutput]:
    """features [B, T, n_in] the target's rows (f_t or its taps); next_tokens [B, T] x_{t+1}; valid [B, T]
    bool (False = padding); holes [B]: positions before holes[b] are no keys (0 = none).

    queries [B, T] bool: positions whose step-0 prediction is wanted (default: all); chains [B, T] bool:
    the chain starts continued for steps 1.. (default: the queries; always cut to the queries)."""
    B, T, _ = features.shape
    dev = features.device
    pos = torch.arange(T, device=dev)
    q_mask = queries if queries is not None else torch.ones(B, T, dtype=torch.bool, device=dev)
    q_pos, q_live = _pack(q_mask)
    causal = torch.where(pos[None, :] <= pos[:, None], 0.0, float("-inf"))  # [T(query s), T(key p)]
    key_pad = torch.where(valid, 0.0, float("-inf"))[:, None, None, :]  # [B, 1, 1, T]
    base_bias = causal[None, None] + key_pad  # [B, 1, T, T]
    if holes is not None and bool((holes > 0).any()):
        # keys before holes[b] do not exist at inference (lazy prefill); a query there sees only itself
        hidden = (pos[None, :] < holes[:, None])[:, None, :] & (pos[:, None] != pos[None, :])[None]  # [B, T, T]
        base_bias = base_bias.masked_fill(hidden[:, None], float("-inf"))
    gated = model.cfg.gate == "darter"
    # step 0: keys and values at every position (the context), the last block's queries only where wanted
    real_keys: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    x, attn_in = model.fusion(model.real_input(features), model.embed[next_tokens])
    rope0 = pos.clamp_max(model.cfg.max_positions - 1)
    cos, sin = model.rope_cos[rope0], model.rope_sin[rope0]
    last = len(model.blocks) - 1
    for b, blk in enumerate(model.blocks):
        q, k, v, g = blk.project(x, cos, sin, attn_in)
        attn_in = None
        g = g if g is not None else torch.zeros(B, T, device=dev)
        real_keys.append((k, v, g))
        if b < last:  # every row's output feeds the next block's keys
            x = blk.after_attention(x, _attend(q, k, v, base_bias + g[:, None, None, :], []))
            continue
        q_rows = q.gather(2, q_pos[:, None, :, None].expand(-1, q.shape[1], -1, q.shape[3]))
        bias = _rows(base_bias[:, 0], q_pos)[:, None] + g[:, None, None, :]  # [B, 1, N, T]
        x = blk.after_attention(_rows(x, q_pos), _attend(q_rows, k, v, bias, []))
    pred = model.feature_out(x)
    outputs = [StepOutput(pred, q_pos, q_live, [rk[2] for rk in real_keys] if gated else [], valid)]
    if steps == 1:
        return outputs
    # continue the chains: from rows of the query selection to rows of the chain selection
    if chains is not None:
        c_pos, c_live = _pack(chains & q_mask)
        to_chain = (torch.cumsum(q_mask.long(), dim=1) - 1).clamp_min(0).gather(1, c_pos)
        x, pred = _rows(x, to_chain), _rows(pred, to_chain)
    else:
        c_pos, c_live = q_pos, q_live
    if c_pos.shape[1] == 0:  # a sampled batch may continue no chain at all
        return outputs
    chain_keys: list[list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = [[] for _ in model.blocks]
    bias_c = _rows(base_bias[:, 0], c_pos)[:, None]  # [B, 1, C, T]
    for j in range(1, steps):
        # chain s continues at position s+j with its own g (pre-norm state or predicted f) and the real x_{s+j+1}
        g_in = model.drafted_input(x, pred)
        x, attn_in = model.fusion(g_in, model.embed[next_tokens.gather(1, (c_pos + j).clamp_max(T - 1))])
        idx = (c_pos + j).clamp_max(model.cfg.max_positions - 1)
        cos_j, sin_j = model.rope_cos[idx][:, None], model.rope_sin[idx][:, None]  # [B, 1, C, hd]
        step_gates = []
        for b, blk in enumerate(model.blocks):
            q, k, v, g = blk.project(x, cos_j, sin_j, attn_in)
            attn_in = None
            g = g if g is not None else torch.zeros(x.shape[:2], device=dev)
            step_gates.append(g)
            chain_keys[b].append((k, v, g))
            k0, v0, g0 = real_keys[b]
            x = blk.after_attention(x, _attend(q, k0, v0, bias_c + g0[:, None, None, :], chain_keys[b]))
        pred = model.feature_out(x)
        outputs.append(StepOutput(pred, c_pos, c_live, step_gates if gated else [], c_live))
    return outputs


def _attend(q, k0, v0, bias0, diag: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """q [B, nh, N, hd]; k0/v0 [B, nkv, T, hd]; bias0 [B, 1, N, T]; diag: per earlier chain step (k, v, log-gate)
    at the same chain row, k/v [B, nkv, N, hd].  Returns [B, N, nh*hd]."""
    B, nh, N, hd = q.shape
    T = k0.shape[2]
    rep = nh // k0.shape[1]
    scale = hd**-0.5
    k0e, v0e = k0.repeat_interleave(rep, dim=1), v0.repeat_interleave(rep, dim=1)
    scores = [torch.matmul(q, k0e.transpose(-1, -2)) * scale + bias0]  # [B, nh, N, T]
    values = []
    for k, v, g in diag:
        ke, ve = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        scores.append(((q * ke).sum(-1, keepdim=True) * scale) + g[:, None, :, None])  # [B, nh, N, 1]
        values.append(ve)
    probs = torch.cat(scores, dim=-1).float().softmax(dim=-1).to(q.dtype)
    out = torch.matmul(probs[..., :T], v0e)
    for i, ve in enumerate(values):
        out = out + probs[..., T + i : T + i + 1] * ve
    return out.transpose(1, 2).reshape(B, N, nh * hd)
