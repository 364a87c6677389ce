"""Public EAGLE-3 heads of each model family import with ``import-draft`` and propose what the published
forward computes.

Each head is hand-built in the key layout and config.json its family's public heads use, sized to the
family's tiny GGUF (``hetero_spec/tiny_models.py``: 4 layers, hidden 256, a 512-token vocabulary):

* Llama 3.x (as yuhuili/EAGLE3-LLaMA3.1-Instruct-8B): ``midlayer.*``, Llama 3's RoPE frequency scaling,
  no embedding of its own;
* Qwen 3 (as the SpecForge / AngelSlim heads): ``midlayer.*``, an explicit ``head_dim`` that is not the
  width split into the heads (Qwen3-4B: 32 x 128 over 2,560), its own ``embed_tokens``;
* Qwen 2.5, Qwen 3 MoE, Mistral, Phi-3 and Gemma 2 / 3: the Llama decoder layer of the EAGLE-3 recipe,
  under ``layers.0.*`` or ``midlayer.*``, taps named at the top level or under ``eagle_config``.

The reference recomputes EAGLE-3's forward from the checkpoint's tensors over the whole sequence, with
RoPE frequencies from transformers' own rope functions, so our RoPE scaling is checked against theirs.
A head whose decoder our block does not implement (GELU, RoPE types other than Llama 3's) is refused
in one line.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from hetero_spec.errors import DraftError
from hetero_spec.tiny_models import FAMILIES, HIDDEN, LAYERS, VOCAB

DRAFT_VOCAB, NH, NKV, FF, EPS = 128, 4, 2, 384, 1e-5
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 64}  # a short original context, so scaling moves most bands


def family_head(family: str) -> dict:
    """What the family's public EAGLE-3 heads look like: layer prefix, config fields, own embedding."""
    llama_like = dict(prefix="midlayer.", config={"rope_theta": 10000.0}, embed=False, taps_at="eagle_config")
    return {
        "llama": dict(prefix="midlayer.", embed=False, taps_at="eagle_config",
                      config={"rope_theta": 500000.0, "rope_scaling": LLAMA3_SCALING}),
        "qwen3": dict(prefix="midlayer.", embed=True, taps_at="top",
                      config={"rope_theta": 1000000.0, "head_dim": 96}),  # 4 heads of 96 over a width of 256
        "qwen3moe": dict(prefix="midlayer.", embed=True, taps_at="top",
                         config={"rope_theta": 1000000.0, "head_dim": 96}),
        "qwen2": dict(prefix="layers.0.", embed=False, taps_at="top", config={"rope_theta": 1000000.0}),
        "mistral": dict(prefix="midlayer.", embed=False, taps_at="eagle_config",
                        config={"rope_theta": 1000000.0, "head_dim": HIDDEN // NH}),
    }.get(family, llama_like)


def eagle3_head(folder: Path, family: str, taps: list[int], seed: int = 0) -> dict[str, torch.Tensor]:
    """A random EAGLE-3 head in the family's layout under ``folder``; returns its tensors by official name."""
    spec = family_head(family)
    hd = spec["config"].get("head_dim", HIDDEN // NH)
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g) * 0.15  # noqa: E731
    norm = lambda: 1 + 0.3 * torch.randn(HIDDEN, generator=g)  # noqa: E731
    p = spec["prefix"]
    W = {"fc.weight": r(HIDDEN, 3 * HIDDEN), "norm.weight": norm(), "lm_head.weight": r(DRAFT_VOCAB, HIDDEN) * 2,
         p + "input_layernorm.weight": norm(), p + "hidden_norm.weight": norm(),
         p + "post_attention_layernorm.weight": norm(),
         p + "self_attn.q_proj.weight": r(NH * hd, 2 * HIDDEN), p + "self_attn.k_proj.weight": r(NKV * hd, 2 * HIDDEN),
         p + "self_attn.v_proj.weight": r(NKV * hd, 2 * HIDDEN), p + "self_attn.o_proj.weight": r(HIDDEN, NH * hd),
         p + "mlp.gate_proj.weight": r(FF, HIDDEN), p + "mlp.up_proj.weight": r(FF, HIDDEN),
         p + "mlp.down_proj.weight": r(HIDDEN, FF)}
    if spec["embed"]:
        W["embed_tokens.weight"] = torch.randn(VOCAB, HIDDEN, generator=g)
    kept = torch.randperm(VOCAB, generator=g)[:DRAFT_VOCAB].sort().values
    W["d2t"] = kept - torch.arange(DRAFT_VOCAB)  # offsets, as the public heads store them
    W["t2d"] = torch.zeros(VOCAB, dtype=torch.bool)
    W["t2d"][kept] = True
    folder.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in W.items()}, str(folder / "model.safetensors"))
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": HIDDEN,
              "intermediate_size": FF, "num_attention_heads": NH, "num_key_value_heads": NKV, "num_hidden_layers": 1,
              "hidden_act": "silu", "rms_norm_eps": EPS, "max_position_embeddings": 2048, "vocab_size": VOCAB,
              "draft_vocab_size": DRAFT_VOCAB, "target_hidden_size": HIDDEN, "tie_word_embeddings": False,
              **spec["config"]}
    if spec["taps_at"] == "top":
        config["eagle_aux_hidden_state_layer_ids"] = taps
    else:
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": taps, "use_aux_hidden_state": True}
    (folder / "config.json").write_text(json.dumps(config))
    return W


