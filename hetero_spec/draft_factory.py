"""Creates draft files shaped for a given target (untrained here; train/ fills the weights).

Lives outside ``draft/`` because it reads the target's fingerprint through llama.cpp.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from .config import DRAFT_PRESETS, DraftConfig
from .target.llama_target import LlamaTarget, TargetOptions


def draft_config_for(target: LlamaTarget, preset: str = "darter", **overrides) -> DraftConfig:
    """A DraftConfig matching the target's feature size, vocabulary and fingerprint."""
    n_embd = target.n_embd
    heads = next(h for h in (9, 8, 12, 16, 6, 4, 3, 2, 1) if n_embd % h == 0 and (n_embd // h) % 2 == 0)
    base = DraftConfig(
        n_embd=n_embd,
        n_vocab=target.n_vocab,
        hidden_size=n_embd,
        n_heads=heads,
        n_kv_heads=next(kv for kv in (3, 4, 2, 1) if heads % kv == 0),
        ffn_size=((int(n_embd * 8 / 3) + 63) // 64) * 64,
        fingerprint=target.fingerprint,
        **DRAFT_PRESETS[preset],
    )
    return replace(base, **{k: v for k, v in overrides.items() if v is not None})


def create_draft(model: str | Path, out: str | Path, *, preset: str = "darter", n_blocks: int | None = None,
                 reduced_vocab: int = 0, seed: int = 0) -> Path:
    import torch

    from .draft.checkpoint import save_draft
    from .draft.model import DraftModel, init_weights

    with LlamaTarget(model, TargetOptions(n_ctx=64, embeddings=False)) as target:
        cfg = draft_config_for(target, preset, n_blocks=n_blocks, reduced_vocab=min(reduced_vocab, target.n_vocab))
    model_ = init_weights(DraftModel(cfg), seed)
    if cfg.reduced_vocab:
        model_.d2t = torch.arange(cfg.reduced_vocab, dtype=torch.int64)
    out = Path(out)
    save_draft(model_, out)
    return out
