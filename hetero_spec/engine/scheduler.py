"""Admission and the layout of a step: who gets a slot, and which rows each sequence puts in the decode.

FIFO: requests wait in arrival order and take free slots in that order, so nobody starves.  Of
the free slots, a request takes the one whose kept cells hold the longest start of its prompt
(an earlier turn of the same conversation, a shared system prompt), so interleaved conversations
keep their caches; otherwise a request takes the slot whose cells it costs least to lose (an empty
one first), then the lowest sequence id, which keeps the busy sequences together.

The layout follows how llama.cpp cuts a decode of a KV stream per sequence into micro-batches
(``target/sequences.py``): the same number of rows from each of a run of consecutive sequence
ids.  So rows are sorted by sequence; every generating slot puts in its pending token and the
drafts the engine chose for it (``cost.py`` prices the micro-batches each choice makes); a sequence
inside the span with nothing to decode gets pad rows, as many as the narrowest generating slot
has, which the engine removes after the decode, so the first micro-batch spans every sequence; and
one prefilling slot (the oldest) adds a prompt chunk: its first rows ride in that micro-batch, the
rest (up to ``max_rows``) in one of their own, so a long prompt never stalls the others.
"""
from __future__ import annotations

import collections
from collections.abc import Iterable
from dataclasses import dataclass, field

from ..target.sequences import Row
from ..spec.suffix import SuffixCache
from .slots import Request, Slot

PAD_TOKEN = 0  # any id: a pad row's cell is removed after the decode and its logits are not read


MIN_AFFINITY = 16  # shared prompt tokens that make a slot preferred (fewer: a BOS, a template's first tokens)


def _affinity(slot: Slot, prompt: list[int]) -> tuple[int, int, int]:
    """Sort key of a free slot for ``prompt``: the longest reusable start (when it is worth a preference), then
    the fewest cached tokens lost, then the lowest sequence id."""
    reuse = slot.reusable(prompt)
    return (reuse if reuse >= MIN_AFFINITY else 0, reuse - len(slot.cached), -slot.seq)


class QueueFull(Exception):
    """``max_waiting`` requests already wait for a slot."""


@dataclass(frozen=True)
class Admitted:
    """A request that just took ``slot``, whose cells already hold its first ``reuse`` prompt tokens of the
    ``previous`` tokens they held (the rest are dropped when the engine feeds the prompt)."""

    slot: Slot
    reuse: int
    previous: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class Plan:
    """One step's rows, sorted by sequence, as (slot, row, kind) with kind ``plain``, ``draft``, ``prompt``
    or ``pad``; ``counts``: (sequence, rows) in that order, what llama.cpp cuts into micro-batches."""

    rows: list[tuple[Slot, Row, str]]
    counts: list[tuple[int, int]]


