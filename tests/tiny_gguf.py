"""Builds tiny llama-architecture GGUFs for tests: the real tokenizer, random f32 weights.

Used where the shipped model cannot serve: a GGUF that is an embedding model rather than a
decoder LM, or a target small enough to copy around.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGUFReader, GGUFValueType, GGUFWriter

TOKENIZER_KEYS = ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
                  "tokenizer.ggml.merges", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
                  "tokenizer.ggml.add_bos_token", "tokenizer.chat_template")


def write_tiny_llama(source: Path, out: Path, *, n_embd: int = 64, n_layer: int = 2, n_head: int = 4,
                     n_ff: int = 128, extra: dict | None = None, seed: int = 0) -> Path:
    reader = GGUFReader(source)
    vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    w = GGUFWriter(str(out), "llama")
    w.add_context_length(512)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    for key in TOKENIZER_KEYS:
        f = reader.fields.get(key)
        if f is None:
            continue
        value = f.contents()
        vtype = f.types[0]
        sub = f.types[1] if vtype == GGUFValueType.ARRAY else None
        w.add_key_value(key, value, vtype, sub_type=sub)
    for key, value in (extra or {}).items():
        w.add_uint32(key, value) if isinstance(value, int) and not isinstance(value, bool) else w.add_bool(key, value)
    rng = np.random.default_rng(seed)

    def t(name: str, *shape: int, scale: float = 0.05) -> None:
        w.add_tensor(name, (rng.standard_normal(shape) * scale).astype(np.float32))

    t("token_embd.weight", vocab, n_embd, scale=0.5)
    w.add_tensor("output_norm.weight", np.ones(n_embd, dtype=np.float32))
    for i in range(n_layer):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(n_embd, dtype=np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(n_embd, dtype=np.float32))
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
            t(f"blk.{i}.{name}.weight", n_embd, n_embd)
        t(f"blk.{i}.ffn_gate.weight", n_ff, n_embd)
        t(f"blk.{i}.ffn_up.weight", n_ff, n_embd)
        t(f"blk.{i}.ffn_down.weight", n_embd, n_ff)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
