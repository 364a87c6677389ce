"""The child-process half of ``kernels.py``: load a tiny Q4_0 model and decode with it under the
kernel mode in ``$HETERO_SPEC_KERNELS``, then print the weight buffer types llama.cpp used as
one JSON line.  Where AMX tiles fault, this process dies instead of the caller.

The model is built here with gguf's writer (no file ships): one llama block whose matrices are
Q4_0 with 128 rows, the shape every extra buffer type accepts (AMX wants rows in multiples of
32, CPU_REPACK in multiples of 8), and no tokenizer (llama.cpp's ``none`` vocabulary).

    python -m hetero_spec.target.kernel_probe
"""
from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import numpy as np

N_EMBD, N_FF, N_VOCAB, N_HEAD = 128, 256, 256, 4
ROWS = (32, 1)  # a prefill-sized micro-batch, then one decode row: both kernel shapes


def write_probe_model(out: Path, seed: int = 0) -> Path:
    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.quants import quantize

    rng = np.random.default_rng(seed)
    w = GGUFWriter(str(out), "llama")
    w.add_context_length(64)
    w.add_embedding_length(N_EMBD)
    w.add_block_count(1)
    w.add_feed_forward_length(N_FF)
    w.add_head_count(N_HEAD)
    w.add_head_count_kv(N_HEAD)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(N_VOCAB)
    w.add_tokenizer_model("none")

    def q4_0(name: str, rows: int, cols: int) -> None:
        data = (rng.standard_normal((rows, cols)) * 0.05).astype(np.float32)
        q = quantize(data, GGMLQuantizationType.Q4_0)
        w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=GGMLQuantizationType.Q4_0)

    q4_0("token_embd.weight", N_VOCAB, N_EMBD)
    q4_0("output.weight", N_VOCAB, N_EMBD)
    w.add_tensor("output_norm.weight", np.ones(N_EMBD, dtype=np.float32))
    w.add_tensor("blk.0.attn_norm.weight", np.ones(N_EMBD, dtype=np.float32))
    w.add_tensor("blk.0.ffn_norm.weight", np.ones(N_EMBD, dtype=np.float32))
    for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
        q4_0(f"blk.0.{name}.weight", N_EMBD, N_EMBD)
    q4_0("blk.0.ffn_gate.weight", N_FF, N_EMBD)
    q4_0("blk.0.ffn_up.weight", N_FF, N_EMBD)
    q4_0("blk.0.ffn_down.weight", N_EMBD, N_FF)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def decode_probe_model(path: Path) -> dict[str, float]:
    """Decode ROWS through the model; returns its weight buffers ``{type: MiB}``."""
    from . import _ffi

    model = _ffi.ModelHandle(path)
    ctx = _ffi.ContextHandle(model, n_ctx=64, n_batch=32, n_threads=1, embeddings=False)
    batch = _ffi.BatchHandle(32)
    try:
        pos = 0
        for n in ROWS:
            batch.token[:n] = np.arange(n) % N_VOCAB
            batch.pos[:n] = np.arange(pos, pos + n)
            batch.output[:n] = 0
            batch.output[n - 1] = 1
            batch.raw.n_tokens = n
            _ffi.check_decode(_ffi.C.llama_decode(ctx.ptr, batch.raw))
            pos += n
        return dict(model.weight_buffers)
    finally:
        batch.close()
        ctx.close()
        model.close()


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="hetero-spec-kernel-probe-") as tmp:
        buffers = decode_probe_model(write_probe_model(Path(tmp) / "probe.gguf"))
    print(json.dumps({"buffer_types": sorted(buffers)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
