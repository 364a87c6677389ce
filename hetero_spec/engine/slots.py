"""A slot: one llama.cpp sequence and the request it serves, from admission to its last token."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..config import SamplingConfig
from ..spec.lookup import NgramLookup


@dataclass(eq=False)
class Request:
    """What a caller asks of the engine: prompt ids in, answer ids out (an end-of-generation id included).

    ``keep_logits`` keeps a copy of the logits each answer token was picked from (tests compare them
    bit for bit against a single-sequence decode); ``cancelled`` ends it at the next step."""

    prompt: list[int]
    max_new_tokens: int
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    keep_logits: bool = False
    tag: Any = None  # the caller's handle (a server job, an index)
    out: list[int] = field(default_factory=list)
    logits: list[np.ndarray] = field(default_factory=list)  # [n_vocab] float32 per answer token, if kept
    stop_reason: str | None = None  # eog, max_tokens, context_full, cancelled
    cancelled: bool = False
    drafted: int = 0  # draft rows verified for it so far
    accepted: int = 0  # ... of which the target agreed with

    @property
    def done(self) -> bool:
        return self.stop_reason is not None


@dataclass(eq=False)
class Slot:
    """One sequence of the context; ``request`` is None while the slot is free.

    Positions: the prompt's rows go in first (``fed`` of them so far, in chunks), then each
    picked token is decoded at the next position as a plain row (``pending``)."""

    seq: int
    request: Request | None = None
    fed: int = 0  # prompt rows decoded so far
    pending: int | None = None  # the picked token not yet decoded
    rng: np.random.Generator | None = None
    lookup: NgramLookup | None = None  # prompt + answer so far, for prompt-lookup drafts (greedy requests)
    drafts: list[int] = field(default_factory=list)  # this step's proposal, verified after ``pending``

    @property
    def free(self) -> bool:
        return self.request is None

    @property
    def prefilling(self) -> bool:
        return self.request is not None and self.fed < len(self.request.prompt)

    @property
    def n_past(self) -> int:
        """Cells this sequence holds in the KV cache."""
        r = self.request
        return 0 if r is None else self.fed + len(r.out) - (1 if self.pending is not None else 0)

    def assign(self, request: Request, lookup: bool = False) -> None:
        """Take ``request``; ``lookup``: keep an n-gram index of its text (only greedy requests draft)."""
        self.request, self.fed, self.pending, self.drafts = request, 0, None, []
        self.rng = None if request.sampling.greedy else np.random.default_rng(request.sampling.seed)
        self.lookup = NgramLookup(request.prompt) if lookup and request.sampling.greedy else None

    def release(self) -> Request:
        request, self.request, self.pending, self.rng, self.lookup, self.drafts = \
            self.request, None, None, None, None, []
        return request
