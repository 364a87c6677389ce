"""The draft network: feature fusion, m gated decoder blocks, frozen target head.

Input at position t is a feature g_t of the target and the embedding of the next token
x_{t+1}; the output is a prediction of f_{t+1} (the target's final-norm hidden state), which
the target's own LM head turns into a distribution over x_{t+2}.

What g is (``DraftConfig.taps``):
  * no taps (EAGLE-1/2): g_t = f_t, the final-norm hidden state; a drafted position feeds
    back the draft's own predicted f.
  * taps (EAGLE-3): g_t = W_taps [h^(a)_t; h^(b)_t; h^(c)_t], the inputs of low, middle and
    high target blocks; a drafted position feeds back the draft's pre-norm output, as
    EAGLE-3 and llama.cpp's EAGLE-3 graph do.

Fusion of g with e = embed(x_{t+1}) (registry ``FUSIONS``):
  * ``dgf`` (Dovetail):  h1 = g W1;  h2 = SiLU(RMSNorm(e) W2);  z = sigmoid([h1; h2] Wz);
    x = z * h1 + (1 - z) * h2
  * ``fc`` (EAGLE):      x = W [e; g] + b
  * ``eagle3``:          x = g, and the first block's attention reads [RMSNorm(e); RMSNorm(g)]
    (2 x hidden wide) instead of RMSNorm(x): EAGLE-3's decoder layer, exportable to llama.cpp.

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
        # the weight in x's dtype: under bf16 autocast a float32 weight sends rms_norm to its slow unfused path
        return F.rms_norm(x, (x.shape[-1],), self.weight.to(x.dtype), self.eps)


class DynamicGatingFusion(nn.Module):
    """Dovetail's DGF: a learned per-channel gate between the feature and the token."""

    def __init__(self, cfg: DraftConfig) -> None:
        super().__init__()
        d, h = cfg.n_embd, cfg.hidden_size
        self.w1 = nn.Linear(cfg.feature_size, h, bias=False)
        self.w2 = nn.Linear(d, h, bias=False)
        self.emb_norm = RMSNorm(d, cfg.rms_eps)
        self.wz = nn.Linear(2 * h, h, bias=True)

    def forward(self, f: torch.Tensor, e: torch.Tensor) -> tuple[torch.Tensor, None]:
        h1 = self.w1(f)
        h2 = F.silu(self.w2(self.emb_norm(e)))
        z = torch.sigmoid(self.wz(torch.cat((h1, h2), dim=-1)))
        return h2 + z * (h1 - h2), None  # = z*h1 + (1-z)*h2 with one op fewer


class ConcatFusion(nn.Module):
    """EAGLE-1's fusion: one linear layer over the concatenated token embedding and feature."""

    def __init__(self, cfg: DraftConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd + cfg.feature_size, cfg.hidden_size, bias=True)

    def forward(self, f: torch.Tensor, e: torch.Tensor) -> tuple[torch.Tensor, None]:
        return self.fc(torch.cat((e, f), dim=-1)), None


