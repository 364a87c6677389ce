"""Generate answers for many prompts at once: several llama.cpp sequences share each llama_batch.

WHY: one token of one sequence leaves a 2-core CPU mostly waiting on memory; decoding one
token for each of N sequences in the same batch reads the weights once for N rows, so
self-distillation data (``export-features --regenerate``) comes out several times faster.

Continuous batching: each slot holds one prompt; a step decodes either the next prompt chunk
of one slot still prefilling or one token of every slot that is generating, at most
``max_rows`` rows (32 keeps llama.cpp on its batch-invariant kernels).  A finished slot
takes the next prompt.  Sampling uses a per-prompt RNG, so results do not depend on
which prompts happened to share a batch.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Sequence

import numpy as np

from ..config import DEFAULT_KV_TYPE
from ..errors import TargetError
from . import _ffi
from ._ffi import C, BatchHandle, ContextHandle, ModelHandle, Owners


@dataclass(frozen=True)
class GenerateOptions:
    n_seq: int = 8  # sequences decoded together
    max_new_tokens: int = 256
    seq_ctx: int = 2048  # KV cells per sequence (prompt + answer)
    temperature: float = 0.0  # 0 = greedy
    seed: int = 0
    max_rows: int = 32  # rows per llama_decode
    n_threads: int = 0
    hidden: bool = False  # also return every row's final-norm hidden state (embeddings on)
    kv_type: str = DEFAULT_KV_TYPE  # as LlamaTarget's, so that regenerated answers equal its greedy ones


@dataclass
class _Slot:
    key: int  # caller's id for the prompt
    prompt: list[int]
    rng: np.random.Generator | None
    fed: int = 0  # prompt tokens already decoded
    out: list[int] = field(default_factory=list)
    pending: int | None = None  # sampled token not yet decoded
    final: bool = False  # answer complete; its last token is decoded once more for its hidden state
    hidden: list = field(default_factory=list)  # [n_embd] float32 rows, in position order

    @property
    def n_past(self) -> int:
        return self.fed + len(self.out) - (1 if self.pending is not None else 0)


class BatchGenerator(Owners):
    """Owns a model and a multi-sequence context; ``generate`` streams (key, answer ids)."""

    def __init__(self, path: str | Path, options: GenerateOptions = GenerateOptions()) -> None:
        from .llama_target import default_threads, kv_type_id

        self.options = options
        self._model = ModelHandle(Path(path))
        try:
            self.n_vocab = C.llama_vocab_n_tokens(self._model.vocab)
            self._ctx = ContextHandle(self._model, n_ctx=options.seq_ctx * options.n_seq, n_batch=options.max_rows,
                                      n_threads=options.n_threads or default_threads(), embeddings=options.hidden,
                                      n_seq_max=options.n_seq, kv_type=kv_type_id(options.kv_type, self._model))
            self.n_embd = C.llama_model_n_embd(self._model.ptr)
            self._batch = BatchHandle(options.max_rows, n_seq_max=1)
        except BaseException:
            self.close()
            raise

    def generate(self, prompts: Sequence[tuple[int, list[int]]],
                 on_tokens: Callable[[int], None] | None = None
                 ) -> Iterator[tuple[int, list[int], np.ndarray | None]]:
        """prompts: (key, ids) pairs; yields (key, answer ids, hidden) as each finishes (EOG token included).

        ``hidden`` is ``[len(ids) + len(answer), n_embd] float32`` with ``options.hidden``, else None.

        ``on_tokens(n)`` is called after every decode with the rows it processed (for progress bars).
        """
        o = self.options
        for key, ids in prompts:
            if not ids or len(ids) + o.max_new_tokens > o.seq_ctx:
                raise TargetError(f"prompt {key} of {len(ids)} tokens does not fit seq_ctx={o.seq_ctx}")
        queue = list(prompts)[::-1]
        slots: list[_Slot | None] = [None] * o.n_seq
        while True:
            for s in range(o.n_seq):
                if slots[s] is None and queue:
                    key, ids = queue.pop()
                    rng = np.random.default_rng([o.seed, key]) if o.temperature > 0 else None
                    C.llama_memory_seq_rm(self._ctx.memory, s, -1, -1)
                    slots[s] = _Slot(key, list(ids), rng)
            if all(x is None for x in slots):
                return
            rows = self._fill_batch(slots)
            _ffi.check_decode(C.llama_decode(self._ctx.ptr, self._batch.raw))
            if on_tokens is not None:
                on_tokens(len(rows))
            every_row = o.hidden  # with embeddings on, llama.cpp outputs every row
            n_out = len(rows) if every_row else sum(1 for _, wants in rows if wants)
            logits = np.ctypeslib.as_array(C.llama_get_logits(self._ctx.ptr), shape=(n_out, self.n_vocab))
            if every_row:
                hidden = np.ctypeslib.as_array(C.llama_get_embeddings(self._ctx.ptr), shape=(n_out, self.n_embd))
                for r, (s, _) in enumerate(rows):
                    slots[s].hidden.append(hidden[r].copy())
            j = 0
            for r, (s, wants) in enumerate(rows):
                slot = slots[s]
                if slot is None:
                    continue
                if slot.final:  # its last token's row is decoded now: done
                    yield slot.key, slot.out, np.stack(slot.hidden)
                    slots[s] = None
                    continue
                if not wants:
                    continue
                tok = self._sample(logits[r if every_row else j], slot.rng)
                j += 1
                slot.out.append(tok)
                slot.pending = tok
                if self.is_eog(tok) or len(slot.out) >= o.max_new_tokens:
                    if o.hidden:
                        slot.final = True
                    else:
                        yield slot.key, slot.out, None
                        slots[s] = None

    def _fill_batch(self, slots: list[_Slot | None]) -> list[tuple[int, bool]]:
        """One prompt chunk of one slot if any slot is still prefilling, else one row per generating
        slot; returns (slot, wants logits) per row.

        Never both in one decode: without a unified KV cache llama.cpp cuts a batch into
        micro-batches holding the same number of tokens of every sequence in them
        (``split_equal``), so a prompt chunk beside generating rows turned every step into
        several graph runs and N sequences decoded no faster than one."""
        b, cap = self._batch, self.options.max_rows
        rows: list[tuple[int, bool]] = []

        def add(s: int, tok: int, pos: int, wants: bool) -> None:
            i = len(rows)
            b.token[i], b.pos[i], b.output[i] = tok, pos, int(wants)
            b.seq_ids[i][0] = s
            b.n_seq_id[i] = 1
            rows.append((s, wants))

        prefilling = [s for s, slot in enumerate(slots) if slot is not None and slot.fed < len(slot.prompt)]
        if prefilling:
            s = prefilling[0]
            slot = slots[s]
            take = min(cap, len(slot.prompt) - slot.fed)
            for k in range(take):
                pos = slot.fed + k
                add(s, slot.prompt[pos], pos, pos == len(slot.prompt) - 1)
            slot.fed += take
        else:
            for s, slot in enumerate(slots):
                if slot is not None and slot.pending is not None and len(rows) < cap:
                    add(s, slot.pending, slot.n_past, True)
                    slot.pending = None
        b.raw.n_tokens = len(rows)
        return rows

    def _sample(self, logits: np.ndarray, rng: np.random.Generator | None) -> int:
        if rng is None:
            return int(np.argmax(logits))
        z = logits.astype(np.float64) / self.options.temperature
        p = np.exp(z - z.max())
        return int(rng.choice(len(p), p=p / p.sum()))
