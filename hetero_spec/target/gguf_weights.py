"""The target's token embedding and LM head, read from the GGUF for the draft.

They are frozen parts of the target, so a draft file never stores them: the draft
borrows them at load time.  Dequantising 28M weights takes a moment, so the float32
result is cached on disk keyed by the file's identity.

The embedding handed out is the one the target's first block sees.  Some architectures multiply
the looked-up rows by a constant inside the graph (Gemma by sqrt(n_embd), about 25 for Gemma 3
270M, whose raw rows have an RMS of about 0.04 against 4.4 for its final-norm features).  The
draft gets the scaled rows: its RMSNorm-first fusions (dgf, eagle3) do not care, but EAGLE's fc
fusion would otherwise see the token input some 100x smaller than the feature input (HF's Gemma
embedding module applies the same scale in its forward).  The head
stays the raw tensor (a tied head is the unscaled token_embd in llama.cpp too), so a scaled
target reports ``tied=False``: two arrays.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .. import atomic_file
from ..errors import TargetError

EMBEDDING = "token_embd.weight"
HEAD = "output.weight"


# Architectures whose llama.cpp graph scales the token embedding itself (ggml_scale in
# src/models/<arch>.cpp); value: the scale as a function of n_embd.
ARCH_EMBEDDING_SCALES = {
    **{arch: math.sqrt for arch in ("gemma", "gemma2", "gemma3", "gemma3n", "gemma4", "afmoe")},
    "minicpm3": lambda n_embd: 12.0,
}
# Defaults of ``{arch}.embedding_scale`` (llama.cpp's build_inp_embd applies it to every architecture
# that sets it; these two set it without the key).
ARCH_EMBEDDING_SCALE_DEFAULTS = {"minicpm": 12.0, "grok": 78.38367176906169}


@dataclass(frozen=True)
class TargetWeights:
    embedding: np.ndarray  # [n_vocab, n_embd] float32, scaled as the target's first block sees it
    head: np.ndarray  # [n_vocab, n_embd] float32 (the same array when tied)
    tied: bool  # embedding and head are one array (a tied head and no embedding scale)
    embedding_scale: float = 1.0  # factor already applied to ``embedding`` (see the module docstring)
    # The target's final-logit softcap c (logits = c * tanh(z / c)); 0 = none.  The draft's head and the
    # trainer compute plain z, which leaves the greedy argmax unchanged (tanh is monotone).
    logit_softcap: float = 0.0


def cache_dir() -> Path:
    root = os.environ.get("HETERO_SPEC_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "hetero-spec"
    )
    return Path(root)


def load_target_weights(path: str | Path) -> TargetWeights:
    """Embedding and head of the GGUF at ``path``, dequantized once and cached as .npy files.

    The arrays are copy-on-write maps of the cache files: writable (torch takes them without a
    copy) yet read lazily, so a draft pays only for the rows it touches (Gemma's 262k x 640 float32
    embedding is 671 MB).  A scaled embedding is cached beside the raw one for the same reason.
    """
    path = Path(path)
    st = path.stat()
    key = hashlib.sha256(f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:20]
    folder = cache_dir() / "weights"
    emb_file, head_file = folder / f"{key}.embd.npy", folder / f"{key}.head.npy"
    meta_file, scaled_file = folder / f"{key}.meta.json", folder / f"{key}.embd-scaled.npy"
    if not emb_file.exists():
        emb, head = _read_and_dequantize(path)
        folder.mkdir(parents=True, exist_ok=True)
        _atomic_save(emb_file, emb)
        if head is not None:
            _atomic_save(head_file, head)
    if meta_file.exists():
        meta = json.loads(meta_file.read_text())
    else:  # also for caches written before the metadata was kept
        meta = read_head_meta(path)
        atomic_file.write_text(meta_file, json.dumps(meta))
    scale, softcap = float(meta["embedding_scale"]), float(meta["logit_softcap"])
    if softcap:
        warnings.warn(f"{path.name} caps its final logits at {softcap:g} (tanh); a draft's head and the trainer use "
                      "the uncapped logits: greedy drafts are unaffected, sampled ones and training targets are "
                      "sharper than the target's", UserWarning, stacklevel=2)
    raw = np.load(emb_file, mmap_mode="c")
    head = np.load(head_file, mmap_mode="c") if head_file.exists() else raw
    if scale == 1.0:
        return TargetWeights(raw, head, head is raw, scale, softcap)
    if not scaled_file.exists():
        _atomic_save(scaled_file, raw * np.float32(scale))  # float32 x float32, as llama.cpp's ggml_scale
    return TargetWeights(np.load(scaled_file, mmap_mode="c"), head, False, scale, softcap)


def read_head_meta(path: str | Path) -> dict:
    """What the GGUF's metadata says about its embedding scale and final-logit softcap.

    Read through llama.cpp's vocabulary-only load (0.4 s for Gemma's 262k-token vocabulary, where
    gguf's GGUFReader takes 15 s to parse the token arrays)."""
    from ._ffi import ModelHandle

    model = ModelHandle(Path(path), vocab_only=True)
    try:
        arch = model.meta("general.architecture") or "unknown"
        n_embd = int(model.meta(f"{arch}.embedding_length") or 0)
        scale = ARCH_EMBEDDING_SCALES[arch](n_embd) if arch in ARCH_EMBEDDING_SCALES else 1.0
        scale *= float(model.meta(f"{arch}.embedding_scale") or ARCH_EMBEDDING_SCALE_DEFAULTS.get(arch, 1.0))
        softcap = float(model.meta(f"{arch}.final_logit_softcapping") or 0.0)
    finally:
        model.close()
    return {"architecture": arch, "embedding_scale": scale, "logit_softcap": softcap}


