"""A slot: one llama.cpp sequence and the request it serves, from admission to its last token."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..config import SamplingConfig
from ..target.llama_target import common_prefix
from ..spec.shadow import ShadowChain
from ..spec.suffix import SuffixCache, SuffixRequest, prompt_key


@dataclass(eq=False)
class Request:
    """What a caller asks of the engine: prompt ids in, answer ids out (an end-of-generation id included).

    ``keep_logits`` keeps a copy of the logits each answer token was picked from (tests compare them
    bit for bit against a single-sequence decode); ``keep_features`` the target's features of every row it
    kept, in position order (a target opened with features; the newest token's row is never decoded);
    ``cancelled`` ends it at the next step."""

    prompt: list[int]
    max_new_tokens: int
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    keep_logits: bool = False
    keep_features: bool = False
    tag: Any = None  # the caller's handle (a server job, an index)
    out: list[int] = field(default_factory=list)
    logits: list[np.ndarray] = field(default_factory=list)  # [n_vocab] float32 per answer token, if kept
    features: list[np.ndarray] = field(default_factory=list)  # [rows, feature_size] float32 blocks, if kept
    stop_reason: str | None = None  # eog, max_tokens, context_full, cancelled
    cancelled: bool = False
    seq: int | None = None  # the sequence (slot) it was given
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
    suffix: SuffixRequest | None = None  # prompt + answer so far (and past answers), for copy drafts
    drafts: list[int] = field(default_factory=list)  # this step's proposal, verified after ``pending``
    sure: int = 0  # drafts[:sure] came from a long match, the rest are guesses that fill the batch
    bucket: int = 0  # the match length class of those drafts (Engine.trusted)
    cached: list[int] = field(default_factory=list)  # while free: the tokens whose cells the sequence kept
    shadow: ShadowChain = field(default_factory=ShadowChain)  # a trusted copy no step verified, checked unverified

    @property
    def free(self) -> bool:
        return self.request is None

    @property
    def sampled(self) -> bool:
        """Its request samples (a draft is kept only as often as the draw agrees: acceptance counted apart)."""
        return self.rng is not None

    @property
    def prefilling(self) -> bool:
        return self.request is not None and self.fed < len(self.request.prompt)

    @property
    def n_past(self) -> int:
        """Cells of this sequence that hold its text: the prompt fed so far and every answer token but the
        newest (picked, not decoded yet); for a free slot, its ``cached`` tokens."""
        r = self.request
        if r is None:
            return len(self.cached)
        return self.fed + max(0, len(r.out) - 1)

    def reusable(self, prompt: list[int]) -> int:
        """How many of ``prompt``'s first tokens this free slot's cells already hold (at most all but the
        last: the last prompt row must be decoded again for its logits)."""
        return common_prefix(self.cached, prompt[:-1])

    def assign(self, request: Request, cache: SuffixCache | None = None, reuse: int = 0) -> None:
        """Take ``request``, whose first ``reuse`` prompt tokens are in the cells already; ``cache``: draft by
        suffix match over its text and the past answers there (greedy and sampled requests alike)."""
        self.request, self.fed, self.pending, self.drafts, self.sure = request, reuse, None, [], 0
        self.shadow = ShadowChain()
        request.seq = self.seq
        self.cached = []
        self.rng = None if request.sampling.greedy else np.random.default_rng(request.sampling.seed)
        self.suffix = None if cache is None else SuffixRequest(request.prompt, cache, key=prompt_key(request.prompt))

    def release(self) -> Request:
        """Free the slot; its cells keep the request's text (``cached``) for a later prompt that starts alike."""
        request = self.request
        self.cached = (request.prompt + request.out)[: self.n_past]
        if self.suffix is not None:  # its answer becomes text later requests can copy from
            self.suffix.extend(request.out[len(self.suffix.output):])
            self.suffix.finish()
        self.shadow.close()
        self.request, self.pending, self.rng, self.suffix, self.drafts, self.sure = None, None, None, None, [], 0
        return request
