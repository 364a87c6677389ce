"""A draft block initialised from the target's own last block computes what llama.cpp computes there."""
from __future__ import annotations

import torch

from hetero_spec.config import DraftConfig
from hetero_spec.draft.model import DraftBlock, rope_tables
from hetero_spec.target.gguf_weights import load_block
from hetero_spec.target.layer_taps import LayerTapTarget
from hetero_spec.train.loop import copy_block


def test_target_block_in_a_draft_block_reproduces_llama_cpp(model_path):
    """Rows through the copied block (rotate-half RoPE after un-permuting GGUF's Q/K) land within a few
    percent of llama.cpp's output of block 29 (its activations are quantized to 8 bits); the GGUF's
    permuted Q/K used as they are would land about four times further off."""
    ids = list(range(1000, 1040))
    with LayerTapTarget(model_path, (28, 29), n_threads=1) as lt:
        _, outs = lt.run(ids)
    cfg = DraftConfig(n_embd=576, n_vocab=49152, hidden_size=576, n_heads=9, n_kv_heads=3, ffn_size=1536)
    blk = DraftBlock(cfg)
    copy_block(blk, load_block(model_path, 29))
    cos, sin = rope_tables(cfg)
    x = torch.from_numpy(outs[28])[None]
    T = x.shape[1]
    with torch.no_grad():
        q, k, v, _ = blk.project(x, cos[:T], sin[:T])
        causal = torch.full((T, T), float("-inf")).triu(1)[None, None]
        y = blk.finish(x, q, k, v, causal)[0]
    ref = torch.from_numpy(outs[29])
    assert float((y - ref).norm() / ref.norm()) < 0.02
