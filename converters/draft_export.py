"""Export a hetero-spec draft to EAGLE-3's Hugging Face layout, and (``--format gguf``) through
llama.cpp's converter to a GGUF that ``llama-server --spec-type draft-eagle3 -md`` runs.

Only the draft shape EAGLE-3 defines exports: eagle3 fusion, no gate, one block, three taps,
hidden size equal to the target's.  Anything else is refused with every difference named, since
llama.cpp's graph (src/models/eagle3.cpp) would compute something else.

The head: with a reduced vocabulary the export carries ``lm_head.weight`` = the target head's
``d2t`` rows (dequantised from the GGUF, float32, exactly what our draft multiplies by) with
``d2t``/``t2d``; with the full vocabulary it carries none, and llama.cpp then uses the target's own
output matrix, as our draft does.
"""
from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from hetero_spec import atomic_file
from hetero_spec.config import DraftConfig
from hetero_spec.draft.checkpoint import check_compatible, load_draft, read_config
from hetero_spec.errors import DraftError

from .eagle_layout import AUX_LAYER_KEY, EAGLE3_ARCHITECTURE, block_to_hf, d2t_offsets, t2d_mask
from .target_meta import TargetMeta, read_target_meta

FORMATS = ("eagle3-hf", "gguf")


def eagle3_differences(cfg: DraftConfig) -> list[str]:
    """What keeps a draft config from being an EAGLE-3 head llama.cpp can run (empty: exportable)."""
    diffs = []
    if cfg.fusion != "eagle3":
        diffs.append(f"fusion is {cfg.fusion!r} (EAGLE-3 needs 'eagle3')")
    if cfg.gate != "none":
        diffs.append(f"gate is {cfg.gate!r} (llama.cpp's EAGLE-3 attention has no importance gate)")
    if cfg.n_blocks != 1:
        diffs.append(f"{cfg.n_blocks} blocks (EAGLE-3 has exactly 1)")
    if not cfg.taps:
        diffs.append("no taps (it reads the final-norm state, EAGLE-1/2 style; EAGLE-3 reads 3 block inputs)")
    elif len(cfg.taps) != 3:
        diffs.append(f"{len(cfg.taps)} taps {list(cfg.taps)} (llama.cpp's EAGLE-3 needs exactly 3)")
    if cfg.hidden_size != cfg.n_embd:
        diffs.append(f"hidden size {cfg.hidden_size} != the target's {cfg.n_embd}")
    if not cfg.final_norm:
        diffs.append("no final norm (EAGLE-3 normalises before its head)")
    return diffs


def _draft_tensors(path: Path) -> dict[str, torch.Tensor]:
    """The draft file's tensors in their stored dtypes (a bf16 draft exports bf16 weights)."""
    with safe_open(str(path), framework="pt") as fh:
        return {k: fh.get_tensor(k) for k in fh.keys()}


def eagle3_state(state: dict[str, torch.Tensor], cfg: DraftConfig, target_head: torch.Tensor | None
                 ) -> dict[str, torch.Tensor]:
    """Our tensors -> EAGLE-3 names.  ``target_head`` [n_vocab, n_embd] float32 supplies ``lm_head`` rows
    for a reduced vocabulary without an own head."""
    fc = state["tap_fc.weight"]
    if "tap_scale" in state:  # our fixed input scale folds into EAGLE-3's fc exactly: W diag(s)
        fc = (fc.float() * state["tap_scale"].float()[None, :]).to(fc.dtype)
    out = {"fc.weight": fc, "norm.weight": state["norm.weight"],
           "midlayer.input_layernorm.weight": state["fusion.emb_norm.weight"],
           "midlayer.hidden_norm.weight": state["fusion.hidden_norm.weight"]}
    out |= {"midlayer." + k: v for k, v in block_to_hf(state, "blocks.0.", cfg).items()}
    if cfg.own_head:
        out["lm_head.weight"] = state["own_head"]
    elif cfg.reduced_vocab:
        out["lm_head.weight"] = target_head[state["d2t"]].to(torch.float32)
    if cfg.reduced_vocab:
        out["d2t"] = d2t_offsets(state["d2t"])
        out["t2d"] = t2d_mask(state["d2t"], cfg.n_vocab)
    if cfg.own_embed:
        out["embed_tokens.weight"] = state["own_embed"]
    return {k: v.contiguous() for k, v in out.items()}


