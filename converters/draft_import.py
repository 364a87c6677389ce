"""Import a public EAGLE-1/2 or EAGLE-3 head (Hugging Face layout) as a hetero-spec draft for a GGUF target.

The head must fit the target: its hidden size and vocabulary (directly, or through ``d2t``) are the
target's, and an EAGLE-3 head's taps are blocks the target has.  Each refusal is one line naming
the mismatch.  Where the public shape differs from our presets the draft config says so
(``final_norm``, ``first_attn_norm``, ``own_head``, ``own_embed``), so the imported draft computes
what the original does.

Head and embedding (``head`` / ``embed`` = auto | own | target):
  * ``lm_head.weight`` (EAGLE-3 trains it): kept as the draft's own rows, unless it equals the target
    head's rows bit for bit (a hetero-spec export), then the target's rows serve.
  * ``embed_tokens.weight`` (EAGLE keeps a frozen copy of the target's): the target's embedding
    serves when the copy matches it within quantisation error (relative RMS difference <= 0.2),
    else the draft keeps its own.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch

from hetero_spec.config import ConfigError, DraftConfig
from hetero_spec.errors import DraftError

from .eagle_layout import (EAGLE3_LAYER_PREFIXES, aux_layer_ids, block_from_hf, d2t_absolute, read_hf_config,
                           read_hf_weights, t2d_mask)
from .target_meta import TargetMeta, read_target_meta

KINDS = ("eagle", "eagle3")
CHOICES = ("auto", "own", "target")
EMBED_MATCH = 0.2  # relative RMS difference below which an embedding copy is the target's (quantisation error)
_IGNORED = re.compile(r"(^|\.)rotary_emb\.inv_freq$|^t2d$")  # derived tensors, recomputed or checked


@dataclass(frozen=True)
class ImportReport:
    out: Path
    config: DraftConfig
    head: str  # "target" | "own": whose head rows the draft multiplies by
    embed: str  # "target" | "own"
    head_diff: float | None  # relative RMS difference of the file's lm_head from the target's rows
    embed_diff: float | None


@dataclass
class _Source:
    """What the HF directory holds, for the target at hand."""

    config: dict
    state: dict[str, torch.Tensor]
    meta: TargetMeta
    name: str

    def get(self, key: str, default=None):
        return self.config.get(key, default)

    def take(self, key: str) -> torch.Tensor | None:
        return self.state.pop(key, None)


_LABEL = {"eagle": "EAGLE-1/2", "eagle3": "EAGLE-3"}


def _detect_kind(src: _Source) -> str | None:
    """Which layout the directory holds, from unambiguous signs (None: cannot tell)."""
    if "draft_vocab_size" in src.config or "d2t" in src.state or any(k.startswith("midlayer.") for k in src.state):
        return "eagle3"
    if any(k.startswith("layers.1.") for k in src.state) or "fc.bias" in src.state:
        return "eagle"
    fc, hidden = src.state.get("fc.weight"), src.config.get("hidden_size")
    if fc is not None and fc.dim() == 2 and hidden:
        return {2 * int(hidden): "eagle", 3 * int(src.config.get("target_hidden_size") or hidden): "eagle3"}.get(
            int(fc.shape[1]))
    return None


def _rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _common_checks(src: _Source, kind: str) -> None:
    """Settings both layouts must have for our Llama block to compute the same thing."""
    name, meta = src.name, src.meta
    missing = [k for k in ("hidden_size", "vocab_size", "num_attention_heads", "intermediate_size") if k not in src.config]
    if missing:
        raise DraftError(f"{name}/config.json lacks {', '.join(missing)}")
    hidden, vocab = src.get("hidden_size"), src.get("vocab_size")
    if int(hidden) != meta.n_embd:
        raise DraftError(f"{name} has hidden size {hidden}, the target has {meta.n_embd}")
    if int(vocab) != meta.n_vocab:
        raise DraftError(f"{name} has a vocabulary of {vocab}, the target has {meta.n_vocab}")
    if src.get("hidden_act", "silu") != "silu":
        raise DraftError(f"{name} uses activation {src.get('hidden_act')!r}; only silu (Llama) imports")
    _rope_scaling(src)  # refuses a scaling other than Llama 3's
    for flag in ("attention_bias", "qkv_bias", "mlp_bias", "norm_before_residual", "norm_before_fc"):
        if src.get(flag):
            raise DraftError(f"{name} sets {flag}, which hetero-spec's {kind} draft does not implement")
    head_dim = src.get("head_dim")
    if head_dim is not None and (int(head_dim) < 2 or int(head_dim) % 2):
        raise DraftError(f"{name} has head_dim {head_dim}; RoPE needs an even head size")
    biases = [k for k in src.state if k.endswith(".bias") and k != "fc.bias"]
    if biases:
        raise DraftError(f"{name} has biases hetero-spec's Llama block lacks ({', '.join(sorted(biases)[:3])})")


def _rope_scaling(src: _Source) -> tuple[float, ...]:
    """config.json's ``rope_scaling`` -> DraftConfig.rope_scaling: () for plain RoPE, Llama 3's four
    parameters for rope type "llama3" (the public Llama 3.x heads); any other scaling is refused."""
    scaling = src.get("rope_scaling") or (src.get("rope_parameters") or {})
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in (None, "default"):
        return ()
    if kind != "llama3":
        raise DraftError(f"{src.name} uses RoPE scaling {kind!r}; plain RoPE and Llama 3's import")
    try:
        return tuple(float(scaling[k]) for k in ("factor", "low_freq_factor", "high_freq_factor",
                                                 "original_max_position_embeddings"))
    except (KeyError, TypeError, ValueError):
        raise DraftError(f"{src.name} has an incomplete llama3 rope_scaling {scaling}") from None


def _rope_theta(src: _Source) -> float:
    params = src.get("rope_parameters") or {}
    return float(src.get("rope_theta", params.get("rope_theta", 10000.0)))  # HF LlamaConfig's default


def _head_size(src: _Source) -> int:
    """DraftConfig.head_size: 0 where config.json's head_dim (if any) is the width split into the heads."""
    head_dim, heads, hidden = src.get("head_dim"), int(src.get("num_attention_heads")), int(src.get("hidden_size"))
    return 0 if head_dim is None or int(head_dim) * heads == hidden else int(head_dim)


