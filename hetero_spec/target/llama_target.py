"""The verifying model: a GGUF decoder on the CPU through llama.cpp's low-level API.

With ``embeddings=True`` and pooling NONE, one ``llama_decode`` returns, for every row,
both the logits and the final-norm hidden state (the LM head's input), which is exactly
the feature the draft consumes.  llama.cpp then makes every row an output, so a
verification of k+1 tokens pays the LM head k+1 times; plain decoding switches
embeddings off and asks for the last row only.
"""
from __future__ import annotations

import ctypes
import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from ..config import DEFAULT_KV_TYPE, KV_TYPES, TargetFingerprint, usable_cpu_set
from . import _ffi
from ..errors import ContextFull, TargetError
from ._ffi import C, BatchHandle, ContextHandle, ModelHandle, Owners
from .vocabulary import Vocabulary


def default_threads() -> int:
    """llama.cpp threads when none are asked for: the physical cores this process may use, as llama.cpp's own
    default is.

    WHY not every logical CPU: a decode is bound by memory bandwidth, so a core's SMT sibling adds no bandwidth
    and its thread, spinning at each barrier, delays the others (a laptop's 8 cores and 16 threads); and a
    container's CPU quota (``docker --cpus 2`` on a 64-core host) throttles 64 spinning threads to 2 CPUs'
    time.  Cores are counted over the affinity mask from the kernel's topology (one entry per set of SMT
    siblings); joblib's count applies the cgroup quota (v1 and v2).
    """
    import joblib

    return max(1, min(physical_cores(), joblib.cpu_count()))


