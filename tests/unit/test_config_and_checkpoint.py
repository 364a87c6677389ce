from dataclasses import replace

import pytest
import torch

from hetero_spec.config import ConfigError, DraftConfig, SpecConfig, TargetFingerprint
from hetero_spec.draft.checkpoint import check_compatible, load_draft, read_config, save_draft
from hetero_spec.draft.model import DraftModel, init_weights
from hetero_spec.errors import DraftError

FP = TargetFingerprint("llama", 64, 300, "abc")
CFG = DraftConfig(n_embd=64, n_vocab=300, hidden_size=64, n_heads=4, n_kv_heads=2, ffn_size=128,
                  reduced_vocab=20, fingerprint=FP)


def test_config_json_round_trip():
    assert DraftConfig.from_json(CFG.to_json()) == CFG


@pytest.mark.parametrize("bad", [dict(fusion="mlp"), dict(gate="soft"), dict(n_heads=5), dict(n_kv_heads=3)])
def test_invalid_config_is_refused(bad):
    with pytest.raises(ConfigError):
        replace(CFG, **bad)


def test_spec_config_bounds():
    with pytest.raises(ConfigError):
        SpecConfig(draft_len=-1)
    with pytest.raises(ConfigError):
        SpecConfig(max_new_tokens=0)


def test_save_load_round_trip_keeps_weights_and_vocab_map(tmp_path):
    m = init_weights(DraftModel(CFG), seed=3)
    m.d2t = torch.arange(100, 120)
    save_draft(m, tmp_path / "d.safetensors")
    back = load_draft(tmp_path / "d.safetensors", FP)
    assert back.cfg == CFG
    for (k, a), (_, b) in zip(m.state_dict().items(), back.state_dict().items()):
        torch.testing.assert_close(a, b, msg=k)
    assert "embed" not in back.state_dict() and "head" not in back.state_dict()  # borrowed from the GGUF


def test_truncated_draft_is_a_clear_error(tmp_path):
    m = init_weights(DraftModel(CFG))
    save_draft(m, tmp_path / "d.safetensors")
    data = (tmp_path / "d.safetensors").read_bytes()
    (tmp_path / "t.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(DraftError, match="truncated|readable"):
        load_draft(tmp_path / "t.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file at all")
    with pytest.raises(DraftError):
        read_config(tmp_path / "junk.safetensors")


def test_mismatched_target_names_both_values():
    with pytest.raises(DraftError, match="hidden size 64.*576"):
        check_compatible(CFG, TargetFingerprint("llama", 576, 300, "abc"), "d")
    with pytest.raises(DraftError, match="300.*49152"):
        check_compatible(CFG, TargetFingerprint("llama", 64, 49152, "abc"), "d")
    with pytest.raises(DraftError, match="tokenizer_sha256: draft has 'abc', target has 'zzz'"):
        check_compatible(CFG, TargetFingerprint("llama", 64, 300, "zzz"), "d")