def _base_config(src: _Source, **shape) -> dict:
    extra = src.get("hetero_spec") or {}
    fp = extra.get("fingerprint")
    if fp and any(fp.get(k) != getattr(src.meta.fingerprint, k) for k in fp):
        raise DraftError(f"{src.name} was exported for another target ({fp.get('architecture')}, "
                         f"tokenizer {str(fp.get('tokenizer_sha256'))[:12]}...)")
    base = dict(n_embd=src.meta.n_embd, n_vocab=src.meta.n_vocab, hidden_size=int(src.get("hidden_size")),
                n_heads=int(src.get("num_attention_heads")),
                n_kv_heads=int(src.get("num_key_value_heads", src.get("num_attention_heads"))),
                ffn_size=int(src.get("intermediate_size")), rope_theta=_rope_theta(src), rope_scaling=_rope_scaling(src),
                head_size=_head_size(src),
                rms_eps=float(src.get("rms_norm_eps", 1e-6)), gate="none", fingerprint=src.meta.fingerprint)
    if "max_positions" in extra:
        base["max_positions"] = int(extra["max_positions"])
    return base | shape


def _eagle1(src: _Source) -> tuple[dict, dict[str, torch.Tensor]]:
    """EAGLE-1/2: fc over [embed; f], layers.{i}.*, optional final norm."""
    n = int(src.get("num_hidden_layers", 0))
    if n < 1:
        raise DraftError(f"{src.name}/config.json has no num_hidden_layers")
    fc = src.take("fc.weight")
    if fc is None:
        raise DraftError(f"{src.name} has no fc.weight (not an EAGLE-1/2 head)")
    bias = src.take("fc.bias")
    state = {"fusion.fc.weight": fc, "fusion.fc.bias": bias if bias is not None else torch.zeros(fc.shape[0])}
    for i in range(n):
        prefix = f"layers.{i}."
        layer = {k[len(prefix):]: src.state.pop(k) for k in list(src.state) if k.startswith(prefix)}
        if i > 0 and "input_layernorm.weight" not in layer:
            raise DraftError(f"{src.name} layer {i} has no input_layernorm")
        state |= block_from_hf(layer, f"blocks.{i}.")
    norm = src.take("norm.weight")
    if norm is not None:
        state["norm.weight"] = norm
    shape = dict(fusion="fc", n_blocks=n, final_norm=norm is not None,
                 first_attn_norm="blocks.0.attn_norm.weight" in state)
    return shape, state