def _rope_scaling_json(cfg: DraftConfig) -> dict | None:
    """DraftConfig.rope_scaling as HF's config.json writes Llama 3's (None: plain RoPE)."""
    if not cfg.rope_scaling:
        return None
    factor, low, high, original = cfg.rope_scaling
    return {"rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": high,
            "original_max_position_embeddings": int(original)}


def eagle3_config(cfg: DraftConfig, n_layer: int, dtype: torch.dtype) -> dict:
    """config.json as llama.cpp's converter (and vLLM / SGLang) read an EAGLE-3 head."""
    taps = list(cfg.taps)
    return {
        "architectures": [EAGLE3_ARCHITECTURE],
        "model_type": "llama",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.ffn_size,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": _rope_scaling_json(cfg),
        "attention_bias": False,
        "mlp_bias": False,
        "max_position_embeddings": cfg.max_positions,
        "vocab_size": cfg.n_vocab,
        "draft_vocab_size": cfg.reduced_vocab or cfg.n_vocab,
        "target_hidden_size": cfg.n_embd,
        "tie_word_embeddings": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
        AUX_LAYER_KEY: taps,  # llama.cpp reads it here
        "eagle_config": {AUX_LAYER_KEY: taps, "use_aux_hidden_state": True},  # vLLM reads it here
        # hetero-spec's own settings, read back by import-draft (others ignore unknown keys)
        "hetero_spec": {"max_positions": cfg.max_positions, "target_n_layer": n_layer,
                        "fingerprint": json.loads(cfg.to_json())["fingerprint"]},
    }


def export_eagle3_hf(draft: Path, meta: TargetMeta, out_dir: Path) -> Path:
    """Write ``out_dir``/config.json and model.safetensors; refuses a draft EAGLE-3 cannot express."""
    cfg = read_config(draft)
    diffs = eagle3_differences(cfg)
    if diffs:
        raise DraftError(f"{draft.name} cannot be exported to EAGLE-3: " + "; ".join(diffs))
    check_compatible(cfg, meta.fingerprint, draft.name)
    bad = [i for i in cfg.taps if i >= meta.n_layer]
    if bad:
        raise DraftError(f"{draft.name} taps {bad} are not blocks of the target (it has {meta.n_layer})")
    load_draft(draft, meta.fingerprint)  # the file matches its config
    state = _draft_tensors(draft)
    head = None
    if cfg.reduced_vocab and not cfg.own_head:
        from hetero_spec.target.gguf_weights import load_target_weights

        head = torch.from_numpy(load_target_weights(meta.path).head.copy())
    tensors = eagle3_state(state, cfg, head)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    config = eagle3_config(cfg, meta.n_layer, state["tap_fc.weight"].dtype)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out_dir


def export_draft(draft: str | Path, target: str | Path, out: str | Path, fmt: str = "eagle3-hf",
                 outtype: str = "f32") -> Path:
    """``eagle3-hf``: the HF directory ``out``; ``gguf``: that directory converted by llama.cpp's
    convert_hf_to_gguf.py into the file ``out`` (``outtype`` f32 keeps our float weights exactly)."""
    from .llama_convert import convert_to_gguf

    draft, out = Path(draft), Path(out)
    if fmt not in FORMATS:
        raise DraftError(f"unknown export format {fmt!r} (use {', '.join(FORMATS)})")
    meta = read_target_meta(target)
    if fmt == "eagle3-hf":
        return export_eagle3_hf(draft, meta, out)
    with tempfile.TemporaryDirectory(prefix="hetero-spec-eagle3-") as tmp:
        hf = export_eagle3_hf(draft, meta, Path(tmp) / "hf")
        with atomic_file.replacing(out) as part:
            convert_to_gguf(hf, meta.path, meta, part, outtype, model_name=draft.stem)
    return out