def _read_and_dequantize(path: Path) -> tuple[np.ndarray, np.ndarray | None]:
    from gguf.quants import dequantize

    tensors, _ = _reader_tensors(path)
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


def _reader_tensors(path: Path) -> dict:
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path, "r")
    except Exception as exc:  # gguf raises assorted errors on a damaged file
        raise TargetError(f"cannot read tensors of {path.name}: {exc}") from None
    return {t.name: t for t in reader.tensors}, reader


def _unpermute_rope(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo convert_hf_to_gguf's Q/K row permutation for llama (GGUF pairs rotary dims for llama.cpp's
    interleaved RoPE; the draft, like HF, rotates halves)."""
    out, d = w.shape
    return w.reshape(n_head, out // n_head // 2, 2, d).swapaxes(1, 2).reshape(out, d)


def load_block(path: str | Path, index: int) -> dict[str, np.ndarray]:
    """Block ``index`` of a llama-architecture GGUF, dequantized to float32 in HF layout ([out, in] rows,
    rotate-half Q/K): attn_norm, q, k, v, o, ffn_norm, gate, up, down.  For initialising a draft block
    from the target's own (``train --init-from-target``)."""
    from gguf.quants import dequantize

    path = Path(path)
    tensors, reader = _reader_tensors(path)
    arch_field = reader.fields.get("general.architecture")
    arch = bytes(arch_field.parts[-1]).decode() if arch_field else "unknown"
    if arch != "llama":
        raise TargetError(f"initialising a draft block from the target supports llama GGUFs, not {arch}")
    n_head = int(reader.fields["llama.attention.head_count"].parts[-1][0])
    n_kv = int(reader.fields["llama.attention.head_count_kv"].parts[-1][0])
    names = {"attn_norm": "attn_norm", "q": "attn_q", "k": "attn_k", "v": "attn_v", "o": "attn_output",
             "ffn_norm": "ffn_norm", "gate": "ffn_gate", "up": "ffn_up", "down": "ffn_down"}
    out = {}
    for key, name in names.items():
        t = tensors.get(f"blk.{index}.{name}.weight")
        if t is None:
            raise TargetError(f"{path.name} has no block {index} ({name})")
        arr = dequantize(t.data, t.tensor_type).astype(np.float32)
        out[key] = arr.reshape([int(x) for x in reversed(t.shape)]) if arr.ndim > 1 or len(t.shape) > 1 else arr
    out["q"] = _unpermute_rope(out["q"], n_head)
    out["k"] = _unpermute_rope(out["k"], n_kv)
    return out


def _atomic_save(target: Path, arr: np.ndarray) -> None:
    with atomic_file.replacing(target) as tmp, open(tmp, "wb") as fh:  # a file object: np.save adds no ".npy"
        np.save(fh, arr)
