"""Admission and row allocation: who gets a slot, and which rows each slot puts in this step.

FIFO: requests wait in arrival order and take free slots in that order, so nobody starves.
Each step first gives every generating slot its one plain row (a token per user per step keeps
the streams moving), then fills the remaining rows, up to ``max_rows``, with prompt chunks of the
slots still prefilling, oldest first: a long prompt is cut into chunks and never stalls the others.
Draft rows (a slot's proposal, verified behind its plain row) take what room is left: they are a
bet, the others' rows are not.
"""
from __future__ import annotations

import collections

from ..target.sequences import Row
from .slots import Request, Slot


class QueueFull(Exception):
    """``max_waiting`` requests already wait for a slot."""


class Scheduler:
    """The slots, the bounded FIFO of waiting requests, and the rows of the next step."""

    def __init__(self, n_slots: int, max_waiting: int, max_rows: int) -> None:
        self.slots = [Slot(seq) for seq in range(n_slots)]
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

    def admit(self, lookup: bool = False) -> list[Slot]:
        """Free slots take waiting requests in arrival order; returns the slots just assigned."""
        taken = []
        for slot in self.slots:
            if not self.waiting:
                break
            if slot.free:
                slot.assign(self.waiting.popleft(), lookup)
                self._order.append(slot)
                taken.append(slot)
        return taken

    def release(self, slot: Slot) -> Request:
        self._order.remove(slot)
        return slot.release()

    @property
    def active(self) -> list[Slot]:
        return list(self._order)

    def rows(self) -> list[tuple[Slot, Row, str]]:
        """This step's rows as (slot, row, kind), kind ``plain``, ``prompt`` or ``draft``: a plain row per
        generating slot, then prompt chunks, then draft rows, up to ``max_rows``.  A slot whose
        proposal does not fit whole drafts only the part that does (``slot.drafts`` is cut to it)."""
        rows: list[tuple[Slot, Row, str]] = []
        for slot in self._order:
            if slot.pending is not None and len(rows) < self.max_rows:
                rows.append((slot, Row(slot.seq, slot.pending, slot.n_past, True), "plain"))
        for slot in self._order:
            if not slot.prefilling:
                continue
            prompt = slot.request.prompt
            take = min(self.max_rows - len(rows), len(prompt) - slot.fed)
            for k in range(take):
                pos = slot.fed + k
                rows.append((slot, Row(slot.seq, prompt[pos], pos, pos == len(prompt) - 1), "prompt"))
        planned = {id(slot) for slot, _, kind in rows if kind == "plain"}
        for slot in self._order:
            if id(slot) not in planned:
                slot.drafts = []
                continue
            slot.drafts = slot.drafts[: self.max_rows - len(rows)]
            for i, token in enumerate(slot.drafts):
                rows.append((slot, Row(slot.seq, token, slot.n_past + 1 + i, True), "draft"))
        return rows
