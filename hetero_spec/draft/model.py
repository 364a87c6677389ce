"""The draft network: feature fusion, m gated decoder blocks, frozen target head.

Input at position t is the target's final hidden state f_t and the embedding of the
next token x_{t+1}; the output is a prediction of f_{t+1}, which the target's own LM
head turns into a distribution over x_{t+2}.

Fusion (registry ``FUSIONS``):
  * ``dgf`` (Dovetail):  h1 = f W1;  h2 = SiLU(RMSNorm(e) W2);  z = sigmoid([h1; h2] Wz);
    g = z * h1 + (1 - z) * h2
  * ``fc`` (EAGLE):      g = W [e; f] + b

Gate ``darter`` (DarterSD): every key token j gets an importance s_j = sigmoid(w . x_j + b)
per block, and its attention logit is shifted by log s_j.  At inference, keys whose s_j
falls below a threshold are masked out (Boolean-mask denoising), except a recent window.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..config import DraftConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class DynamicGatingFusion(nn.Module):
    """Dovetail's DGF: a learned per-channel gate between the feature and the token."""

    def __init__(self, cfg: DraftConfig) -> None:
        super().__init__()
        d, h = cfg.n_embd, cfg.hidden_size
        self.w1 = nn.Linear(d, h, bias=False)
        self.w2 = nn.Linear(d, h, bias=False)
        self.emb_norm = RMSNorm(d, cfg.rms_eps)
        self.wz = nn.Linear(2 * h, h, bias=True)

    def forward(self, f: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        h1 = self.w1(f)
        h2 = F.silu(self.w2(self.emb_norm(e)))
        z = torch.sigmoid(self.wz(torch.cat((h1, h2), dim=-1)))
        return h2 + z * (h1 - h2)  # = z*h1 + (1-z)*h2 with one op fewer


class ConcatFusion(nn.Module):
    """EAGLE-1's fusion: one linear layer over the concatenated token embedding and feature."""

    def __init__(self, cfg: DraftConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(2 * cfg.n_embd, cfg.hidden_size, bias=True)

    def forward(self, f: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.cat((e, f), dim=-1))


FUSIONS: dict[str, type[nn.Module]] = {"dgf": DynamicGatingFusion, "fc": ConcatFusion}


def rope_tables(cfg: DraftConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape [max_positions, head_dim] (halves duplicated, rotate-half convention)."""
    half = cfg.head_dim // 2
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(half, dtype=torch.float64) / half))
    ang = torch.outer(torch.arange(cfg.max_positions, dtype=torch.float64), inv)
    ang = torch.cat((ang, ang), dim=-1)
    return ang.cos().float(), ang.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., T, hd]; cos/sin [T, hd] float32 (result in x's dtype)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)


class DraftBlock(nn.Module):
    """Llama decoder block (RMSNorm, GQA with RoPE, SwiGLU) with an optional importance gate."""

    def __init__(self, cfg: DraftConfig) -> None:
        super().__init__()
        h, hd = cfg.hidden_size, cfg.head_dim
        self.n_heads, self.n_kv, self.hd = cfg.n_heads, cfg.n_kv_heads, hd
        self.attn_norm = RMSNorm(h, cfg.rms_eps)
        self.qkv = nn.Linear(h, (cfg.n_heads + 2 * cfg.n_kv_heads) * hd, bias=False)
        self.o = nn.Linear(cfg.n_heads * hd, h, bias=False)
        self.ffn_norm = RMSNorm(h, cfg.rms_eps)
        self.gate_up = nn.Linear(h, 2 * cfg.ffn_size, bias=False)
        self.down = nn.Linear(cfg.ffn_size, h, bias=False)
        self.importance = nn.Linear(h, 1, bias=True) if cfg.gate == "darter" else None
        if self.importance is not None:
            nn.init.zeros_(self.importance.weight)
            nn.init.constant_(self.importance.bias, 3.0)  # s = 0.95: starts as plain attention

    def project(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """x [B, T, H] -> q [B, nh, T, hd], k, v [B, nkv, T, hd], log-gate [B, T] or None."""
        B, T, _ = x.shape
        xn = self.attn_norm(x)
        q, k, v = self.qkv(xn).view(B, T, -1, self.hd).transpose(1, 2).split(
            (self.n_heads, self.n_kv, self.n_kv), dim=1
        )
        log_gate = None
        if self.importance is not None:
            log_gate = F.logsigmoid(self.importance(xn).squeeze(-1).float())
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v, log_gate

    def finish(self, x: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """Attention over k/v [B, nkv, L, hd] with additive bias [B or 1, 1, T, L], then the FFN."""
        B, _, T, _ = q.shape
        if B == 1 and T == 1:
            a = _attend_one(q, k, v, bias)
        else:
            a = F.scaled_dot_product_attention(
                q, k, v, attn_mask=bias.to(q.dtype), enable_gqa=self.n_kv != self.n_heads
            ).transpose(1, 2)
        return self.after_attention(x, a.reshape(B, T, -1))

    def after_attention(self, x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        """Output projection of the attention a [B, T, nh*hd], residual, then the SwiGLU FFN."""
        x = x + self.o(a)
        g, u = self.gate_up(self.ffn_norm(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(g) * u)


def _attend_one(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """Decode-step attention, one query row: four kernels instead of SDPA's general path.

    q [1, nh, 1, hd]; k, v [1, nkv, L, hd]; bias [1, 1, 1, L] -> [1, 1, nh, hd].
    """
    _, nh, _, hd = q.shape
    nkv, L = k.shape[1], k.shape[2]
    qg = q.view(nkv, nh // nkv, hd)
    scores = torch.baddbmm(bias.view(1, 1, L).to(q.dtype), qg, k[0].transpose(1, 2), alpha=hd**-0.5)
    return torch.bmm(scores.softmax(dim=-1), v[0]).view(1, 1, nh, hd)


class DraftModel(nn.Module):
    """Fusion -> m blocks -> RMSNorm -> predicted feature; logits through the frozen target head.

    The token embedding and the head come from the target GGUF (``attach_target_weights``)
    and are buffers that ``state_dict`` never saves.  With a reduced vocabulary, ``d2t``
    maps head rows back to target ids and is saved, since it is the draft's own choice.
    """

    def __init__(self, cfg: DraftConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.fusion = FUSIONS[cfg.fusion](cfg)
        self.blocks = nn.ModuleList(DraftBlock(cfg) for _ in range(cfg.n_blocks))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.out_proj = nn.Linear(cfg.hidden_size, cfg.n_embd, bias=False) if cfg.hidden_size != cfg.n_embd else None
        cos, sin = rope_tables(cfg)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        n_head = cfg.reduced_vocab or cfg.n_vocab
        self.register_buffer("d2t", torch.arange(n_head, dtype=torch.int64), persistent=bool(cfg.reduced_vocab))
        self.register_buffer("embed", torch.zeros(0, cfg.n_embd), persistent=False)
        self.register_buffer("head", torch.zeros(0, cfg.n_embd), persistent=False)

    def attach_target_weights(self, embedding: torch.Tensor, head: torch.Tensor) -> None:
        """embedding, head: [n_vocab, n_embd] from the GGUF; the head is cut to ``d2t`` rows."""
        self.embed = embedding
        self.head = head[self.d2t].contiguous() if self.cfg.reduced_vocab else head

    def feature_out(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x)
        return self.out_proj(x) if self.out_proj is not None else x

    def forward(
        self, features: torch.Tensor, next_tokens: torch.Tensor, attn_valid: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Training/teacher-forced pass over whole sequences.

        features [B, T, n_embd] (f_t), next_tokens [B, T] (x_{t+1}), attn_valid [B, T] bool
        (False for padding).  Returns predicted f_{t+1} [B, T, n_embd] and the per-block
        log-gates [B, T] (empty list without a gate).
        """
        B, T, _ = features.shape
        x = self.fusion(features, self.embed[next_tokens])
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]
        causal = torch.full((T, T), float("-inf"), device=x.device).triu(1)
        if attn_valid is not None:
            causal = causal + torch.where(attn_valid, 0.0, float("-inf"))[:, None, None, :]
        else:
            causal = causal[None, None]
        gates: list[torch.Tensor] = []
        for blk in self.blocks:
            q, k, v, log_gate = blk.project(x, cos, sin)
            bias = causal
            if log_gate is not None:
                gates.append(log_gate)
                bias = causal + log_gate[:, None, None, :]
            x = blk.finish(x, q, k, v, bias)
        return self.feature_out(x), gates

    def logits(self, feature: torch.Tensor) -> torch.Tensor:
        """feature [..., n_embd] -> logits over the head rows [..., n_head]."""
        return feature @ self.head.t()


def init_weights(model: DraftModel, seed: int = 0) -> DraftModel:
    """Deterministic small-scale init (std 0.02, residual outputs scaled by depth, as in GPT-2)."""
    gen = torch.Generator().manual_seed(seed)
    depth_scale = 1.0 / math.sqrt(2 * max(1, model.cfg.n_blocks))
    for name, p in model.named_parameters():
        if p.dim() == 2:
            std = 0.02 * (depth_scale if name.endswith(("o.weight", "down.weight")) else 1.0)
            with torch.no_grad():
                p.copy_(torch.randn(p.shape, generator=gen) * std)
    return model