class Scheduler:
    """The slots, the bounded FIFO of waiting requests, and the layout of the next step."""

    def __init__(self, n_slots: int, max_waiting: int, max_rows: int, seq_ctx: int = 1 << 30) -> None:
        self.slots = [Slot(seq) for seq in range(n_slots)]
        self.seq_ctx = seq_ctx
        self.max_waiting = max_waiting
        self.max_rows = max_rows
        self.waiting: collections.deque[Request] = collections.deque()
        self._order: list[Slot] = []  # occupied slots, oldest admission first

    def submit(self, request: Request) -> None:
        if len(self.waiting) >= self.max_waiting:
            raise QueueFull()
        self.waiting.append(request)

    def withdraw(self, request: Request) -> bool:
        """Take back a request that has no slot yet; False if it has one (or had one)."""
        try:
            self.waiting.remove(request)
        except ValueError:
            return False
        return True

    def admit(self, cache: SuffixCache | None = None) -> list[Admitted]:
        """Free slots take waiting requests in arrival order, each the free slot that holds the longest
        start of its prompt; returns the assignments."""
        taken = []
        while self.waiting:
            free = [slot for slot in self.slots if slot.free]
            if not free:
                break
            request = self.waiting.popleft()
            slot = max(free, key=lambda s: _affinity(s, request.prompt))
            reuse = 0 if request.keep_features else slot.reusable(request.prompt)  # reused cells have no features
            previous = slot.cached
            slot.assign(request, cache, reuse)
            self._order.append(slot)
            taken.append(Admitted(slot, reuse, previous))
        return taken

    def release(self, slot: Slot) -> Request:
        self._order.remove(slot)
        return slot.release()

    @property
    def active(self) -> list[Slot]:
        return list(self._order)

    @property
    def generating(self) -> list[Slot]:
        return [slot for slot in self._order if slot.pending is not None]

    def chunk_slot(self) -> Slot | None:
        """The prefilling slot that gets a prompt chunk this step: the oldest."""
        return next((slot for slot in self._order if slot.prefilling), None)

    def chunk_rows(self, width: int) -> int:
        """Prompt rows the chunk slot puts in a step whose narrowest generating slot puts in ``width`` rows."""
        slot = self.chunk_slot()
        return 0 if slot is None else chunk_rows(len(slot.request.prompt) - slot.fed, self.max_rows, width)

    def counts(self, ks: dict[Slot, int]) -> list[tuple[int, int]]:
        """(sequence, rows) of the step ``plan(ks)`` lays out, in batch order: what the engine prices (the same
        arithmetic as ``_layout``, without building rows)."""
        return list(self.shape().counts(ks))

    def shape(self) -> "StepShape":
        """This step's layout less its drafts, for pricing many draft layouts of one step."""
        chunk = self.chunk_slot()
        return StepShape(tuple(self.generating), chunk.seq if chunk is not None else None,
                         len(chunk.request.prompt) - chunk.fed if chunk is not None else 0, self.max_rows)

    def plan(self, ks: dict[Slot, int]) -> Plan:
        """The step's rows with ``ks[slot]`` drafts for each generating slot (``slot.drafts`` holds them)."""
        by_seq = self._layout(ks)
        return Plan([r for seq in by_seq for r in by_seq[seq]], [(seq, len(rows)) for seq, rows in by_seq.items()])

    def _layout(self, ks: dict[Slot, int]) -> dict[int, list[tuple[Slot, Row, str]]]:
        """Rows by sequence, in sequence order: each generating slot's pending token and drafts, the chunk,
        and pad rows, as many as the narrowest generating slot has, for a sequence between two that decode
        and has nothing to decode itself (so the first micro-batch spans them all)."""
        gen = self.generating
        width = step_width(gen, ks)
        chunk = self.chunk_slot()
        by_seq: dict[int, list[tuple[Slot, Row, str]]] = {}
        for slot in gen:
            pos = slot.n_past
            rows = [(slot, Row(slot.seq, slot.pending, pos, True), "plain")]
            k = ks.get(slot, 0)
            rows += [(slot, Row(slot.seq, t, pos + 1 + i, True), "draft") for i, t in enumerate(slot.drafts[:k])]
            by_seq[slot.seq] = rows
        if chunk is not None:
            prompt = chunk.request.prompt
            by_seq[chunk.seq] = [(chunk, Row(chunk.seq, prompt[p], p, p == len(prompt) - 1),
                                  "prompt")
                                 for p in range(chunk.fed, chunk.fed + self.chunk_rows(width))]
        if not by_seq or not width:
            return by_seq
        for seq in range(min(by_seq), max(by_seq) + 1):  # pad a gap, and a chunk shorter than the width
            slot = self.slots[seq]
            rows = by_seq.setdefault(seq, [])
            pos = rows[-1][1].pos + 1 if rows else slot.n_past
            n_pad = min(width - len(rows), self.seq_ctx - pos)  # none past the end (a rare extra micro-batch)
            rows += [(slot, Row(seq, PAD_TOKEN, pos + i, False), "pad") for i in range(max(0, n_pad))]
        return dict(sorted(by_seq.items()))


def step_width(generating: Iterable[Slot], ks: dict[Slot, int]) -> int:
    """Rows of the narrowest generating slot (its pending token and drafts), 0 with none generating: a
    sequence between two that decode is padded to this, so that the first micro-batch spans them all."""
    return 1 + min((ks.get(slot, 0) for slot in generating), default=-1)


def chunk_rows(left: int, max_rows: int, width: int) -> int:
    """Prompt rows a chunk with ``left`` rows still to feed puts in a step of ``width``-row slots: up to
    ``max_rows`` beyond the width, so that a long prompt shares each step with the slots that decode."""
    return min(left, max_rows + width)


@dataclass(frozen=True)
class StepShape:
    """What a step's layout holds whatever its drafts: the generating slots and the prompt chunk's slot and
    rows left.  ``Engine._choose`` prices a dozen draft layouts a step; taking these once keeps that to a few
    microseconds each."""

    generating: tuple[Slot, ...]
    chunk_seq: int | None
    chunk_left: int
    max_rows: int

    def counts(self, ks: dict[Slot, int]) -> tuple[tuple[int, int], ...]:
        """``Scheduler.counts`` for this step (the rules of ``Scheduler._layout``)."""
        gen = self.generating
        width = step_width(gen, ks)
        n = {slot.seq: 1 + ks.get(slot, 0) for slot in gen}
        if self.chunk_seq is not None:
            n[self.chunk_seq] = chunk_rows(self.chunk_left, self.max_rows, width)
        if n and width:
            for seq in range(min(n), max(n) + 1):
                n[seq] = max(n.get(seq, 0), width)
        return tuple(sorted(n.items()))