class Eagle3Fusion(nn.Module):
    """EAGLE-3's decoder input: the residual stream starts as g, and the first block's q/k/v read
    [RMSNorm(e); RMSNorm(g)] (llama.cpp's ``input_layernorm`` and ``hidden_norm``)."""

    def __init__(self, cfg: DraftConfig) -> None:
        super().__init__()
        self.emb_norm = RMSNorm(cfg.n_embd, cfg.rms_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)

    def forward(self, g: torch.Tensor, e: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return g, torch.cat((self.emb_norm(e), self.hidden_norm(g)), dim=-1)


# Each returns (x, attn_in): the residual stream and, when not None, what the first block's q/k/v read
# instead of RMSNorm(x).
FUSIONS: dict[str, type[nn.Module]] = {"dgf": DynamicGatingFusion, "fc": ConcatFusion, "eagle3": Eagle3Fusion}


def rope_tables(cfg: DraftConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape [max_positions, head_dim] (halves duplicated, rotate-half convention)."""
    half = cfg.head_dim // 2
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(half, dtype=torch.float64) / half))
    if cfg.rope_scaling:
        inv = llama3_scaled(inv, *cfg.rope_scaling)
    ang = torch.outer(torch.arange(cfg.max_positions, dtype=torch.float64), inv)
    ang = torch.cat((ang, ang), dim=-1)
    return ang.cos().float(), ang.sin().float()


def llama3_scaled(inv: torch.Tensor, factor: float, low_freq_factor: float, high_freq_factor: float,
                  original_max_positions: float) -> torch.Tensor:
    """Llama 3's RoPE frequencies: wavelengths longer than the original context / low_freq_factor are
    stretched by ``factor``, those shorter than original / high_freq_factor are kept, and the band between
    is blended linearly in original / wavelength (Meta's ``apply_scaling``, HF's rope type "llama3")."""
    wavelen = 2 * math.pi / inv
    smooth = (original_max_positions / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * inv / factor + smooth * inv
    out = torch.where(wavelen > original_max_positions / low_freq_factor, inv / factor, blended)
    return torch.where(wavelen < original_max_positions / high_freq_factor, inv, out)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., T, hd]; cos/sin [T, hd] float32 (result in x's dtype)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)


class DraftBlock(nn.Module):
    """Llama decoder block (RMSNorm, GQA with RoPE, SwiGLU) with an optional importance gate."""

    def __init__(self, cfg: DraftConfig, attn_in: int | None = None, attn_norm: bool = True) -> None:
        """``attn_in``: width of an input the fusion hands this block's q/k/v instead of RMSNorm(x).
        ``attn_norm`` False: q/k/v read x itself (EAGLE-1/2's first decoder layer has no input norm)."""
        super().__init__()
        h, hd = cfg.hidden_size, cfg.head_dim
        self.n_heads, self.n_kv, self.hd = cfg.n_heads, cfg.n_kv_heads, hd
        self.attn_norm = RMSNorm(h, cfg.rms_eps) if attn_in is None and attn_norm else None
        self.qkv = nn.Linear(attn_in or h, (cfg.n_heads + 2 * cfg.n_kv_heads) * hd, bias=False)
        self.o = nn.Linear(cfg.n_heads * hd, h, bias=False)
        self.ffn_norm = RMSNorm(h, cfg.rms_eps)
        self.gate_up = nn.Linear(h, 2 * cfg.ffn_size, bias=False)
        self.down = nn.Linear(cfg.ffn_size, h, bias=False)
        self.importance = nn.Linear(attn_in or h, 1, bias=True) if cfg.gate == "darter" else None
        if self.importance is not None:
            nn.init.zeros_(self.importance.weight)
            nn.init.constant_(self.importance.bias, 3.0)  # s = 0.95: starts as plain attention

    def project(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn_in: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """x [B, T, H] (or the fusion's ``attn_in`` [B, T, W]) -> q [B, nh, T, hd], k, v [B, nkv, T, hd],
        log-gate [B, T] or None."""
        B, T, _ = x.shape
        if attn_in is not None:
            xn = attn_in
        else:
            xn = self.attn_norm(x) if self.attn_norm is not None else x
        q, k, v = self.qkv(xn).view(B, T, self.n_heads + 2 * self.n_kv, self.hd).transpose(1, 2).split(
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
    An imported head that was trained with its own head rows or embedding (``cfg.own_head`` /
    ``cfg.own_embed``: EAGLE-3 heads carry an ``lm_head``) stores them as the persistent buffers
    ``own_head`` / ``own_embed``, which then stand in for the target's.
    """

    def __init__(self, cfg: DraftConfig) -> None:
        super().__init__()
        self.cfg = cfg
        # EAGLE-3's fc: the concatenated target taps -> g (absent without taps)
        self.tap_fc = nn.Linear(len(cfg.taps) * cfg.n_embd, cfg.hidden_size, bias=False) if cfg.taps else None
        if cfg.taps:
            # [n_in] fixed per-channel input scale, 1 / RMS of each tap channel on the training data (train
            # sets it; ones for imported heads).  WHY: the residual stream of middle and high blocks carries
            # "massive activations": on SmolLM2 one channel of blocks 15 and 27 has an RMS of about 1,200
            # (peaks of 22,000) where the median channel's is 3-13.  Unscaled, those few channels dominate
            # tap_fc's output at initialisation, and every Adam step (about lr per weight) moves their
            # contribution by lr x 1,200, a standing noise on g.  A fixed scale folds into tap_fc's weight
            # exactly on export.
            self.register_buffer("tap_scale", torch.ones(len(cfg.taps) * cfg.n_embd))
        self.fusion = FUSIONS[cfg.fusion](cfg)
        wide = cfg.n_embd + cfg.hidden_size if cfg.fusion == "eagle3" else None
        self.blocks = nn.ModuleList(
            DraftBlock(cfg, wide if i == 0 else None, attn_norm=i > 0 or cfg.first_attn_norm) for i in range(cfg.n_blocks)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_eps) if cfg.final_norm else None
        self.out_proj = nn.Linear(cfg.hidden_size, cfg.n_embd, bias=False) if cfg.hidden_size != cfg.n_embd else None
        cos, sin = rope_tables(cfg)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        n_head = cfg.reduced_vocab or cfg.n_vocab
        self.register_buffer("d2t", torch.arange(n_head, dtype=torch.int64), persistent=bool(cfg.reduced_vocab))
        self.register_buffer("embed", torch.zeros(0, cfg.n_embd), persistent=False)
        self.register_buffer("head", torch.zeros(0, cfg.n_embd), persistent=False)
        self.target_head: torch.Tensor | None = None  # [n_vocab, n_embd], set by attach_target_weights
        if cfg.own_head:  # [n_head, n_embd], row i for target id d2t[i]
            self.register_buffer("own_head", torch.zeros(n_head, cfg.n_embd))
        if cfg.own_embed:  # [n_vocab, n_embd]
            self.register_buffer("own_embed", torch.zeros(cfg.n_vocab, cfg.n_embd))

    def attach_target_weights(self, embedding: torch.Tensor, head: torch.Tensor) -> None:
        """embedding, head: [n_vocab, n_embd] from the GGUF; the head is cut to ``d2t`` rows.  A draft's
        own head rows or embedding (``cfg.own_head`` / ``cfg.own_embed``) take the place of the target's."""
        self.embed = self.own_embed if self.cfg.own_embed else embedding
        # the target's whole head, kept (not a buffer: never saved or cast) for the runner's context rows
        # (context_head.py); None where its rows would not match this head's
        self.target_head = head if self.cfg.reduced_vocab and not self.cfg.own_head else None
        if self.cfg.own_head:
            self.head = self.own_head
        else:
            self.head = head[self.d2t].contiguous() if self.cfg.reduced_vocab else head

    def feature_out(self, x: torch.Tensor) -> torch.Tensor:
        if self.norm is not None:
            x = self.norm(x)
        return self.out_proj(x) if self.out_proj is not None else x

    def real_input(self, features: torch.Tensor) -> torch.Tensor:
        """The target's rows [.., n_in] (f_t, or the concatenated taps) -> g [.., feature_size]."""
        return self.tap_fc(features * self.tap_scale.to(features.dtype)) if self.tap_fc is not None else features

    def drafted_input(self, prenorm: torch.Tensor, predicted: torch.Tensor) -> torch.Tensor:
        """g at a drafted position, from the step before it: its pre-norm state x (taps, as EAGLE-3)
        or its predicted feature f (no taps, as EAGLE-1/2)."""
        return prenorm if self.tap_fc is not None else predicted

    def forward(
        self, features: torch.Tensor, next_tokens: torch.Tensor, attn_valid: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Training/teacher-forced pass over whole sequences.

        features [B, T, n_in] (the target's rows: f_t or its taps), next_tokens [B, T] (x_{t+1}),
        attn_valid [B, T] bool (False for padding).  Returns predicted f_{t+1} [B, T, n_embd] and
        the per-block log-gates [B, T] (empty list without a gate).
        """
        B, T, _ = features.shape
        x, attn_in = self.fusion(self.real_input(features), self.embed[next_tokens])
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]
        causal = torch.full((T, T), float("-inf"), device=x.device).triu(1)
        if attn_valid is not None:
            causal = causal + torch.where(attn_valid, 0.0, float("-inf"))[:, None, None, :]
        else:
            causal = causal[None, None]
        gates: list[torch.Tensor] = []
        for blk in self.blocks:
            q, k, v, log_gate = blk.project(x, cos, sin, attn_in)
            attn_in = None
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