def rope_tables(config: dict, hd: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [n, hd] from transformers' rope functions for this config (the independent reference)."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    fields = {k: v for k, v in config.items() if k not in ("architectures", "eagle_config")}
    cfg = LlamaConfig(**fields | {"head_dim": hd})
    kind = (getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}).get("rope_type", "default")
    if kind == "default":
        inv = 1.0 / config["rope_theta"] ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    else:
        inv = ROPE_INIT_FUNCTIONS[kind](cfg, "cpu")[0].double()
    ang = torch.arange(n, dtype=torch.float64)[:, None] * inv
    ang = torch.cat((ang, ang), -1)
    return ang.cos().float(), ang.sin().float()


def rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w


def eagle3_reference(W: dict, config: dict, prefix: str, embed: torch.Tensor, taps_rows: torch.Tensor,
                     toks: list[int], k: int) -> list[int]:
    """EAGLE-3's forward over the whole sequence per drafted token: g = fc(taps); the layer reads
    [input_layernorm(e); hidden_norm(g)] with residual g; a drafted position's g is the pre-norm output."""
    p, hd = prefix, config.get("head_dim", HIDDEN // NH)
    g, toks, out = list(taps_rows @ W["fc.weight"].T), list(toks), []
    for _ in range(k):
        G, T = torch.stack(g), len(g)
        cos, sin = rope_tables(config, hd, T)
        rot = lambda x: x * cos[:, None] + torch.cat((-x[..., hd // 2:], x[..., : hd // 2]), -1) * sin[:, None]  # noqa: E731
        x = torch.cat((rms(embed[torch.tensor(toks)], W[p + "input_layernorm.weight"]), rms(G, W[p + "hidden_norm.weight"])), -1)
        q = rot((x @ W[p + "self_attn.q_proj.weight"].T).view(T, NH, hd))
        kk = rot((x @ W[p + "self_attn.k_proj.weight"].T).view(T, NKV, hd)).repeat_interleave(NH // NKV, 1)
        v = (x @ W[p + "self_attn.v_proj.weight"].T).view(T, NKV, hd).repeat_interleave(NH // NKV, 1)
        s = torch.einsum("qhd,khd->hqk", q, kk) / hd**0.5 + torch.full((T, T), float("-inf")).triu(1)
        h = G + torch.einsum("hqk,khd->qhd", s.softmax(-1), v).reshape(T, NH * hd) @ W[p + "self_attn.o_proj.weight"].T
        y = rms(h, W[p + "post_attention_layernorm.weight"])
        h = h + (F.silu(y @ W[p + "mlp.gate_proj.weight"].T) * (y @ W[p + "mlp.up_proj.weight"].T)) @ W[p + "mlp.down_proj.weight"].T
        i = int((rms(h[-1], W["norm.weight"]) @ W["lm_head.weight"].T).argmax())
        out.append(i + int(W["d2t"][i]))
        g.append(h[-1])
        toks.append(out[-1])
    return out


@pytest.fixture(scope="module")
def targets() -> dict[str, Path]:
    from hetero_spec.tiny_models import build_all

    return {f: paths["Q8_0"] for f, paths in build_all(progress=False).items()}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_public_eagle3_head_of_each_family_imports_exactly(targets, family, tmp_path):
    import numpy as np

    from converters.draft_import import import_draft
    from hetero_spec.draft.checkpoint import load_draft
    from hetero_spec.draft.runner import DraftRunner
    from hetero_spec.target.gguf_weights import load_target_weights

    assert LAYERS >= 4
    taps = [0, LAYERS // 2, LAYERS - 1]
    W = eagle3_head(tmp_path / "head", family, taps)
    spec = family_head(family)
    config = json.loads((tmp_path / "head" / "config.json").read_text())
    report = import_draft("eagle3", tmp_path / "head", targets[family], tmp_path / "e3.safetensors")
    c = report.config
    assert (c.fusion, c.taps, c.reduced_vocab, c.own_head) == ("eagle3", tuple(taps), DRAFT_VOCAB, True)
    assert c.head_dim == config.get("head_dim", HIDDEN // NH)
    assert bool(c.rope_scaling) == ("rope_scaling" in config)
    assert report.embed == ("own" if spec["embed"] else "target")

    w = load_target_weights(targets[family])
    embed = W["embed_tokens.weight"] if spec["embed"] else torch.from_numpy(np.array(w.embedding))
    model = load_draft(report.out)
    model.attach_target_weights(torch.from_numpy(np.array(w.embedding)), torch.from_numpy(np.array(w.head)))
    runner = DraftRunner(model, device="cpu", dtype="float32", context_rows=False)
    g = torch.Generator().manual_seed(3)
    n = 70  # past the short original context of the Llama 3 scaling, where its bands differ most
    rows, toks = torch.randn(n, 3 * HIDDEN, generator=g) * 2, torch.randint(3, VOCAB, (n,), generator=g).tolist()
    got = runner.propose(rows.numpy(), toks, k=4)
    assert got == eagle3_reference(W, config, spec["prefix"], embed, rows, toks, k=4)


def test_llama3_rope_scaling_matters_and_survives_export(targets, tmp_path):
    """Without its scaling the same Llama 3 head proposes differently (so the check above can fail), and
    export-draft eagle3-hf writes the scaling back as config.json's rope_scaling."""
    import numpy as np

    from converters.draft_export import export_draft
    from converters.draft_import import import_draft
    from hetero_spec.draft.checkpoint import load_draft
    from hetero_spec.draft.runner import DraftRunner
    from hetero_spec.target.gguf_weights import load_target_weights

    target = targets["llama"]
    eagle3_head(tmp_path / "head", "llama", [0, 2, 3])
    config = json.loads((tmp_path / "head" / "config.json").read_text())
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "model.safetensors").symlink_to(tmp_path / "head" / "model.safetensors")
    (plain / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "rope_scaling"}))
    scaled = import_draft("eagle3", tmp_path / "head", target, tmp_path / "s.safetensors")
    unscaled = import_draft("eagle3", plain, target, tmp_path / "u.safetensors")
    w = load_target_weights(target)

    def chains(path: Path) -> list[list[int]]:
        m = load_draft(path)
        m.attach_target_weights(torch.from_numpy(np.array(w.embedding)), torch.from_numpy(np.array(w.head)))
        r = DraftRunner(m, device="cpu", dtype="float32", context_rows=False)
        g = torch.Generator().manual_seed(4)
        out = []
        for _ in range(6):
            r.reset()
            rows, toks = torch.randn(90, 3 * HIDDEN, generator=g) * 2, torch.randint(3, VOCAB, (90,), generator=g).tolist()
            out.append(r.propose(rows.numpy(), toks, k=4))
        return out

    assert chains(scaled.out) != chains(unscaled.out)
    export_draft(scaled.out, target, tmp_path / "again", "eagle3-hf")
    back = json.loads((tmp_path / "again" / "config.json").read_text())
    assert back["rope_scaling"] == LLAMA3_SCALING | {"original_max_position_embeddings": 64}
    assert import_draft("eagle3", tmp_path / "again", target, tmp_path / "a.safetensors").config == scaled.config


@pytest.mark.parametrize("change, expected", [
    ({"hidden_act": "gelu_pytorch_tanh"}, "uses activation 'gelu_pytorch_tanh'; only silu (Llama) imports"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "uses RoPE scaling 'yarn'; plain RoPE and Llama 3's import"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "has an incomplete llama3 rope_scaling"),
    ({"head_dim": 33}, "has head_dim 33; RoPE needs an even head size"),
])
def test_heads_our_block_does_not_implement_are_refused_in_one_line(targets, change, expected, tmp_path):
    from converters.draft_import import import_draft

    eagle3_head(tmp_path / "head", "gemma3", [0, 1, 3])
    config = json.loads((tmp_path / "head" / "config.json").read_text()) | change
    (tmp_path / "head" / "config.json").write_text(json.dumps(config))
    with pytest.raises(DraftError) as err:
        import_draft("eagle3", tmp_path / "head", targets["gemma3"], tmp_path / "x.safetensors")
    assert expected in str(err.value) and "\n" not in str(err.value)
    assert not (tmp_path / "x.safetensors").exists()
