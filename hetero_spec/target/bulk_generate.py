"""Bulk greedy generation for training corpora: many conversations per ``llama_decode`` over a unified KV cache.

WHY a second generator beside the batched engine (``engine/answers.py``, ``export-features
--regenerate``): the engine keeps every sequence in its own KV stream so that its rows are
bit-identical to ``LlamaTarget`` (tests check it), and llama.cpp then cuts a decode into
micro-batches holding the same number of tokens of each sequence (``split_equal``), at most 32
rows, so only a prompt chunk's first rows ride along with generating rows.  Training data does not need bit-identity: the draft learns from these tokens and
nothing is ever verified against them.  Here all sequences share one unified cache, so
one decode carries one generating row of every busy slot *plus* prompt chunks of slots
still prefilling, up to ``max_rows`` rows, and the weights are read once for all of them.
The outputs can differ from single-sequence decoding in the last bits of the logits (a
different kernel tiling), which can flip a near-tie; that is the whole difference.

Conversations may have several turns: when a turn ends with an end-of-generation token,
``continue_with(key, ids)`` may return the next user turn (already rendered, starting with
that end-of-generation token's id) and the slot carries on from its cached cells.

``stop_loops``: a small target decoding greedily falls into repetition loops and seldom leaves them (in
SmolLM2-135M's answers to 819 ShareGPT conversations, 40% of the generated tokens were loop tails past 32
tokens, and 39 of those 40 points came after the last token of their turn that training scores).
Training keeps the loss on a loop's first ``--loop-keep`` tokens only (``train/loops.py``), so a turn
ends before the first token past that many in a row that each repeat an earlier 8-gram of the
conversation, where training would stop scoring it: the rows after it would be decoded only to be
thrown away, and the slot takes the next conversation instead.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Sequence

import numpy as np

from ..errors import TargetError
from . import _ffi
from ._ffi import C, BatchHandle, ContextHandle, ModelHandle, Owners


LOOP_NGRAM = 8  # as train/loops.py: a token repeats when the 8-gram it ends occurred before


@dataclass(frozen=True)
class BulkOptions:
    n_seq: int = 32  # conversations in flight
    max_new_tokens: int = 256  # per assistant turn
    seq_ctx: int = 2048  # most cells one conversation may hold
    max_rows: int = 256  # rows per llama_decode
    n_threads: int = 0
    kv_type: str = "f16"
    unified: bool = False
    hidden: bool = False  # keep every decoded row's final-norm hidden state (every row becomes an output)
    taps: tuple[int, ...] = ()  # also keep the input of these blocks (llama.cpp's layer-input API)
    stop_loops: int = 0  # end a turn before a token past this many in a row that repeat an earlier n-gram; 0: never


@dataclass
class BulkResult:
    key: int
    ids: list[int]  # the whole conversation: prompts and answers
    mask: list[int]  # 1 on generated tokens up to and including each turn's end-of-generation token
    turns: int  # assistant turns generated
    truncated: bool  # the last turn stopped at max_new_tokens or in a loop (no end-of-generation token)
    # "hidden" and "layer_<i>": [len(ids), n_embd] float16 per decoded row; the last token, sampled
    # but never decoded, has a zero row (no training target reads it; a turn stopped in a loop has none)
    features: dict[str, np.ndarray] = field(default_factory=dict)
    looped: bool = False  # the last turn stopped in a repetition loop (``BulkOptions.stop_loops``)


@dataclass
class _Slot:
    key: int
    ids: list[int]
    mask: list[int]
    fed: int = 0  # tokens whose cells are in the cache
    answer: int = 0  # tokens generated in the current turn
    turns: int = 0
    pending: bool = False  # ids[-1] was sampled and is not yet decoded
    done: bool = False
    truncated: bool = False
    rows: list[int] = field(default_factory=list)  # batch rows of this slot in the current decode
    decoded: list[int] = field(default_factory=list)  # batch rows this slot fed in the current decode
    features: dict[str, list] = field(default_factory=dict)  # name -> [n, n_embd] float16 blocks, in order
    grams: set = field(default_factory=set)  # the LOOP_NGRAM-grams ending at positions before ``gram_end``
    gram_end: int = 0
    copy_run: int = 0  # this turn's latest tokens that each end an n-gram seen earlier in the conversation

    def ends_repeat(self) -> bool:
        """Whether the last token ends an n-gram that also ends earlier in the conversation (``train/loops.py``'s
        ``copied``, online): indexes the n-grams of the positions not indexed yet, prompt turns included."""
        seen = False
        for t in range(max(self.gram_end, LOOP_NGRAM - 1), len(self.ids)):
            gram = tuple(self.ids[t - LOOP_NGRAM + 1 : t + 1])
            seen = gram in self.grams
            self.grams.add(gram)
        self.gram_end = len(self.ids)
        return seen


Continuation = Callable[[int, list[int]], "list[int] | None"]


class BulkGenerator(Owners):
    """Owns a model and a unified multi-sequence context; ``generate`` streams finished conversations.

    >>> with BulkGenerator("model.gguf", BulkOptions(n_seq=32)) as g:
    ...     for r in g.generate([(0, prompt_ids)]):
    ...         r.ids, r.mask
    """

    def __init__(self, path: str | Path, options: BulkOptions = BulkOptions()) -> None:
        from .llama_target import default_threads, enable_taps, kv_type_id

        self.options = options
        self._model = ModelHandle(Path(path))
        try:
            self.n_vocab = C.llama_vocab_n_tokens(self._model.vocab)
            self.n_embd = C.llama_model_n_embd(self._model.ptr)
            self._ctx = ContextHandle(self._model, n_ctx=options.seq_ctx * options.n_seq, n_batch=options.max_rows,
                                      n_threads=options.n_threads or default_threads(), embeddings=options.hidden,
                                      n_seq_max=options.n_seq, kv_unified=options.unified, flash_attn=1,
                                      kv_type=kv_type_id(options.kv_type, self._model))
            self._batch = BatchHandle(options.max_rows, n_seq_max=1)
            self._taps = enable_taps(self._model, self._ctx.ptr, options.taps)
        except BaseException:
            self.close()
            raise

    def generate(self, prompts: Sequence[tuple[int, list[int]]], continue_with: Continuation | None = None,
                 on_rows: Callable[[int, int], None] | None = None) -> Iterator[BulkResult]:
        """prompts: (key, ids); yields one ``BulkResult`` per conversation as it finishes (any order).

        ``on_rows(prompt_rows, generated_rows)`` is called after every decode (progress bars).
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
                    C.llama_memory_seq_rm(self._ctx.memory, s, -1, -1)
                    slots[s] = _Slot(key, list(ids), [0] * len(ids))
            if all(x is None for x in slots):
                return
            n_prompt, n_gen = self._fill_batch(slots)
            _ffi.check_decode(C.llama_decode(self._ctx.ptr, self._batch.raw))
            if on_rows is not None:
                on_rows(n_prompt, n_gen)
            yield from self._advance(slots, continue_with)

    def _fill_batch(self, slots: list[_Slot | None]) -> tuple[int, int]:
        """Over a unified cache: one row per generating slot, then prompt chunks of prefilling slots in slot
        order, up to max_rows.  Over per-sequence streams: one slot's prompt chunk if any slot is
        prefilling, else one row per generating slot (see the module docstring).

        Only the last prompt row of a slot and the generating rows ask for logits."""
        b, cap = self._batch, self.options.max_rows
        n = 0

        def add(s: int, slot: _Slot, wants: bool) -> None:
            nonlocal n
            b.token[n], b.pos[n], b.output[n] = slot.ids[slot.fed], slot.fed, int(wants)
            b.seq_ids[n][0] = s
            if wants:
                slot.rows.append(n)
            slot.decoded.append(n)
            slot.fed += 1
            n += 1

        for slot in slots:
            if slot is not None:
                slot.rows.clear()
                slot.decoded.clear()
        prefilling = any(slot is not None and not slot.pending and slot.fed < len(slot.ids) for slot in slots)
        for s, slot in enumerate(slots):
            if prefilling and not self.options.unified:
                break
            if slot is not None and slot.pending:
                add(s, slot, True)
                slot.pending = False
        n_gen = n
        for s, slot in enumerate(slots):
            if slot is None or slot.pending or slot.fed >= len(slot.ids):
                continue
            while n < cap and slot.fed < len(slot.ids):
                add(s, slot, slot.fed == len(slot.ids) - 1)
            if n >= cap or not self.options.unified:
                break
        b.n_seq_id[:n] = 1
        b.raw.n_tokens = n
        return n - n_gen, n_gen

    def _keep_features(self, slots: list[_Slot | None]) -> None:
        """Copy this decode's hidden rows and block inputs to the slots that fed them (as float16)."""
        o = self.options
        n = self._batch.raw.n_tokens
        blocks = {}
        if o.hidden:
            blocks["hidden"] = np.ctypeslib.as_array(C.llama_get_embeddings(self._ctx.ptr), shape=(n, self.n_embd))
        for i in o.taps:
            blocks[f"layer_{i}"] = np.ctypeslib.as_array(self._taps.get(self._ctx.ptr, i), shape=(n, self.n_embd))
        for slot in slots:
            if slot is not None and slot.decoded:
                a, z = slot.decoded[0], slot.decoded[-1] + 1  # a slot's rows are contiguous in the batch
                for name, rows in blocks.items():
                    slot.features.setdefault(name, []).append(rows[a:z].astype(np.float16))

    def _advance(self, slots: list[_Slot | None], continue_with: Continuation | None) -> Iterator[BulkResult]:
        """Keep features; sample every slot that got logits; finish or continue the turns that ended."""
        o = self.options
        if o.hidden or o.taps:
            self._keep_features(slots)
        wanted = [(s, slot) for s, slot in enumerate(slots) if slot is not None and slot.rows]
        if not wanted:
            return
        # with embeddings on every row is an output; otherwise llama.cpp packs the output rows in batch order
        n_out = self._batch.raw.n_tokens if o.hidden else sum(len(slot.rows) for _, slot in wanted)
        logits = np.ctypeslib.as_array(C.llama_get_logits(self._ctx.ptr), shape=(n_out, self.n_vocab))
        order = sorted((row, s) for s, slot in wanted for row in slot.rows)
        best = logits[[row for row, _ in order]].argmax(axis=1) if o.hidden else logits.argmax(axis=1)
        for i, (_, s) in enumerate(order):
            slot = slots[s]
            tok = int(best[i])
            slot.ids.append(tok)
            slot.mask.append(1)
            slot.answer += 1
            slot.pending = True
            eog = self.is_eog(tok)
            if o.stop_loops:
                slot.copy_run = slot.copy_run + 1 if slot.ends_repeat() else 0
            looped = not eog and 0 < o.stop_loops < slot.copy_run
            if looped:  # past the loop's scored tokens: the turn ends before this one, where training stops scoring
                slot.ids.pop()
                slot.mask.pop()
            elif not eog and slot.answer < o.max_new_tokens:
                continue
            slot.turns += 1
            more = continue_with(slot.key, slot.ids) if (eog and continue_with is not None) else None
            if more and len(slot.ids) - 1 + len(more) + o.max_new_tokens <= o.seq_ctx and more[0] == tok:
                # the next turn starts with the end-of-generation token just sampled; it is decoded as prompt
                slot.ids[-1:] = more
                slot.mask[-1:] = [1] + [0] * (len(more) - 1)
                slot.answer, slot.pending, slot.copy_run = 0, False, 0
                continue
            yield BulkResult(slot.key, slot.ids, slot.mask, slot.turns, truncated=not eog,
                             features=self._stack(slot), looped=looped)
            slots[s] = None

    def _stack(self, slot: _Slot) -> dict[str, np.ndarray]:
        """Each feature's rows in position order, plus a zero row for the last (undecoded) token."""
        out = {}
        for name, blocks in slot.features.items():
            rows = np.concatenate(blocks)
            out[name] = np.concatenate((rows, np.zeros((len(slot.ids) - len(rows), self.n_embd), np.float16)))
        return out

