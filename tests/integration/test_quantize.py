"""`hetero-spec quantize` and the cached all-Q4_0 default target, on the real SmolLM2 file."""
from __future__ import annotations

import subprocess
import sys
from collections import Counter

import numpy as np
import pytest
from gguf import GGUFReader

from hetero_spec.bench.prompts import bench_prompts
from hetero_spec.default_model import default_model_path
from hetero_spec.target.llama_target import LlamaTarget, TargetOptions
from hetero_spec.target.quantize import QuantizeError, QuantizeOptions, quantize
from tests.invariance import assert_prefix_reuse_equals_fresh_prefill, assert_verify_equals_single_decodes


def _types(path) -> Counter:
    return Counter(t.tensor_type.name for t in GGUFReader(path).tensors if t.name.endswith(".weight") and len(t.shape) == 2)


def test_quantize_all_q4_0_warns_and_loads(model_path, tmp_path):
    out = tmp_path / "q40.gguf"
    with pytest.warns(UserWarning, match="already quantized"):
        quantize(model_path, out, QuantizeOptions("Q4_0", "Q4_0", "Q4_0"))
    assert set(_types(out)) == {"Q4_0"}  # every matrix, the tied embedding/head included
    assert "Q8_0" in _types(model_path)  # the shipped file's tied head is Q8_0: the call changed it
    assert not list(tmp_path.glob(".*tmp*"))  # no temporary left behind
    text = "The quick brown fox jumps over the lazy dog. One, two, three, four, five, six, seven, eight"
    top1 = []
    for path in (model_path, out):
        with LlamaTarget(path, TargetOptions(n_ctx=256)) as t:
            logits, _ = t.verify(t.tokenize(text)[:32])
            assert np.isfinite(logits).all()
            top1.append(logits.argmax(-1))
    assert (top1[0] == top1[1]).mean() >= 0.5  # still the same model (measured 0.6 here; a broken file gives ~0)


def test_default_model_is_cached_q4_0(model_path):
    a = default_model_path()
    mtime = a.stat().st_mtime_ns
    b = default_model_path()
    assert a == b and b.stat().st_mtime_ns == mtime  # made once
    assert set(_types(a)) == {"Q4_0"}


@pytest.mark.parametrize("which", ["shipped", "q4_0"])
def test_batch_invariance_at_32_rows(which, model_path):
    """The runtime's n_batch=32 must be batch-invariant on both formats (greedy losslessness rests on it)."""
    path = model_path if which == "shipped" else default_model_path()
    with LlamaTarget(path, TargetOptions(n_ctx=1024, n_batch=32)) as t:
        prompt = t.tokenize(bench_prompts("gsm8k", 1)[0])
        extra = t.tokenize(" and then the answer is forty two because the farmer sold sixteen eggs at the"
                           " market on Tuesday and kept three for breakfast and baked muffins with four more and gave the rest"
                           " away to her neighbours", add_special=False)[:32]
        assert len(extra) == 32
        assert_verify_equals_single_decodes(t, prompt, extra)
        assert_prefix_reuse_equals_fresh_prefill(t)


def test_bad_inputs_raise_clear_errors(model_path, tmp_path):
    with pytest.raises(QuantizeError, match="unknown quantization type"):
        quantize(model_path, tmp_path / "x.gguf", QuantizeOptions("Q9_9"))
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 64)
    with pytest.raises(QuantizeError, match="could not quantize"):
        quantize(bad, tmp_path / "y.gguf", QuantizeOptions("Q8_0"))
    assert not (tmp_path / "y.gguf").exists()


def test_cli_one_line_error_and_success(model_path, tmp_path):
    cmd = [sys.executable, "-m", "hetero_spec", "quantize"]
    r = subprocess.run(cmd + [str(tmp_path / "missing.gguf"), str(tmp_path / "o.gguf")], capture_output=True, text=True)
    assert r.returncode != 0 and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
    r = subprocess.run(cmd + [str(model_path), str(tmp_path / "q8.gguf"), "--type", "Q8_0"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "warning:" in r.stderr and _types(tmp_path / "q8.gguf")["Q8_0"] > 0
