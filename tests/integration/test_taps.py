"""Drafts that read target block inputs (EAGLE-3 taps): the target returns them from the same decode,
they leave the logits alone, and speculative output still equals plain decoding."""
from __future__ import annotations

import numpy as np
import pytest

from hetero_spec.bench.prompts import bench_prompts
from hetero_spec.errors import TargetError
from hetero_spec.target.layer_taps import LayerTapTarget
from hetero_spec.target.llama_target import LlamaTarget, TargetOptions

TAPS = (2, 15, 27)


@pytest.fixture(scope="module")
def taps_draft_path(model_path, tmp_path_factory):
    from hetero_spec.draft_factory import create_draft

    out = tmp_path_factory.mktemp("drafts") / "eagle3.safetensors"
    return create_draft(model_path, out, preset="eagle3", taps=TAPS, reduced_vocab=8192, seed=2)


def test_taps_are_the_block_inputs_and_leave_the_logits_alone(model_path):
    ids = LlamaTarget(model_path, TargetOptions(n_ctx=256, embeddings=False)).tokenize(bench_prompts("alpaca", 1)[0])
    with LlamaTarget(model_path, TargetOptions(n_ctx=512, taps=TAPS, n_threads=1)) as t:
        assert t.feature_size == 3 * t.n_embd
        feats, logits = t.prefill(ids)
        feats = feats.copy()
    with LlamaTarget(model_path, TargetOptions(n_ctx=512, n_threads=1)) as plain:
        _, plain_logits = plain.prefill(ids)
    np.testing.assert_array_equal(logits, plain_logits)
    # block i's input is block i-1's output, which the eval callback reads as l_out-(i-1)
    with LayerTapTarget(model_path, tuple(i - 1 for i in TAPS), n_ctx=512, n_batch=32, n_threads=1) as lt:
        _, outs = lt.run(ids)
    for j, i in enumerate(TAPS):
        block = feats[:, j * 576 : (j + 1) * 576]
        np.testing.assert_allclose(block, outs[i - 1], rtol=1e-5, atol=1e-5)


def test_taps_out_of_range_are_refused(model_path):
    with pytest.raises(TargetError, match="out of range"):
        LlamaTarget(model_path, TargetOptions(n_ctx=64, taps=(2, 30)))


@pytest.fixture(scope="module")
def taps_hs(model_path, taps_draft_path):
    from hetero_spec.api import HeteroSpec

    with HeteroSpec(model_path, taps_draft_path, n_ctx=1024, draft_device="cpu", draft_dtype="float32") as hs:
        yield hs


PROMPTS = bench_prompts("mt_bench", 1) + bench_prompts("humaneval", 1)


@pytest.fixture(scope="module")
def plain(taps_hs):
    out = {}
    for p in PROMPTS:
        taps_hs.reset()
        out[p] = taps_hs.chat([{"role": "user", "content": p}], max_new_tokens=40, draft_len=0).tokens
    return out


@pytest.mark.parametrize("mode", ["chain", "tree", "auto"])
def test_taps_draft_output_equals_plain(taps_hs, plain, mode):
    from hetero_spec.config import TreeSpec

    assert taps_hs.target.feature_size == 3 * taps_hs.target.n_embd
    kw = {"chain": dict(draft_len=3), "tree": dict(draft_len=4, tree=TreeSpec(total_tokens=8, depth=4)),
          "auto": dict(draft_len="auto")}[mode]
    for p in PROMPTS:
        taps_hs.reset()
        out = taps_hs.chat([{"role": "user", "content": p}], max_new_tokens=40, **kw)
        assert out.tokens == plain[p], f"{mode} diverged on {p[:40]!r}"
        if mode != "auto":
            assert any(r.drafted for r in out.stats.rounds)
