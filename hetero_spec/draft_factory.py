"""Creates draft files shaped for a given target (untrained here; train/ fills the weights).

Lives outside ``draft/`` because it reads the target's fingerprint through llama.cpp.
"""
from __future__ import annotations

from pathlib import Path

from .config import DraftConfig
from .config import draft_config_for as config_for_fingerprint
from .target.llama_target import LlamaTarget, TargetOptions


def draft_config_for(target: LlamaTarget, preset: str = "darter", **overrides) -> DraftConfig:
    """A DraftConfig matching the target's feature size, vocabulary and fingerprint."""
    return config_for_fingerprint(target.fingerprint, preset, **overrides)


def create_draft(model: str | Path, out: str | Path, *, preset: str = "darter", n_blocks: int | None = None,
                 reduced_vocab: int = 0, seed: int = 0, taps: tuple[int, ...] = ()) -> Path:
    import torch

    from .draft.checkpoint import save_draft
    from .draft.model import DraftModel, init_weights

    with LlamaTarget(model, TargetOptions(n_ctx=64, embeddings=False)) as target:
        cfg = draft_config_for(target, preset, n_blocks=n_blocks, reduced_vocab=min(reduced_vocab, target.n_vocab),
                               taps=tuple(taps) or None)
    model_ = init_weights(DraftModel(cfg), seed)
    if cfg.reduced_vocab:
        model_.d2t = torch.arange(cfg.reduced_vocab, dtype=torch.int64)
    out = Path(out)
    save_draft(model_, out)
    return out