def _eagle3(src: _Source) -> tuple[dict, dict[str, torch.Tensor]]:
    """EAGLE-3: fc over three block inputs, one midlayer/layers.0 block, norm, lm_head, d2t."""
    meta = src.meta
    if int(src.get("num_hidden_layers", 1)) != 1:
        raise DraftError(f"{src.name} has {src.get('num_hidden_layers')} decoder layers; EAGLE-3 has 1")
    target_hidden = int(src.get("target_hidden_size") or src.get("hidden_size"))
    if target_hidden != meta.n_embd:
        raise DraftError(f"{src.name} reads target features of {target_hidden} values, the target has {meta.n_embd}")
    taps = aux_layer_ids(src.config) or [2, meta.n_layer // 2, meta.n_layer - 3]  # the EAGLE-3 default
    bad = [i for i in taps if not 0 <= i < meta.n_layer]
    if bad:
        raise DraftError(f"{src.name} taps blocks {bad}, the target has blocks 0..{meta.n_layer - 1}")
    if len(taps) != 3:
        raise DraftError(f"{src.name} names {len(taps)} tap layers {taps}; EAGLE-3 fuses exactly 3")
    fc = src.take("fc.weight")
    if fc is None:
        raise DraftError(f"{src.name} has no fc.weight (not an EAGLE-3 head)")
    prefix = next((p for p in EAGLE3_LAYER_PREFIXES if any(k.startswith(p) for k in src.state)), None)
    if prefix is None:
        raise DraftError(f"{src.name} has no midlayer.* or layers.0.* decoder layer")
    layer = {k[len(prefix):]: src.state.pop(k) for k in list(src.state) if k.startswith(prefix)}
    norms = {n: layer.pop(n, None) for n in ("input_layernorm.weight", "hidden_norm.weight")}
    norm = src.take("norm.weight")
    if None in norms.values() or norm is None:
        raise DraftError(f"{src.name} lacks input_layernorm, hidden_norm or norm weights of an EAGLE-3 head")
    state = {"tap_fc.weight": fc, "fusion.emb_norm.weight": norms["input_layernorm.weight"],
             "fusion.hidden_norm.weight": norms["hidden_norm.weight"], "norm.weight": norm}
    state |= block_from_hf(layer, "blocks.0.")
    reduced = _draft_vocab(src, state)
    return dict(fusion="eagle3", n_blocks=1, taps=tuple(taps), reduced_vocab=reduced), state


def _draft_vocab(src: _Source, state: dict[str, torch.Tensor]) -> int:
    """d2t offsets -> our absolute ``d2t`` (in ``state``); returns reduced_vocab (0: the full vocabulary)."""
    n_vocab = src.meta.n_vocab
    draft_vocab = int(src.get("draft_vocab_size") or n_vocab)
    offsets, t2d = src.take("d2t"), src.state.get("t2d")
    if offsets is None:
        if draft_vocab != n_vocab:
            raise DraftError(f"{src.name} has a draft vocabulary of {draft_vocab} but no d2t mapping")
        return 0
    if len(offsets) != draft_vocab:
        raise DraftError(f"{src.name} d2t has {len(offsets)} rows, draft_vocab_size is {draft_vocab}")
    d2t = d2t_absolute(offsets)
    if int(d2t.min()) < 0 or int(d2t.max()) >= n_vocab or len(torch.unique(d2t)) != len(d2t):
        raise DraftError(f"{src.name} d2t maps outside the target's {n_vocab} tokens or repeats one")
    if t2d is not None and not torch.equal(t2d.bool(), t2d_mask(d2t, n_vocab)):
        raise DraftError(f"{src.name} t2d disagrees with d2t")
    if draft_vocab == n_vocab and torch.equal(d2t, torch.arange(n_vocab)):
        return 0
    state["d2t"] = d2t
    return draft_vocab


def _head_and_embed(src: _Source, state: dict, cfg_kw: dict, head: str, embed: str
                    ) -> tuple[str, str, float | None, float | None]:
    """Decide whose head rows and embedding the draft uses (see the module docstring)."""
    from hetero_spec.target.gguf_weights import load_target_weights

    lm, emb = src.take("lm_head.weight"), src.take("embed_tokens.weight")
    if lm is None and emb is None:
        return "target", "target", None, None
    w = load_target_weights(src.meta.path)
    head_diff = embed_diff = None
    head_use = embed_use = "target"
    if lm is not None:
        rows = torch.from_numpy(w.head.copy())
        d2t = state.get("d2t", torch.arange(len(rows)))
        if lm.shape != (len(d2t), src.meta.n_embd):
            raise DraftError(f"{src.name} lm_head is {tuple(lm.shape)}, expected {(len(d2t), src.meta.n_embd)}")
        ref = rows[d2t]
        head_diff = _rel_diff(lm, ref)
        same = torch.equal(lm.float(), ref)
        head_use = "own" if head == "own" or (head == "auto" and not same) else "target"
        if head_use == "own":
            state["own_head"] = lm
    if emb is not None:
        if emb.shape != (src.meta.n_vocab, src.meta.n_embd):
            raise DraftError(f"{src.name} embed_tokens is {tuple(emb.shape)}, expected "
                             f"{(src.meta.n_vocab, src.meta.n_embd)}")
        embed_diff = _rel_diff(emb, torch.from_numpy(w.embedding.copy()))
        embed_use = "own" if embed == "own" or (embed == "auto" and embed_diff > EMBED_MATCH) else "target"
        if embed_use == "own":
            state["own_embed"] = emb
    cfg_kw.update(own_head=head_use == "own", own_embed=embed_use == "own")
    return head_use, embed_use, head_diff, embed_diff


def _build(src: _Source, cfg_kw: dict, state: dict[str, torch.Tensor]):
    """Config + weights -> a DraftModel, or one line saying what does not fit."""
    from hetero_spec.draft.model import DraftModel

    leftover = sorted(k for k in src.state if not _IGNORED.search(k))
    if leftover:
        raise DraftError(f"{src.name} has tensors hetero-spec would not use: {', '.join(leftover[:4])}")
    try:
        cfg = DraftConfig(**cfg_kw)
    except ConfigError as exc:
        raise DraftError(f"{src.name}: {exc}") from None
    model = DraftModel(cfg)
    floats = {k: v.float() if v.is_floating_point() else v for k, v in state.items()}
    if cfg.taps:  # public EAGLE-3 heads read the taps unscaled (any scale is already in their fc)
        floats.setdefault("tap_scale", torch.ones(len(cfg.taps) * cfg.n_embd))
    try:
        model.load_state_dict(floats, strict=True)
    except RuntimeError as exc:
        detail = next((ln.strip() for ln in str(exc).splitlines()[1:] if ln.strip()), str(exc))
        raise DraftError(f"{src.name}'s tensors do not fit its config.json: {detail}") from None
    return model


def import_draft(kind: str, hf_dir: str | Path, target: str | Path, out: str | Path, *, head: str = "auto",
                 embed: str = "auto") -> ImportReport:
    """Read an EAGLE (``eagle``: EAGLE-1/2) or EAGLE-3 (``eagle3``) head from ``hf_dir``, check it against
    the GGUF ``target`` and write a hetero-spec draft to ``out``."""
    from hetero_spec.draft.checkpoint import save_draft

    if kind not in KINDS:
        raise DraftError(f"unknown head kind {kind!r} (use {', '.join(KINDS)})")
    if head not in CHOICES or embed not in CHOICES:
        raise DraftError(f"--head and --embed take {', '.join(CHOICES)}")
    hf_dir, out = Path(hf_dir), Path(out)
    if not hf_dir.is_dir():
        raise DraftError(f"{hf_dir} is not a directory")
    src = _Source(read_hf_config(hf_dir), read_hf_weights(hf_dir), read_target_meta(target), hf_dir.name)
    found = _detect_kind(src)
    if found is not None and found != kind:
        raise DraftError(f"{src.name} is laid out as an {_LABEL[found]} head, not {_LABEL[kind]}: "
                         f"use import-draft {found}")
    _common_checks(src, kind)
    shape, state = (_eagle1 if kind == "eagle" else _eagle3)(src)
    cfg_kw = _base_config(src, **shape)
    head_use, embed_use, head_diff, embed_diff = _head_and_embed(src, state, cfg_kw, head, embed)
    dtypes = {v.dtype for v in state.values() if v.is_floating_point()}  # all bf16: keep bf16, else float32
    model = _build(src, cfg_kw, state)
    out.parent.mkdir(parents=True, exist_ok=True)
    save_draft(model, out, extra={"hetero_spec.imported_from": f"{kind}:{hf_dir.name}"},
               dtype=torch.bfloat16 if dtypes == {torch.bfloat16} else None)
    return ImportReport(out, model.cfg, head_use, embed_use, head_diff, embed_diff)
