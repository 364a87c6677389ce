"""Several llama.cpp sequences in one context: the target side of the batched engine (``hetero_spec/engine``).

WHY one context with a sequence per slot: a ``llama_decode`` reads the weights once for every row
it holds, whichever sequence a row belongs to, so N users' next tokens cost about one user's on a
bandwidth-bound CPU.  Each sequence has its own bounded KV memory (``seq_ctx`` cells).

Exactness: a row's logits here must equal those of the same tokens decoded alone in
``LlamaTarget`` (one sequence), bit for bit, or a greedy answer would depend on who else is
being served.  What makes that hold (tested in ``tests/integration/test_engine.py``):

- at most ``BATCH_INVARIANT_ROWS`` rows per decode (llama.cpp's matmul kernels change above);
- quantized KV cells (q8_0): F16 cells let the CPU flash attention split a one-row decode
  across threads, a different summation order;
- a KV stream per sequence (``kv_unified=False``, the default): a sequence's cells then sit in
  position order in its own stream, whatever the other sequences did.  Measured: one unified cache
  is exact while no sequence is reused, and drifts by up to 0.94 once a cleared sequence's cells are
  refilled (llama.cpp then puts newer tokens in cells before older ones; attention sums in cell order).

Speed with a stream per sequence: llama.cpp cuts a decode into micro-batches with ``split_equal``,
which takes the same number of rows from each sequence, and only from sequences whose ids follow
each other in batch order (``llama_batch_allocr::split_equal``, "accept only increasing sequence
ids").  Rows of sequences 1, 0, 2, 3 cost two passes over the weights (25.3 ms on SmolLM2 Q4_0,
2 threads, against 14.1 ms for 0, 1, 2, 3), and 3, 2, 1, 0 four (36.2 ms).  So the engine sorts its
rows by sequence, gives every sequence in the span the same number of rows, and pads a gap with
rows it removes afterwards (``engine/scheduler.py``).
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..config import DEFAULT_KV_TYPE, TargetFingerprint
from ..errors import TargetError
from . import _ffi
from ._ffi import C, BatchHandle, ContextHandle, ModelHandle, Owners
from .llama_target import (BATCH_INVARIANT_ROWS, default_threads, enable_taps, kv_type_id, model_fingerprint,
                           read_taps)
from .vocabulary import Vocabulary


@dataclass(frozen=True)
class SequenceOptions:
    n_seq: int = 4  # sequences (server slots) in the context
    seq_ctx: int = 4096  # KV cells each sequence may hold: prompt + answer
    n_threads: int = 0  # 0 = every core
    kv_type: str = DEFAULT_KV_TYPE
    kv_unified: bool = False  # one KV stream shared by all sequences (see the module docstring)
    max_rows: int = BATCH_INVARIANT_ROWS  # rows per micro-batch (llama.cpp's n_ubatch): the exactness bound
    capacity: int = 0  # rows per llama_decode call, cut into micro-batches by llama.cpp; 0: 16 per sequence + max_rows
    # per-row features for a draft model (``features``): the final-norm hidden state, or with ``taps`` the
    # inputs of those blocks (EAGLE-3), as ``LlamaTarget`` hands them to a draft
    features: bool = False
    taps: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.n_seq < 1 or self.seq_ctx < 16 or not 1 <= self.max_rows <= BATCH_INVARIANT_ROWS:
            raise TargetError(f"need n_seq >= 1, seq_ctx >= 16 and 1 <= max_rows <= {BATCH_INVARIANT_ROWS}, "
                              f"not {self.n_seq}, {self.seq_ctx}, {self.max_rows}")
        if self.capacity < 0:
            raise TargetError(f"capacity must be >= 0, not {self.capacity}")

    @property
    def batch_rows(self) -> int:
        """Rows one ``decode`` takes."""
        return self.capacity or 16 * self.n_seq + self.max_rows


@dataclass(frozen=True)
class Row:
    """One row of a decode: ``token`` at ``pos`` in sequence ``seq``; ``output``: return its logits."""

    seq: int
    token: int
    pos: int
    output: bool


def sequence_parts(rows: list[Row], max_seqs: int) -> list[list[Row]]:
    """``rows`` cut, in order, into runs holding rows of at most ``max_seqs`` sequences each."""
    parts: list[list[Row]] = []
    seqs: set[int] = set()
    for r in rows:
        if not parts or (r.seq not in seqs and len(seqs) >= max_seqs):
            parts.append([])
            seqs = set()
        parts[-1].append(r)
        seqs.add(r.seq)
    return parts


class SequenceTarget(Vocabulary, Owners):
    """A GGUF model and one context holding ``n_seq`` sequences; ``decode`` runs one batch of rows.

    >>> with SequenceTarget("SmolLM2.gguf", SequenceOptions(n_seq=2)) as t:
    ...     logits = t.decode([Row(0, 1, 0, True), Row(1, 1, 0, True)])   # [2, n_vocab] float32 view
    """

    def __init__(self, path: str | Path, options: SequenceOptions = SequenceOptions()) -> None:
        self.path = Path(path)
        self.options = options
        self._model = ModelHandle(self.path)
        # Final-norm features need llama.cpp's embeddings, and with them it computes every row's logits too (the
        # LM head on prompt rows included).  A draft's taps need neither: llama.cpp keeps each tapped block's
        # input for every row of a decode whatever its outputs, so only the rows asked for pay the LM head.
        self._every_row = options.features and not options.taps
        try:
            self.n_vocab = C.llama_vocab_n_tokens(self._model.vocab)
            self.n_threads = options.n_threads or default_threads()
            self.architecture = self._model.meta("general.architecture") or "unknown"
            self.n_embd = C.llama_model_n_embd(self._model.ptr)
            self._ctx = ContextHandle(self._model, n_ctx=options.seq_ctx * options.n_seq, n_batch=options.batch_rows,
                                      n_ubatch=options.max_rows,
                                      n_threads=self.n_threads, embeddings=self._every_row, n_seq_max=options.n_seq,
                                      kv_unified=options.kv_unified, flash_attn=-1,
                                      kv_type=kv_type_id(options.kv_type, self._model))
            self._batch = BatchHandle(options.batch_rows, n_seq_max=1)
            self._taps = enable_taps(self._model, self._ctx.ptr, options.taps) if options.features else None
        except BaseException:
            self.close()
            raise
        self.seq_ctx = options.seq_ctx
        self.n_ctx = options.seq_ctx  # what one request may use, as LlamaTarget.n_ctx
        self.feature_size = self.n_embd * len(options.taps) if options.taps else self.n_embd
        self._fingerprint: TargetFingerprint | None = None
        self._n_rows = 0  # with features: how many rows the last decode had
        self._part_features: np.ndarray | None = None  # the last decode's features, when it ran in parts

    @property
    def fingerprint(self) -> TargetFingerprint:
        if self._fingerprint is None:
            self._fingerprint = model_fingerprint(self._model, self.architecture, self.n_embd, self.n_vocab)
        return self._fingerprint

    def features(self) -> np.ndarray:
        """The last decode's features of every row, output or not, in row order: ``[n_rows, feature_size]``
        float32 (a copy); only with ``SequenceOptions.features``."""
        if not self.options.features:
            raise TargetError("this SequenceTarget was opened without features")
        if self._part_features is not None:  # a decode made in parts
            return self._part_features.copy()
        n = self._n_rows
        if self._taps is None:
            return np.ctypeslib.as_array(C.llama_get_embeddings(self._ctx.ptr), shape=(n, self.n_embd)).copy()
        return read_taps(self._taps, self._ctx.ptr, self.options.taps, n, self.n_embd)

    def decode(self, rows: list[Row]) -> np.ndarray:
        """One ``llama_decode`` of ``rows`` (at most ``batch_rows``; llama.cpp cuts it into micro-batches of at
        most ``max_rows``); the logits of the rows marked ``output``, in row order: ``[n_output, n_vocab]
        float32``, a view valid until the next decode (a copy with final-norm features, or when split).

        WHY split: llama.cpp's ``split_equal`` stops adding sequences to a micro-batch only once it holds more
        than ``n_ubatch`` of them, so rows from more than ``max_rows`` sequences would share a micro-batch of
        ``max_rows + 1`` rows, past the bound of a file exact only to ``max_rows`` rows (a repacked Q4_K_M:
        3; measured on Gemma 3's: logits 1.7 away with 4 slots).  Such a decode runs as one call per
        ``max_rows`` sequences (``sequence_parts``)."""
        if not 0 < len(rows) <= self._batch.capacity:
            raise TargetError(f"a decode takes 1..{self._batch.capacity} rows, not {len(rows)}")
        o = self.options
        parts = [rows] if o.n_seq <= o.max_rows else sequence_parts(rows, o.max_rows)
        self._part_features = None
        if len(parts) == 1:
            return self._decode_call(rows)
        logits, features = [], []
        for part in parts:
            logits.append(np.array(self._decode_call(part)))  # a copy: the next call overwrites llama.cpp's
            if self.options.features:
                features.append(self.features())
        self._n_rows = len(rows)
        if features:
            self._part_features = np.concatenate(features)
        return np.concatenate(logits)

    def _decode_call(self, rows: list[Row]) -> np.ndarray:
        """``decode`` in one ``llama_decode`` call."""
        n = len(rows)
        b = self._batch
        ctx = self._ctx.ptr  # raises once closed, before the batch's freed arrays are written
        every = self._every_row  # with embeddings on, llama.cpp outputs every row whatever the flags say
        for i, r in enumerate(rows):
            if not 0 <= r.pos < self.seq_ctx:
                raise TargetError(f"position {r.pos} is outside sequence {r.seq}'s {self.seq_ctx} cells")
            b.token[i], b.pos[i], b.output[i] = r.token, r.pos, int(r.output or every)
            b.seq_ids[i][0] = r.seq
        b.n_seq_id[:n] = 1
        b.raw.n_tokens = n
        _ffi.check_decode(C.llama_decode(ctx, b.raw))
        self._n_rows = n
        if every:  # every row came out: keep the asked-for ones (a copy)
            return np.ctypeslib.as_array(C.llama_get_logits(self._ctx.ptr), shape=(n, self.n_vocab))[
                [i for i, r in enumerate(rows) if r.output]]
        n_out = sum(1 for r in rows if r.output)
        if not n_out:
            return np.empty((0, self.n_vocab), dtype=np.float32)
        return np.ctypeslib.as_array(C.llama_get_logits(self._ctx.ptr), shape=(n_out, self.n_vocab))

    def clear(self, seq: int) -> None:
        """Sequence ``seq`` holds nothing afterwards (a slot handed to the next request)."""
        if not C.llama_memory_seq_rm(self._ctx.memory, seq, -1, -1):
            raise TargetError(f"llama_memory_seq_rm refused to clear sequence {seq}")

    def keep(self, seq: int, n_keep: int) -> None:
        """Drop sequence ``seq``'s cells at positions >= ``n_keep`` (rejected drafts, a shorter prefix)."""
        if not C.llama_memory_seq_rm(self._ctx.memory, seq, n_keep, -1):
            raise TargetError(f"llama_memory_seq_rm refused to drop positions >= {n_keep} of sequence {seq}")

    def save_cells(self, seq: int) -> bytes:
        """Sequence ``seq``'s cells serialized (``llama_state_seq_get_data``): what ``restore_cells`` puts back."""
        size = C.llama_state_seq_get_size(self._ctx.ptr, seq)
        buf = (ctypes.c_uint8 * size)()
        written = C.llama_state_seq_get_data(self._ctx.ptr, buf, size, seq)
        if written == 0:
            raise TargetError(f"llama_state_seq_get_data wrote nothing for sequence {seq}")
        return bytes(memoryview(buf)[:written])

    def restore_cells(self, seq: int, state: bytes) -> None:
        """Replace sequence ``seq``'s cells by ``state`` from ``save_cells`` (of any sequence of this context)."""
        buf = (ctypes.c_uint8 * len(state)).from_buffer_copy(state)
        if C.llama_state_seq_set_data(self._ctx.ptr, buf, len(state), seq) == 0:
            self.clear(seq)
            raise TargetError(f"llama_state_seq_set_data could not restore {len(state)} bytes into sequence {seq}")

    def pos_max(self, seq: int) -> int:
        """Largest position sequence ``seq`` holds in llama.cpp (-1 when empty): the truth to assert against."""
        return C.llama_memory_seq_pos_max(self._ctx.memory, seq)
