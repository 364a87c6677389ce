"""The target's token embedding and LM head, read from the GGUF for the draft.

They are frozen parts of the target, so a draft file never stores them: the draft
borrows them at load time.  Dequantising 28M weights takes a moment, so the float32
result is cached on disk keyed by the file's identity.
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import TargetError

EMBEDDING = "token_embd.weight"
HEAD = "output.weight"


@dataclass(frozen=True)
class TargetWeights:
    embedding: np.ndarray  # [n_vocab, n_embd] float32
    head: np.ndarray  # [n_vocab, n_embd] float32 (the same array when tied)
    tied: bool


def cache_dir() -> Path:
    root = os.environ.get("HETERO_SPEC_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "hetero-spec"
    )
    return Path(root)


def load_target_weights(path: str | Path) -> TargetWeights:
    path = Path(path)
    st = path.stat()
    key = hashlib.sha256(f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:20]
    folder = cache_dir() / "weights"
    emb_file, head_file = folder / f"{key}.embd.npy", folder / f"{key}.head.npy"
    if emb_file.exists():
        emb = np.load(emb_file, mmap_mode="r")
        tied = not head_file.exists()
        head = emb if tied else np.load(head_file, mmap_mode="r")
        return TargetWeights(emb, head, tied)
    emb, head = _read_and_dequantize(path)
    folder.mkdir(parents=True, exist_ok=True)
    _atomic_save(emb_file, emb)
    if head is not None:
        _atomic_save(head_file, head)
    return TargetWeights(emb, emb if head is None else head, head is None)


def _read_and_dequantize(path: Path) -> tuple[np.ndarray, np.ndarray | None]:
    from gguf import GGUFReader
    from gguf.quants import dequantize

    try:
        reader = GGUFReader(path, "r")
    except Exception as exc:  # gguf raises assorted errors on a damaged file
        raise TargetError(f"cannot read tensors of {path.name}: {exc}") from None
    tensors = {t.name: t for t in reader.tensors}
    if EMBEDDING not in tensors:
        raise TargetError(f"{path.name} has no {EMBEDDING}")

    def load(name: str) -> np.ndarray:
        t = tensors[name]
        arr = dequantize(t.data, t.tensor_type)
        n_rows, n_cols = int(t.shape[1]), int(t.shape[0])  # GGUF lists ne0 (row length) first
        return np.ascontiguousarray(arr.reshape(n_rows, n_cols), dtype=np.float32)

    emb = load(EMBEDDING)
    head = load(HEAD) if HEAD in tensors else None
    return emb, head


def _atomic_save(target: Path, arr: np.ndarray) -> None:
    tmp = target.with_suffix(f".tmp{os.getpid()}.npy")
    np.save(tmp, arr)
    os.replace(tmp, target)
