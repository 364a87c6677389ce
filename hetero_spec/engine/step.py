"""The engine: one step = the scheduler's rows -> one llama_decode -> each slot's next token.

Every slot is a sequence of one ``SequenceTarget`` context.  A step's decode holds the plain row
of every generating slot and the prompt chunks of the slots still prefilling, at most 32 rows
(the bound under which llama.cpp's rows are batch-invariant), so a greedy answer is the same
whoever else is served (tested against single-sequence decoding, logits bit for bit).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterator

import numpy as np

from ..spec.sampling import process_support, sample_support
from ..target.sequences import SequenceTarget
from .scheduler import Scheduler
from .slots import Request, Slot


@dataclass(frozen=True)
class Drafting:
    """Which draft rows the engine verifies: prompt lookup up to ``lookup_depth`` tokens (0: off), only
    behind a match of at least ``lookup_min_match`` tokens (the first proposed token was right 94% of
    the time after 8 or more on SmolLM2's answers, ``spec/lookup.py``), greedy requests only."""

    lookup_depth: int = 0
    lookup_min_match: int = 8


@dataclass(frozen=True)
class StepRecord:
    """What one step did, for metrics: rows by kind, drafted tokens accepted, occupied slots, waiting
    requests, seconds."""

    rows: int
    prompt_rows: int
    plain_rows: int
    draft_rows: int
    accepted: int  # draft rows whose token the target agreed with
    active_slots: int
    waiting: int
    decode_s: float


class Engine:
    """Slots over one multi-sequence context; ``step`` advances every active request by one decode.

    >>> engine = Engine(SequenceTarget(path, SequenceOptions(n_seq=4)), max_waiting=16)
    >>> answers = engine.generate_many([ids_a, ids_b], max_new_tokens=64)   # list of id lists
    """

    def __init__(self, target: SequenceTarget, *, max_waiting: int = 16, drafting: Drafting = Drafting()) -> None:
        self.target = target
        self.drafting = drafting
        self.scheduler = Scheduler(target.options.n_seq, max_waiting, target.options.max_rows)

    def submit(self, request: Request) -> None:
        """Queue ``request`` (FIFO); ``QueueFull`` when ``max_waiting`` already wait."""
        if not request.prompt or len(request.prompt) >= self.target.seq_ctx:
            raise ValueError(f"a prompt of {len(request.prompt)} tokens does not fit a slot of "
                             f"{self.target.seq_ctx} cells")
        self.scheduler.submit(request)

    @property
    def idle(self) -> bool:
        return not self.scheduler.active and not self.scheduler.waiting

    def step(self) -> tuple[StepRecord | None, list[Request]]:
        """Admit, decode one batch, pick tokens; returns the step's record (None if nothing ran) and
        the requests that finished in it (their slots are free again)."""
        sch = self.scheduler
        finished = []
        for slot in sch.active:  # a cancelled request leaves before the decode: its slot is free this step
            if slot.request.cancelled:
                _end(slot.request, "cancelled")
                finished.append(sch.release(slot))
        for slot in sch.admit(lookup=self.drafting.lookup_depth > 0):
            self.target.clear(slot.seq)
        self._propose()
        rows = sch.rows()
        if not rows:
            return None, finished
        n_active = len(sch.active)
        t0 = time.perf_counter()
        logits = self.target.decode([r for _, r, _ in rows])
        decode_s = time.perf_counter() - t0
        accepted = 0
        for slot, outs in _outputs_by_slot(rows).items():
            n_drafts = len(slot.drafts)
            if slot.prefilling:
                slot.fed += sum(1 for s, _, kind in rows if s is slot and kind == "prompt")
            if outs:
                accepted += self._accept(slot, [logits[j] for j in outs])
            if slot.request.done:
                finished.append(sch.release(slot))
            elif n_drafts:
                self.target.keep(slot.seq, slot.n_past)  # rejected draft cells leave, newest first
        kinds = [kind for _, _, kind in rows]
        record = StepRecord(len(rows), kinds.count("prompt"), kinds.count("plain"), kinds.count("draft"), accepted,
                            n_active, len(sch.waiting), decode_s)
        return record, finished

    def _propose(self) -> None:
        """Each generating greedy slot's prompt-lookup proposal, where its match is long enough."""
        d = self.drafting
        for slot in self.scheduler.active:
            slot.drafts = []
            if slot.lookup is None or slot.pending is None:
                continue
            req = slot.request
            room = min(d.lookup_depth, req.max_new_tokens - len(req.out),
                       self.target.seq_ctx - 1 - (slot.n_past + 1))
            if room <= 0:
                continue
            drafts, matched = slot.lookup.propose_matched(room)
            if matched >= d.lookup_min_match:
                slot.drafts = drafts

    def _accept(self, slot: Slot, logits: list[np.ndarray]) -> int:
        """Greedy acceptance of the slot's rows: row i's token is kept, and row i+1 counts only if row i's
        token is the draft decoded there; returns the drafts accepted.  ``slot.pending`` is the last
        kept token (its cell is not in the cache yet)."""
        drafts = slot.drafts
        slot.drafts = []
        slot.pending = None
        accepted = 0
        for i, row in enumerate(logits):
            token = self._pick(slot, row)
            if slot.request.done:
                break
            if i < len(drafts) and token == drafts[i]:
                accepted += 1
                continue
            slot.pending = token
            break
        if slot.lookup is not None:
            slot.lookup.extend(slot.request.out[len(slot.lookup.tokens) - len(slot.request.prompt):])
        slot.request.drafted += len(drafts)
        slot.request.accepted += accepted
        return accepted

    def _pick(self, slot: Slot, logits: np.ndarray) -> int:
        """The slot's next token from one row's logits; ends the request at EOG, max tokens or a full slot."""
        req = slot.request
        if req.keep_logits:
            req.logits.append(logits.copy())
        if slot.rng is None:
            token = int(np.argmax(logits))
        else:
            ids, probs = process_support(logits, req.sampling)
            token = sample_support(ids, probs, slot.rng)
        req.out.append(token)
        if self.target.is_eog(token):
            _end(req, "eog")
        elif len(req.out) >= req.max_new_tokens:
            _end(req, "max_tokens")
        elif len(req.prompt) + len(req.out) >= self.target.seq_ctx:
            _end(req, "context_full")
        return token

    def run(self) -> Iterator[tuple[StepRecord, list[Request]]]:
        """Steps until every submitted request has finished."""
        while not self.idle:
            record, finished = self.step()
            if record is not None or finished:
                yield record, finished

    def generate_many(self, prompts: list[list[int]], max_new_tokens: int, **fields) -> list[list[int]]:
        """The batch entry for offline jobs: every prompt's answer ids, in prompt order, through the slots
        (more prompts than ``max_waiting`` are fed in as slots free up)."""
        requests = [Request(list(p), max_new_tokens, tag=i, **fields) for i, p in enumerate(prompts)]
        pending = list(reversed(requests))
        while pending or not self.idle:
            while pending and len(self.scheduler.waiting) < self.scheduler.max_waiting:
                self.submit(pending.pop())
            self.step()
        return [r.out for r in requests]


def _outputs_by_slot(rows) -> dict:
    """{slot: indices into the decode's logits of its output rows, in row order} (slots in row order)."""
    out: dict = {}
    j = 0
    for slot, row, _ in rows:
        idx = out.setdefault(slot, [])
        if row.output:
            idx.append(j)
            j += 1
    return out


def _end(request: Request, reason: str) -> None:
    request.stop_reason = request.stop_reason or reason