def physical_cores(cpus: set[int] | None = None) -> int:
    """Distinct cores among ``cpus`` (default: the affinity mask), from ``/sys``; the CPUs' count where the
    kernel does not say."""
    cores = set()
    for cpu in usable_cpu_set() if cpus is None else cpus:
        try:
            cores.add(Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list").read_text().strip())
        except OSError:
            cores.add(str(cpu))
    return max(1, len(cores))


# llama.cpp's CPU backend switches to different matmul kernels at 64 rows a micro-batch
# (measured on SmolLM2 Q4_1: logits of the same tokens then differ by up to 0.7).  Below
# that, a token's KV cells and logits are bit-identical whatever the batch around them,
# so prefix reuse equals a fresh prefill and a k+1-row verification equals k+1
# single-token decodes.  Chunking the prefill at 32 costs about 12% of prefill speed.
BATCH_INVARIANT_ROWS = 32
TREE_SEQ_MAX = 32  # leaves of a tree (at most 31 drafted nodes) + spare


@dataclass(frozen=True)
class TargetOptions:
    n_ctx: int = 4096
    n_batch: int = BATCH_INVARIANT_ROWS
    n_threads: int = 0  # 0 = all physical cores
    embeddings: bool = True  # needed to feed a draft; plain decoding turns it off
    # Tree verification gives every leaf its own sequence in one batch, which llama.cpp
    # accepts only over a unified KV cache (coupled sequences).  Measured: a chain over
    # this context decodes bit-identically to the single-sequence one.
    n_seq_max: int = TREE_SEQ_MAX
    kv_unified: bool = True
    flash_attn: int = -1  # llama_flash_attn_type: -1 auto (on for the CPU), 0 off, 1 on
    # KV cells beyond n_ctx for the rejected branches of trees (see ``keep_branch``).
    tree_spare_cells: int = 1024
    # KV cell type.  With llama.cpp's default F16 cells and 2+ threads, its CPU flash attention
    # splits a one-token decode over >256 cells across threads (the split-KV path) but never a
    # multi-row decode, so plain decoding and verification then differ in the last bits and
    # near-ties flip.  Quantized cells never take that path: with q8_0 (the default here, also
    # half the memory) verification is bit-identical to plain decoding at any length.
    kv_type: str = DEFAULT_KV_TYPE
    # Blocks whose input every decode also returns (EAGLE-3 taps, llama.cpp's layer-input API): the
    # features a draft with taps reads, concatenated per row, in place of the final-norm state.
    taps: tuple[int, ...] = ()


def enable_taps(model: ModelHandle, ctx_ptr, taps: tuple[int, ...]):
    """Ask llama.cpp to keep the input of blocks ``taps`` on every decode; returns the API that reads
    them back, or refuses clearly where this model or this libllama cannot."""
    if not taps:
        return None
    arch = model.meta("general.architecture") or "unknown"
    api = _ffi.layer_inputs()
    if api is None:
        raise TargetError("this libllama does not export llama_set_embeddings_layer_inp; drafts with taps need it")
    if arch not in _ffi.LAYER_INPUT_ARCHS:
        raise TargetError(f"llama.cpp does not record block inputs for {arch} models, so drafts with taps "
                          f"(EAGLE-3 fusion) cannot run on them; use a draft trained without taps")
    n_layer = C.llama_model_n_layer(model.ptr)
    bad = [i for i in taps if not 0 <= i < n_layer]
    if bad:
        raise TargetError(f"taps {bad} out of range: the model has blocks 0..{n_layer - 1}")
    for i in taps:
        api.set(ctx_ptr, i, True)
    return api


def read_taps(api, ctx_ptr, taps: tuple[int, ...], n: int, n_embd: int) -> np.ndarray:
    """The last decode's tapped block inputs, every row in batch order, concatenated per row:
    ``[n, len(taps) * n_embd]`` float32 (a copy)."""
    return np.concatenate([np.ctypeslib.as_array(api.get(ctx_ptr, i), shape=(n, n_embd)) for i in taps], axis=1)


def model_fingerprint(model: ModelHandle, architecture: str, n_embd: int, n_vocab: int) -> TargetFingerprint:
    """What a draft file must match: the architecture, the width, and a hash of every token's text."""
    h = hashlib.sha256()
    for t in range(n_vocab):
        h.update(C.llama_vocab_get_text(model.vocab, t))
        h.update(b"\0")
    return TargetFingerprint(architecture=architecture, n_embd=n_embd, n_vocab=n_vocab, tokenizer_sha256=h.hexdigest())


def kv_type_id(name: str, model=None) -> int:
    """The ggml type of KV cells ``name``; with ``model`` (a ModelHandle), F16 where the model's head
    size is not a multiple of the quantized block (32), since llama.cpp cannot make such a cache."""
    if name.lower() not in KV_TYPES:
        raise TargetError(f"unknown KV cache type {name!r} (use {', '.join(KV_TYPES)})")
    if model is not None and name.lower().startswith("q"):
        head = C.llama_model_n_embd(model.ptr) // max(1, C.llama_model_n_head(model.ptr))
        if head % 32:
            return C.GGML_TYPE_F16
    return getattr(C, f"GGML_TYPE_{name.upper()}")


class LlamaTarget(Vocabulary, Owners):
    """Prefill / verify / rollback over one llama.cpp sequence.

    >>> t = LlamaTarget("SmolLM2.gguf")
    >>> hidden, logits = t.prefill(t.tokenize("Hello"))   # [n, n_embd], [n_vocab]
    >>> logits, hidden = t.verify([42, 7, 9])              # views, valid until the next decode
    >>> t.rollback(t.n_past - 2)                           # drop the last two cells
    """

    def __init__(self, path: str | Path, options: TargetOptions = TargetOptions()) -> None:
        self.path = Path(path)
        self.options = options
        self._model = ModelHandle(self.path)
        self._ctx: ContextHandle | None = None
        self._batch: BatchHandle | None = None
        try:
            self.architecture = self._model.meta("general.architecture") or "unknown"
            if not self._is_decoder_lm():
                raise TargetError(
                    f"{self.path.name} ({self.architecture}) is not a decoder-only language model"
                )
            self.n_vocab = C.llama_vocab_n_tokens(self._model.vocab)
            self.n_embd = C.llama_model_n_embd(self._model.ptr)
            if self.n_vocab <= 0 or self.n_embd <= 0:
                raise TargetError(f"{self.path.name} has no vocabulary or embedding (not a language model)")
            self.n_ctx_train = C.llama_model_n_ctx_train(self._model.ptr)
            self.n_layer = C.llama_model_n_layer(self._model.ptr)
            n_threads = options.n_threads or default_threads()
            self._ctx = ContextHandle(
                self._model,
                n_ctx=options.n_ctx + options.tree_spare_cells,
                n_batch=options.n_batch,
                n_threads=n_threads,
                embeddings=options.embeddings,
                n_seq_max=options.n_seq_max,
                kv_unified=options.kv_unified,
                flash_attn=options.flash_attn,
                kv_type=kv_type_id(options.kv_type, self._model),
            )
            # llama.cpp may round the context up; the limit callers asked for is what we enforce
            self.n_ctx = min(options.n_ctx, C.llama_n_ctx(self._ctx.ptr))
            self.n_threads = n_threads
            self._batch = BatchHandle(options.n_batch, options.n_seq_max)
            self._taps = enable_taps(self._model, self._ctx.ptr, options.taps)
            # width of the per-row features handed to a draft
            self.feature_size = self.n_embd * len(options.taps) if options.taps else self.n_embd
        except BaseException:
            self.close()
            raise
        self.embeddings = options.embeddings
        self._one = (C.llama_token * 1)()  # the token of a one-row decode
        self.tokens: list[int] = []  # the token ids whose cells are in the KV cache, in order
        self.trash_cells = 0  # rejected tree cells parked in TRASH_SEQ
        # a tree decoded and its branch not kept yet: an exception in between (a Ctrl-C during acceptance) leaves
        # the prefix and the tree's cells in the leaf sequences, and the next prefill starts from a clear cache
        self._tree_open = False
        # NumPy views of llama.cpp's logits buffer per row count, kept while the buffer stays where it is
        # (llama.cpp moves it only when a decode needs more outputs than it holds): a new view per decode
        # cost five Python calls, about 10 us of a plain round on SmolLM2 Q4_0 after the decode.
        self._logits_at = 0
        self._logits_views: dict[int, np.ndarray] = {}
        self._fingerprint: TargetFingerprint | None = None

    @property
    def kernels(self) -> str:
        """Which llama.cpp weight buffers (so which matmul kernels) this model runs, and why (one line)."""
        return self._model.kernels

    def _is_decoder_lm(self) -> bool:
        """Encoder-decoders (T5) and embedding models (BERT-like: non-causal or pooled) cannot verify drafts."""
        m = self._model
        if not C.llama_model_has_decoder(m.ptr) or C.llama_model_has_encoder(m.ptr):
            return False
        arch = self.architecture
        if m.meta(f"{arch}.attention.causal") == "false" or m.meta(f"{arch}.pooling_type") not in (None, "0"):
            return False
        return True

    @property
    def fingerprint(self) -> TargetFingerprint:
        if self._fingerprint is None:
            self._fingerprint = model_fingerprint(self._model, self.architecture, self.n_embd, self.n_vocab)
        return self._fingerprint

    # ------------------------------------------------------------------- decoding
    @property
    def n_past(self) -> int:
        return len(self.tokens)

    def set_embeddings(self, on: bool) -> None:
        """Hidden states on (speculative) or off (plain decoding: last-row logits only)."""
        if on != self.embeddings:
            C.llama_set_embeddings(self._ctx.ptr, on)
            self.embeddings = on

    def prefill(self, tokens: list[int], max_reuse: int | None = None,
                hidden_from: int | None = None) -> tuple[np.ndarray | None, np.ndarray]:
        """Make the KV cache hold exactly ``tokens``, reusing a cached prefix.

        Returns the hidden states of the rows decoded now (``[n_new, n_embd] float32``,
        None with embeddings off; the first decoded position is ``len(tokens) - n_new``)
        and the logits of the last row (``[n_vocab] float32``).  The last shared token is
        decoded again, so a draft that must rebuild its cell there gets its feature;
        ``max_reuse`` caps the reuse where the draft's own cache is shorter.

        ``hidden_from``: the caller needs hidden states only from this position on.  Micro-batches
        ending before it are decoded with embeddings off, so only their last row pays the LM
        head (with pooling NONE every row of an embeddings batch does); their rows come back as
        zeros.  The KV cells and the last row's logits are the same either way (tested).  With taps
        every micro-batch is decoded so: llama.cpp keeps the tapped blocks' inputs of every row
        whatever the outputs, so the prompt's features cost no LM head at all.
        """
        if not tokens:
            raise TargetError("empty prompt")
        if len(tokens) > self.n_ctx:
            raise ContextFull(f"prompt of {len(tokens)} tokens exceeds the context of {self.n_ctx}")
        if self.trash_cells or self._tree_open:  # parked tree cells sit between cached ones: reuse would reorder
            self.reset()
        keep = max(0, min(common_prefix(self.tokens, tokens), len(tokens)) - 1)
        if max_reuse is not None:
            keep = min(keep, max_reuse)
        self.rollback(keep)
        hidden_parts: list[np.ndarray] = []
        logits = None
        step = self.options.n_batch
        wanted = self.embeddings
        tapped = self._taps is not None
        try:
            for start in range(keep, len(tokens), step):
                chunk = tokens[start : start + step]
                needed = wanted and (hidden_from is None or start + len(chunk) > hidden_from)
                self.set_embeddings(needed and not tapped)
                logits_rows, hidden_rows = self._decode(chunk)
                if wanted:
                    if not needed:
                        hidden_rows = np.zeros((len(chunk), self.feature_size), dtype=np.float32)
                    elif tapped:
                        hidden_rows = self._features(len(chunk))  # a copy
                    else:
                        hidden_rows = hidden_rows.copy()
                    hidden_parts.append(hidden_rows)
                logits = logits_rows[-1].copy()
        finally:
            self.set_embeddings(wanted)
        hidden = np.concatenate(hidden_parts) if hidden_parts else None
        return hidden, logits

    def verify(self, tokens: list[int] | np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """Decode ``tokens`` (the last accepted token then k drafts) in one call.

        Returns views into llama.cpp's buffers, valid until the next decode:
        logits ``[n, n_vocab] float32`` and hidden ``[n, n_embd] float32`` (None with
        embeddings off, in which case logits has only the last row).
        """
        if self.n_past + len(tokens) > self.n_ctx:
            raise ContextFull(f"context of {self.n_ctx} tokens is full")
        return self._decode(tokens)

    def rollback(self, n_keep: int) -> None:
        """Drop every cell at position >= n_keep (rejected drafts) by position, never by copying."""
        if n_keep >= self.n_past:
            return
        self._drop_cells_from(n_keep)
        del self.tokens[n_keep:]

    def _drop_cells_from(self, pos: int) -> None:
        """Sequence 0's cells at positions >= ``pos`` leave llama.cpp's cache."""
        if not C.llama_memory_seq_rm(self._ctx.memory, 0, pos, -1):
            raise TargetError(f"llama_memory_seq_rm refused to drop positions >= {pos}")

    def verify_tree(
        self, tokens: np.ndarray, depths: np.ndarray, seq_ids: list[list[int]]
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """Decode a whole draft tree in ONE ``llama_decode``.

        tokens [n] (row 0 = the last accepted token, the root), depths [n] (0 for the root),
        seq_ids[i]: the leaf sequences through node i.  Before the decode the cached prefix is
        shared into every leaf sequence (``seq_cp``: a tag on the cells, no copy), so each
        sequence is prefix + one root-to-leaf path and llama.cpp's per-sequence causal mask
        is the tree's ancestor mask.  Returns views like ``verify``; follow with
        ``keep_branch``.
        """
        n = len(tokens)
        b = self._batch
        n_seqs = 1 + max(max(ids) for ids in seq_ids)
        if n > b.capacity:
            raise TargetError(f"tree of {n} rows exceeds n_batch={b.capacity}")
        if n_seqs > self.trash_seq:
            raise TargetError(f"tree with {n_seqs} leaves exceeds n_seq_max - 1 = {self.trash_seq}")
        if self.n_past + n > self.n_ctx:
            raise ContextFull(f"context of {self.n_ctx} tokens is full")
        if not self.embeddings:
            raise TargetError("tree verification needs embeddings on (every row an output)")
        mem = self._ctx.memory
        if self.trash_cells + n > self.options.tree_spare_cells:
            # Out of spare cells: free the parked ones.  Later tokens then fill those holes
            # out of position order, so logits may drift from plain decoding in the last bits.
            C.llama_memory_seq_rm(mem, self.trash_seq, -1, -1)
            self.trash_cells = 0
        self._tree_open = True
        for s in range(1, n_seqs):
            C.llama_memory_seq_cp(mem, 0, s, -1, -1)
        start = self.n_past
        b.token[:n] = tokens
        b.pos[:n] = start + np.asarray(depths, dtype=np.int32)
        b.output[:n] = 1
        for i, ids in enumerate(seq_ids):
            b.seq_ids[i][: len(ids)] = ids
            b.n_seq_id[i] = len(ids)
        b.raw.n_tokens = n
        try:
            _ffi.check_decode(C.llama_decode(self._ctx.ptr, b.raw))
        finally:  # the chain path expects every row in sequence 0 alone
            for i in range(n):
                b.seq_ids[i][0] = 0
            b.n_seq_id[:n] = 1
        self._tree_seqs, self._tree_rows = n_seqs, n
        logits = self._logits(n)
        return logits, self._features(n)

    @property
    def trash_seq(self) -> int:
        return self.options.n_seq_max - 1

    def keep_branch(self, seq: int, path_tokens: list[int]) -> None:
        """Keep the accepted path of the last tree (root + accepted nodes) as sequence 0.

        ``seq`` is a leaf sequence through the last accepted node; ``path_tokens`` the tokens
        of root..last accepted node.  Memory API only, never a second decode.

        Rejected cells are not freed but parked in ``trash_seq``, which no row attends to.
        Freed cells would be holes that the next decode fills, putting newer tokens in
        slots before older ones; the CPU attention kernels sum over cells in slot order
        (flash attention in f16), so logits would then differ from plain decoding by up to
        1.5 (measured).  Parked cells keep every sequence in slot order = position order,
        and flash attention skips masked cells, so they cost little.
        """
        mem = self._ctx.memory
        n0 = self.n_past
        n_keep = n0 + len(path_tokens)
        n_seqs = self._tree_seqs
        if n_seqs == 1 and not self.trash_cells:
            # A chain over a cache without parked cells: the rejected rows are the newest cells,
            # so dropping them leaves no hole before a kept cell; this is the chain path's rollback.
            self._drop_cells_from(n_keep)
        else:
            self._park_rejected(mem, seq, n0, n_keep, n_seqs, len(path_tokens))
        self.tokens.extend(int(t) for t in path_tokens)
        if self.kv_pos_max() != n_keep - 1:
            raise TargetError(f"after keeping a branch the KV ends at {self.kv_pos_max()}, expected {n_keep - 1}")
        self._tree_open = False

    def _park_rejected(self, mem, seq: int, n0: int, n_keep: int, n_seqs: int, n_path: int) -> None:
        """Sequence 0 becomes the prefix plus leaf sequence ``seq`` up to ``n_keep``; every other tree
        cell moves to the trash sequence."""
        for s in range(n_seqs):  # every tree cell (and the prefix) also in the trash sequence
            C.llama_memory_seq_cp(mem, s, self.trash_seq, n0, -1)
        if seq != 0:
            C.llama_memory_seq_rm(mem, 0, n0, -1)
            C.llama_memory_seq_cp(mem, seq, 0, n0, n_keep)
        else:
            C.llama_memory_seq_rm(mem, 0, n_keep, -1)
        for s in range(1, n_seqs):
            C.llama_memory_seq_rm(mem, s, -1, -1)
        self.trash_cells += self._tree_rows - n_path

    def seq_pos_max(self, seq: int) -> int:
        return C.llama_memory_seq_pos_max(self._ctx.memory, seq)

    def kv_pos_max(self) -> int:
        """Largest position held by sequence 0 in llama.cpp (-1 when empty): the truth to assert against."""
        return C.llama_memory_seq_pos_max(self._ctx.memory, 0)

    def reset(self) -> None:
        C.llama_memory_clear(self._ctx.memory, True)
        self.tokens.clear()
        self.trash_cells = 0
        self._tree_open = False

    def _decode(self, tokens) -> tuple[np.ndarray, np.ndarray | None]:
        n = len(tokens)
        b = self._batch
        ctx = self._ctx.ptr  # raises once closed, before the batch's freed arrays are written
        if n > b.capacity:
            raise TargetError(f"batch of {n} tokens exceeds n_batch={b.capacity}")
        start = self.n_past
        try:
            if n == 1:
                # Plain decoding's one-token step through ``llama_batch_get_one`` (position and sequence 0
                # filled in by llama.cpp from the cache, which holds exactly ``self.tokens``): measured
                # 1% faster per token than the same decode through the explicit batch.
                self._one[0] = int(tokens[0])
                _ffi.check_decode(C.llama_decode(ctx, C.llama_batch_get_one(self._one, 1)))
            else:
                b.token[:n] = tokens
                b.pos[:n] = np.arange(start, start + n, dtype=np.int32)
                if self.embeddings:
                    b.output[:n] = 1  # llama.cpp makes every row an output when embeddings are on
                else:
                    b.output[:n] = 0
                    b.output[n - 1] = 1
                b.raw.n_tokens = n
                _ffi.check_decode(C.llama_decode(ctx, b.raw))
        except BaseException:
            # a failed decode, or a Ctrl-C that lands as llama_decode returns: the rows' cells may be in the
            # cache while ``self.tokens`` does not list them, and every later decode would be refused
            self._drop_cells_from(start)
            raise
        if n == 1:
            self.tokens.append(int(tokens[0]))
        else:
            self.tokens.extend(int(t) for t in tokens)
        if self.embeddings:
            return self._logits(n), self._features(n)
        return self._logits(1), None

    def _logits(self, n_out: int) -> np.ndarray:
        """The last decode's logits ``[n_out, n_vocab]``, a view valid until the next decode."""
        ptr = C.llama_get_logits(self._ctx.ptr)
        at = ctypes.addressof(ptr.contents)
        if at != self._logits_at:
            self._logits_at, self._logits_views = at, {}
        view = self._logits_views.get(n_out)
        if view is None:
            view = self._logits_views[n_out] = np.ctypeslib.as_array(ptr, shape=(n_out, self.n_vocab))
        return view

    def _features(self, n: int) -> np.ndarray:
        """The last decode's per-row features for a draft: the final-norm hidden state ``[n, n_embd]``
        (a view), or with taps the concatenated block inputs ``[n, len(taps) * n_embd]`` (a copy)."""
        if self._taps is None:
            return np.ctypeslib.as_array(C.llama_get_embeddings(self._ctx.ptr), shape=(n, self.n_embd))
        return read_taps(self._taps, self._ctx.ptr, self.options.taps, n, self.n_embd)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many first tokens ``a`` and ``b`` (lists, tuples or arrays of ids, in any mix) have in common, by
    bisection on tuple slices: the comparisons run in C, where a token-by-token loop ran in Python (the prompt
    cache compares a prompt with every saved entry)."""
    n = min(len(a), len(b))
    a, b = tuple(a[:n]), tuple(b[:n])
    if a == b:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo
