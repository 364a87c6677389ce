"""A cost-equivalent target reproduces its base exactly: logits, hidden states and greedy tokens."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

from hetero_spec.api import HeteroSpec
from hetero_spec.bench.cost_equivalent import LABEL, META_SCALE, ZEROED, cost_equivalent_label, plan
from hetero_spec.bench.prompts import bench_prompts
from hetero_spec.target.llama_target import LlamaTarget, TargetOptions

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "make_cost_equivalent_target.py"


@pytest.fixture(scope="module")
def scaled_run(model_path, tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """The script as a user runs it, with its own identity check (``greedy_identity``) on."""
    out = tmp_path_factory.mktemp("ce") / "scale2.gguf"
    proc = subprocess.run([sys.executable, SCRIPT, model_path, out, "--scale", "2", "--check-tokens", "16"],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr
    assert "NOT a real larger model" in proc.stdout
    return out, proc


@pytest.fixture(scope="module")
def scaled(scaled_run) -> Path:
    return scaled_run[0]


def test_layout(model_path, scaled):
    base, big = gguf.GGUFReader(model_path), gguf.GGUFReader(scaled)
    p = plan(base, 2.0)
    n0 = p.base_blocks
    assert big.fields["llama.block_count"].contents() == n0 + p.extra_blocks and p.extra_blocks > 0
    assert 1.7 < scaled.stat().st_size / model_path.stat().st_size < 2.3
    old = {t.name: t for t in base.tensors}
    for t in big.tensors:
        if t.name in old:  # every base tensor byte for byte, same type
            assert t.tensor_type == old[t.name].tensor_type and np.array_equal(t.data, old[t.name].data)
            continue
        _, i, rest = t.name.split(".", 2)
        src = old[f"blk.{(int(i) - n0) % n0}.{rest}"]
        assert t.tensor_type == src.tensor_type and t.data.shape == src.data.shape
        if rest.split(".")[0] in ZEROED:
            assert not t.data.any()
        else:
            assert np.array_equal(t.data, src.data)


def test_label(scaled, model_path):
    with LlamaTarget(scaled, TargetOptions(n_ctx=64, embeddings=False)) as t:
        label = cost_equivalent_label(t._model.meta)
        assert t._model.meta(META_SCALE) is not None
    assert label.startswith(LABEL) and model_path.name in label
    with LlamaTarget(model_path, TargetOptions(n_ctx=64, embeddings=False)) as t:
        assert cost_equivalent_label(t._model.meta) is None


def test_greedy_tokens_and_logits_identical(scaled_run):
    """The script's check, one line per prompt: the prompt's last-row logits bit for bit, then 16 greedy tokens
    (the script exits non-zero on any difference; this reads what it compared)."""
    checks = [ln.strip() for ln in scaled_run[1].stderr.splitlines() if re.match(r"\s+(identical|DIFFERENT):", ln)]
    assert len(checks) == 3, scaled_run[1].stderr  # the script's CHECK_PROMPTS
    for line in checks:
        m = re.match(r"identical: logits True, (\d+) greedy tokens True", line)
        assert m and int(m.group(1)) >= 1, line


def test_hidden_states_identical(model_path, scaled):
    """The draft consumes final-norm hidden states: those must be unchanged too."""
    opts = TargetOptions(n_ctx=256, embeddings=True)
    with LlamaTarget(model_path, opts) as a, LlamaTarget(scaled, opts) as b:
        ids = a.tokenize("The capital of France is", add_special=True)
        ha, la = a.prefill(ids)
        hb, lb = b.prefill(ids)
        assert np.array_equal(ha, hb) and np.array_equal(la, lb)


def test_chain_on_scaled_target_equals_plain(scaled, random_draft_path):
    with HeteroSpec(scaled, random_draft_path, n_ctx=512, draft_device="cpu") as hs:
        msg = [{"role": "user", "content": bench_prompts("gsm8k", 1)[0]}]
        spec = hs.chat(msg, max_new_tokens=16, draft_len=3).tokens
        hs.reset()
        assert spec == hs.chat(msg, max_new_tokens=16, draft_len=0).tokens


def test_bad_scale_is_one_line(model_path, tmp_path):
    proc = subprocess.run([sys.executable, SCRIPT, model_path, tmp_path / "x.gguf", "--scale", "0.5"],
                          capture_output=True, text=True, timeout=120)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode != 0 and len(lines) == 1 and "Traceback" not in proc.stderr
