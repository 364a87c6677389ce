"""The public EAGLE checkpoint layouts, in one place for export and import.

EAGLE-1/2 (SafeAILab/EAGLE ``model/cnets.py``): ``fc.weight`` [h, 2h] and ``fc.bias`` over
[embed(x_{t+1}); f_t], then ``layers.{i}.*`` Llama decoder layers (layer 0 without
``input_layernorm``), no final norm; the target's ``lm_head`` reads the last layer's output.

EAGLE-3 (SafeAILab EAGLE-3 / SpecForge ``LlamaForCausalLMEagle3``; vLLM ``llama_eagle3.py``;
llama.cpp ``convert_hf_to_gguf.py``): ``fc.weight`` [h, 3 h_target] over the concatenated inputs of
three target blocks, one decoder layer ``midlayer.*`` (``layers.0.*`` in the vLLM speculators
format) whose ``input_layernorm`` normalises the token embedding and ``hidden_norm`` the fused
feature, q/k/v reading both (2h wide), then ``norm.weight`` and an ``lm_head.weight`` over
``draft_vocab_size`` rows; ``d2t`` holds offsets (target id = i + d2t[i]) and ``t2d`` marks the kept
target ids.  Config keys: ``draft_vocab_size``, ``target_hidden_size``, the tap list as
``eagle_aux_hidden_state_layer_ids`` (top level: llama.cpp; or under ``eagle_config``: vLLM).

Layer names are HF Llama's; our block keeps q/k/v as one ``qkv`` matrix ([q; k; v] rows) and
gate/up as one ``gate_up`` ([gate; up] rows), both with HF's rotate-half RoPE convention, so no
permutation happens here (llama.cpp's converter permutes Q/K for its own RoPE, as for any Llama).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from hetero_spec.config import DraftConfig
from hetero_spec.errors import DraftError

EAGLE3_ARCHITECTURE = "LlamaForCausalLMEagle3"  # what export writes; llama.cpp maps it to its eagle3 arch
EAGLE3_LAYER_PREFIXES = ("midlayer.", "layers.0.")  # SafeAILab/SpecForge, vLLM speculators
AUX_LAYER_KEY = "eagle_aux_hidden_state_layer_ids"

# our per-block names -> HF decoder-layer names (q/k/v and gate/up are split and joined below)
_BLOCK_DIRECT = {"o.weight": "self_attn.o_proj.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
                 "down.weight": "mlp.down_proj.weight", "attn_norm.weight": "input_layernorm.weight"}
_QKV = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight")
_GATE_UP = ("mlp.gate_proj.weight", "mlp.up_proj.weight")


def block_to_hf(state: dict[str, torch.Tensor], prefix: str, cfg: DraftConfig) -> dict[str, torch.Tensor]:
    """Our block ``prefix`` (e.g. ``blocks.0.``) -> HF decoder-layer tensors, keyed by their suffix."""
    hd = cfg.head_dim
    q, k, v = state[prefix + "qkv.weight"].split((cfg.n_heads * hd, cfg.n_kv_heads * hd, cfg.n_kv_heads * hd))
    gate, up = state[prefix + "gate_up.weight"].chunk(2)
    out = dict(zip(_QKV, (q, k, v))) | dict(zip(_GATE_UP, (gate, up)))
    for ours, theirs in _BLOCK_DIRECT.items():
        if prefix + ours in state:
            out[theirs] = state[prefix + ours]
    return {k: t.contiguous() for k, t in out.items()}


def block_from_hf(layer: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """HF decoder-layer tensors keyed by suffix -> our block ``prefix``'s state (``input_layernorm`` only
    where present)."""
    missing = [n for n in (*_QKV, *_GATE_UP, "self_attn.o_proj.weight", "post_attention_layernorm.weight",
                           "mlp.down_proj.weight") if n not in layer]
    if missing:
        raise DraftError(f"decoder layer {prefix.rstrip('.')} lacks {', '.join(missing)}")
    out = {prefix + "qkv.weight": torch.cat([layer[n] for n in _QKV]),
           prefix + "gate_up.weight": torch.cat([layer[n] for n in _GATE_UP])}
    for ours, theirs in _BLOCK_DIRECT.items():
        if theirs in layer:
            out[prefix + ours] = layer[theirs]
    return out


def d2t_offsets(d2t: torch.Tensor) -> torch.Tensor:
    """Absolute target ids of the head rows -> EAGLE-3's offsets (target id = i + d2t[i])."""
    return (d2t.to(torch.int64) - torch.arange(len(d2t), dtype=torch.int64)).contiguous()


def d2t_absolute(offsets: torch.Tensor) -> torch.Tensor:
    return offsets.to(torch.int64) + torch.arange(len(offsets), dtype=torch.int64)


def t2d_mask(d2t: torch.Tensor, n_vocab: int) -> torch.Tensor:
    """[n_vocab] bool: True at the target ids the draft head covers."""
    mask = torch.zeros(n_vocab, dtype=torch.bool)
    mask[d2t.to(torch.int64)] = True
    return mask


def read_hf_config(folder: Path) -> dict:
    """config.json, with the vLLM speculators format's ``transformer_layer_config`` merged in (as llama.cpp's
    converter does)."""
    path = folder / "config.json"
    if not path.is_file():
        raise DraftError(f"{folder} has no config.json (not a Hugging Face checkpoint directory)")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise DraftError(f"{path} is not valid JSON ({exc})") from None
    if isinstance(config.get("transformer_layer_config"), dict):
        config = {**config, **config["transformer_layer_config"]}
    return config


def aux_layer_ids(config: dict) -> list[int] | None:
    """The EAGLE-3 tap list a config names, if any (top level, ``eagle_config`` or ``target_layer_ids``)."""
    for source in (config, config.get("eagle_config") or {}):
        for key in (AUX_LAYER_KEY, "target_layer_ids"):
            if source.get(key):
                return [int(i) for i in source[key]]
    return None


def read_hf_weights(folder: Path) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint: safetensors (single or sharded) or pytorch_model.bin (loaded with
    ``weights_only``); a leading ``model.`` is dropped from names."""
    from safetensors.torch import load_file

    files = sorted(folder.glob("*.safetensors"))
    bins = sorted(folder.glob("pytorch_model*.bin"))
    if not files and not bins:
        raise DraftError(f"{folder} has no *.safetensors or pytorch_model*.bin weights")
    state: dict[str, torch.Tensor] = {}
    try:
        for f in files:
            state.update(load_file(str(f)))
        if not files:
            for f in bins:
                state.update(torch.load(f, map_location="cpu", weights_only=True))
    except Exception as exc:  # corrupt or foreign files raise many types
        raise DraftError(f"cannot read the weights in {folder}: {str(exc).splitlines()[0] if str(exc) else exc}") from None
    return {(k[len("model."):] if k.startswith("model.") else k): v for k, v in state.items()}
