"""The reference point for speed: the simplest greedy loop on llama.cpp's low-level API.

No hidden states, no bookkeeping: ``llama_batch_get_one`` and ``llama_get_logits_ith``.
Benchmarks hold hetero-spec's plain path and its speculative path against this loop.
"""
from __future__ import annotations

import time

import numpy as np

from . import _ffi
from ._ffi import C, ContextHandle, ModelHandle


class RawGreedy:
    """``ctx``: run on an existing context (embeddings off) instead of a new one; the caller owns it."""

    def __init__(self, model: ModelHandle, *, n_ctx: int, n_threads: int, n_batch: int = 32,
                 kv_type: int | None = None, ctx: ContextHandle | None = None) -> None:
        self._owns_ctx = ctx is None
        self.ctx = ctx or ContextHandle(model, n_ctx=n_ctx, n_batch=n_batch, n_threads=n_threads, embeddings=False,
                                        kv_type=kv_type)
        self.n_vocab = C.llama_vocab_n_tokens(model.vocab)
        self.vocab = model.vocab
        self.n_batch = n_batch
        self.last_prefill_s = 0.0  # wall time of the last prompt's decode plus its first token

    def close(self) -> None:
        if self._owns_ctx:
            self.ctx.close()

    def _decode(self, tokens: list[int]) -> None:
        arr = (C.llama_token * len(tokens))(*tokens)
        _ffi.check_decode(C.llama_decode(self.ctx.ptr, C.llama_batch_get_one(arr, len(tokens))))

    def generate(self, prompt: list[int], max_new_tokens: int) -> list[int]:
        """Greedy ids after ``prompt`` (a final end-of-generation id included), from an empty cache."""
        t0 = time.perf_counter()
        C.llama_memory_clear(self.ctx.memory, True)
        for i in range(0, len(prompt), self.n_batch):
            self._decode(prompt[i : i + self.n_batch])
        out: list[int] = []
        while True:
            logits = np.ctypeslib.as_array(C.llama_get_logits_ith(self.ctx.ptr, -1), shape=(self.n_vocab,))
            tok = int(logits.argmax())
            out.append(tok)
            if len(out) == 1:
                self.last_prefill_s = time.perf_counter() - t0
            if len(out) >= max_new_tokens or C.llama_vocab_is_eog(self.vocab, tok):
                return out
            self._decode([tok])
