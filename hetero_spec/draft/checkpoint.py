"""Self-describing draft files: safetensors weights + config JSON in the metadata.

The target's embedding and LM head are not in the file; the fingerprint says which
target they must come from.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from .. import atomic_file
from ..config import ConfigError, DraftConfig, TargetFingerprint
from ..errors import DraftError
from .model import DraftModel

CONFIG_KEY = "hetero_spec.draft_config"
FORMAT_KEY = "hetero_spec.format"
FORMAT = "1"
TRAINING_KEY = "hetero_spec.training"  # the trainer's summary (steps, data, held-out evaluation)


def save_draft(
    model: DraftModel, path: str | Path, extra: dict[str, str] | None = None, dtype: torch.dtype | None = None
) -> None:
    """Write atomically, so an interrupted save never leaves a half-written draft behind.

    ``dtype`` (e.g. bfloat16) stores floating weights smaller; loading casts them back.
    """
    path = Path(path)
    state = {
        k: (v.to(dtype) if dtype is not None and v.is_floating_point() else v).detach().to("cpu").contiguous()
        for k, v in model.state_dict().items()
    }
    meta = {CONFIG_KEY: model.cfg.to_json(), FORMAT_KEY: FORMAT, **(extra or {})}
    with atomic_file.replacing(path) as tmp:
        save_file(state, str(tmp), metadata=meta)


def read_metadata(path: str | Path) -> dict[str, str]:
    path = Path(path)
    if not path.is_file():
        raise DraftError(f"draft file not found: {path}")
    try:
        with safe_open(str(path), framework="pt") as fh:
            return fh.metadata() or {}
    except (SafetensorError, OSError, ValueError) as exc:
        raise DraftError(f"{path.name} is not a readable safetensors file ({_first_line(exc)})") from None


def read_config(path: str | Path) -> DraftConfig:
    path = Path(path)
    meta = read_metadata(path)
    if CONFIG_KEY not in meta:
        raise DraftError(f"{path.name} is not a hetero-spec draft (no {CONFIG_KEY} in its metadata)")
    try:
        return DraftConfig.from_json(meta[CONFIG_KEY])
    except (ConfigError, TypeError, ValueError) as exc:
        raise DraftError(f"{path.name} has an invalid draft config: {_first_line(exc)}") from None


def read_held_out_acceptance(path: str | Path) -> tuple[float, ...]:
    """The trainer's held-out top-1 per unrolled step (depth 1, 2, ...), or () for a draft without
    one (an imported head, an old file).  ``--draft-len auto`` starts from these instead of 0.5."""
    try:
        summary = json.loads(read_metadata(path).get(TRAINING_KEY, "{}"))
        steps = (summary.get("eval") or {}).get("step_top1") or ()
        return tuple(float(x) for x in steps if 0.0 < float(x) < 1.0)
    except (DraftError, ValueError, TypeError, AttributeError):
        return ()


def load_draft(path: str | Path, target: TargetFingerprint | None = None) -> DraftModel:
    """Build the model from the file; with ``target`` given, refuse a draft made for another model."""
    path = Path(path)
    cfg = read_config(path)
    if target is not None:
        check_compatible(cfg, target, path.name)
    model = DraftModel(cfg)
    try:
        with safe_open(str(path), framework="pt") as fh:
            state = {k: fh.get_tensor(k) for k in fh.keys()}
    except (SafetensorError, OSError, ValueError) as exc:
        raise DraftError(f"{path.name} is truncated or corrupt ({_first_line(exc)})") from None
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if k != "tap_scale"]  # drafts from before the tap scale: ones (no scale)
    if missing or unexpected:
        raise DraftError(f"{path.name} does not match its config: missing {missing[:3]}, unexpected {unexpected[:3]}")
    return model


def check_compatible(cfg: DraftConfig, target: TargetFingerprint, name: str) -> None:
    if cfg.n_embd != target.n_embd:
        raise DraftError(f"{name} expects hidden size {cfg.n_embd}, the target has {target.n_embd}")
    if cfg.n_vocab != target.n_vocab:
        raise DraftError(f"{name} expects a vocabulary of {cfg.n_vocab}, the target has {target.n_vocab}")
    if cfg.fingerprint is not None:
        diffs = target.mismatches(cfg.fingerprint)
        if diffs:
            raise DraftError(f"{name} was made for another target: " + "; ".join(diffs))


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
