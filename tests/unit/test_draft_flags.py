"""The draft-config flags that imported public heads need (final_norm, first_attn_norm, own_head, own_embed):
each changes exactly what it says, and the defaults leave hetero-spec's own drafts as they were."""
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from hetero_spec.config import ConfigError, DraftConfig, TargetFingerprint
from hetero_spec.draft.checkpoint import load_draft, save_draft
from hetero_spec.draft.model import DraftModel, init_weights
from hetero_spec.draft.runner import DraftRunner

D, V = 32, 200
FP = TargetFingerprint("llama", D, V, "abc")
BASE = DraftConfig(n_embd=D, n_vocab=V, hidden_size=D, n_heads=4, n_kv_heads=2, ffn_size=64, n_blocks=2,
                   fusion="fc", gate="none", max_positions=64, fingerprint=FP)


def make(cfg: DraftConfig, seed: int = 0) -> DraftModel:
    m = init_weights(DraftModel(cfg), seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(p * 5 if p.dim() > 1 else 1 + 0.3 * torch.randn(p.shape, generator=g))
        for name, buf in m.named_buffers():
            if name in ("own_head", "own_embed"):
                buf.copy_(torch.randn(buf.shape, generator=g))
    m.attach_target_weights(torch.randn(V, D, generator=g), torch.randn(V, D, generator=g))
    return m


def test_defaults_write_no_new_keys_and_read_back():
    text = BASE.to_json()
    for key in ("final_norm", "first_attn_norm", "own_head", "own_embed"):
        assert key not in text  # files of existing drafts are unchanged
    flagged = replace(BASE, final_norm=False, first_attn_norm=False, own_head=True, own_embed=True)
    assert '"final_norm": false' in flagged.to_json()
    assert DraftConfig.from_json(flagged.to_json()) == flagged
    assert DraftConfig.from_json(text) == BASE


def test_eagle3_fusion_refuses_first_attn_norm_off():
    with pytest.raises(ConfigError, match="first_attn_norm"):
        replace(BASE, fusion="eagle3", first_attn_norm=False)


def test_no_final_norm_returns_the_last_block_output():
    m = make(replace(BASE, final_norm=False))
    assert m.norm is None and "norm.weight" not in m.state_dict()
    x = torch.randn(2, 3, D)
    torch.testing.assert_close(m.feature_out(x), x)
    normed = make(BASE)
    assert not torch.allclose(normed.feature_out(x), x)


def test_first_block_without_input_norm_reads_x_itself():
    m = make(replace(BASE, first_attn_norm=False))
    b0, b1 = m.blocks
    assert b0.attn_norm is None and b1.attn_norm is not None
    assert "blocks.0.attn_norm.weight" not in m.state_dict() and "blocks.1.attn_norm.weight" in m.state_dict()
    x = torch.randn(1, 3, D) * 4
    cos, sin = m.rope_cos[:3], m.rope_sin[:3]
    q, k, v, _ = b0.project(x, cos, sin)
    v_expected = (x @ b0.qkv.weight.T).view(1, 3, -1, b0.hd)[:, :, -b0.n_kv:].transpose(1, 2)
    torch.testing.assert_close(v, v_expected)
    _, _, v1, _ = b1.project(x, cos, sin)  # the second block still normalises
    xn = F.rms_norm(x, (D,), b1.attn_norm.weight, BASE.rms_eps)
    torch.testing.assert_close(v1, (xn @ b1.qkv.weight.T).view(1, 3, -1, b1.hd)[:, :, -b1.n_kv:].transpose(1, 2))


def test_own_head_and_embedding_replace_the_targets(tmp_path):
    cfg = replace(BASE, reduced_vocab=50, own_head=True, own_embed=True)
    m = make(cfg)
    m.d2t = torch.arange(100, 150)
    target_emb, target_head = torch.randn(V, D), torch.randn(V, D)
    m.attach_target_weights(target_emb, target_head)
    assert m.embed is m.own_embed and m.head is m.own_head
    assert m.own_head.shape == (50, D) and m.own_embed.shape == (V, D)
    save_draft(m, tmp_path / "own.safetensors")
    back = load_draft(tmp_path / "own.safetensors", FP)
    assert back.cfg == cfg
    for k, v in m.state_dict().items():
        torch.testing.assert_close(back.state_dict()[k], v, msg=k)
    back.attach_target_weights(target_emb, target_head)
    feats, toks = torch.randn(5, D).numpy(), [3, 7, 11, 13, 17]
    r = DraftRunner(back, device="cpu", dtype="float32")
    first = r.propose(feats, toks, k=1)[0]
    # the proposal comes from the own head over the own embedding: recompute it by hand
    with torch.no_grad():
        pred, _ = back(torch.from_numpy(feats)[None], torch.tensor(toks)[None])
        expect = int(back.d2t[(pred[0, -1] @ m.own_head.T).argmax()])
    assert first == expect
    plain = make(replace(BASE, reduced_vocab=50))
    plain.d2t = torch.arange(100, 150)
    plain.attach_target_weights(target_emb, target_head)
    torch.testing.assert_close(plain.head, target_head[100:150])
