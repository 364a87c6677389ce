"""What draft interop needs to know about a GGUF target: its block count, width, vocabulary and
fingerprint (llama.cpp's vocabulary, as drafts record it)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from hetero_spec.config import TargetFingerprint
from hetero_spec.errors import TargetError


@dataclass(frozen=True)
class TargetMeta:
    path: Path
    architecture: str
    n_layer: int  # decoder blocks: EAGLE-3 taps must be below this
    n_embd: int
    n_vocab: int
    fingerprint: TargetFingerprint


def read_target_meta(path: str | Path) -> TargetMeta:
    """Block count from the GGUF metadata (llama.cpp, vocabulary only: the gguf package's reader parses
    every token and takes seconds); fingerprint from a 64-cell context without embeddings."""
    from hetero_spec.target._ffi import ModelHandle
    from hetero_spec.target.llama_target import LlamaTarget, TargetOptions

    path = Path(path)
    if not path.is_file():
        raise TargetError(f"target GGUF not found: {path}")
    with LlamaTarget(path, TargetOptions(n_ctx=64, embeddings=False, n_threads=1)) as t:
        fp = t.fingerprint
    handle = ModelHandle(path, vocab_only=True)
    try:
        n_layer = handle.meta(f"{fp.architecture}.block_count")
    finally:
        handle.close()
    if n_layer is None:
        raise TargetError(f"{path.name} has no {fp.architecture}.block_count (not a decoder language model)")
    return TargetMeta(path, fp.architecture, int(n_layer), fp.n_embd, fp.n_vocab, fp)
