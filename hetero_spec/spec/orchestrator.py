"""The round loop: draft -> verify -> accept -> rollback, yielding one Round per step.

Only token ids go to the target and only hidden-state rows (with the token ids that
follow them) go to the draft; the target's logits never leave this module.  The loop
is written against two small protocols, so this package imports neither llama.cpp nor
torch: ``api.py`` hands it a concrete target and draft.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator, Protocol, Sequence

import numpy as np

from ..records import Round
from .verify import greedy_accept

TOKEN_BYTES = 4  # int32 ids on both sides


class Target(Protocol):
    n_ctx: int
    n_embd: int

    @property
    def n_past(self) -> int: ...
    def prefill(self, tokens: list[int], max_reuse: int | None = None) -> tuple[np.ndarray | None, np.ndarray]: ...
    def verify(self, tokens: Sequence[int]) -> tuple[np.ndarray, np.ndarray | None]: ...
    def rollback(self, n_keep: int) -> None: ...
    def kv_pos_max(self) -> int: ...
    def is_eog(self, token: int) -> bool: ...
    def set_embeddings(self, on: bool) -> None: ...


class Draft(Protocol):
    @property
    def n(self) -> int: ...
    @property
    def max_positions(self) -> int: ...
    def propose(self, features: np.ndarray, tokens: Sequence[int], k: int) -> list[int]: ...
    def rollback(self, n_keep: int) -> None: ...


@dataclass
class Step:
    """Tokens appended to the output by one round (and the round's record; None for the prefill's token)."""

    tokens: list[int]
    round: Round | None
    stop_reason: str = ""  # set on the last step: "eog", "max_tokens", "context_full"


@dataclass
class _Pending:
    """Real target rows the draft has not consumed yet: f_i and x_{i+1} for i = start.."""

    features: np.ndarray  # [m, n_embd] float32
    next_tokens: list[int] = field(default_factory=list)  # [m]


class KVMismatch(RuntimeError):
    """Internal invariant broken: the caches no longer describe the accepted text."""


def generate_tokens(
    target: Target, draft: Draft | None, prompt: list[int], *, max_new_tokens: int, draft_len: int
) -> Iterator[Step]:
    """Greedy speculative generation; with ``draft`` None or ``draft_len`` 0, plain decoding."""
    speculative = draft is not None and draft_len > 0
    target.set_embeddings(speculative)
    hidden, logits = target.prefill(prompt, max_reuse=draft.n if speculative else None)
    x = int(np.argmax(logits))
    left = max_new_tokens - 1
    stop = _stop_reason(target, x, left)
    yield Step([x], None, stop)
    if stop:
        return
    if not speculative:
        yield from _plain_rounds(target, x, left)
        return
    keep = len(prompt) - len(hidden)
    draft.rollback(keep)
    pending = _Pending(hidden, list(prompt[keep + 1 :]) + [x])
    while True:
        step, x, pending = _spec_round(target, draft, x, pending, draft_len, left)
        left -= len(step.tokens)
        yield step
        if step.stop_reason:
            return


def _spec_round(
    target: Target, draft: Draft, x: int, pending: _Pending, draft_len: int, left: int
) -> tuple[Step, int, _Pending]:
    t0 = time.perf_counter()
    n0 = target.n_past
    room_target = target.n_ctx - n0 - 1  # cells left after x itself
    room_draft = draft.max_positions - draft.n - len(pending.next_tokens) + 1
    k = max(0, min(draft_len, left - 1, room_target, room_draft))
    if room_target < 0:
        return Step([], None, "context_full"), x, pending
    m = len(pending.next_tokens)
    draft_s = 0.0
    drafts: list[int] = []
    if k > 0:
        td = time.perf_counter()
        drafts = draft.propose(pending.features, pending.next_tokens, k)
        draft_s = time.perf_counter() - td
    tv = time.perf_counter()
    logits, hidden = target.verify([x, *drafts])
    verify_s = time.perf_counter() - tv
    a, nxt = greedy_accept(drafts, logits.argmax(axis=1))
    accepted = drafts[:a] + [nxt]
    target.rollback(n0 + 1 + a)
    d_real = draft.n - (k - 1 if k > 0 else 0)  # cells from real rows only
    if k > 0:
        draft.rollback(d_real)
        new_pending = _Pending(hidden[: a + 1].copy(), accepted)
    else:  # nothing drafted: the pending rows still wait, plus this row
        new_pending = _Pending(np.concatenate((pending.features, hidden[:1])), pending.next_tokens + accepted)
    _check_kv(target, n0 + 1 + a)
    emitted, stop = _truncate_at_stop(target, accepted, left)
    rnd = Round(
        drafted=k,
        accepted=a,
        emitted=len(emitted),
        draft_s=draft_s,
        verify_s=verify_s,
        overhead_s=time.perf_counter() - t0 - draft_s - verify_s,
        bytes_to_target=TOKEN_BYTES * (k + 1),
        bytes_to_draft=m * (pending.features.shape[1] * pending.features.itemsize + TOKEN_BYTES) if k else 0,
    )
    return Step(emitted, rnd, stop), nxt, new_pending


def _plain_rounds(target: Target, x: int, left: int) -> Iterator[Step]:
    """Plain greedy decoding through the same target: one token per decode, last-row logits only."""
    while True:
        t0 = time.perf_counter()
        if target.n_past + 1 > target.n_ctx:
            yield Step([], None, "context_full")
            return
        logits, _ = target.verify([x])
        verify_s = time.perf_counter() - t0
        x = int(logits[-1].argmax())
        left -= 1
        stop = _stop_reason(target, x, left)
        rnd = Round(
            drafted=0, accepted=0, emitted=1, draft_s=0.0, verify_s=verify_s,
            overhead_s=time.perf_counter() - t0 - verify_s, bytes_to_target=TOKEN_BYTES, bytes_to_draft=0,
        )
        yield Step([x], rnd, stop)
        if stop:
            return


def _truncate_at_stop(target: Target, tokens: list[int], left: int) -> tuple[list[int], str]:
    for i, tok in enumerate(tokens):
        reason = _stop_reason(target, tok, left - i - 1)
        if reason:
            return tokens[: i + 1], reason
    return tokens, ""


def _stop_reason(target: Target, token: int, left_after: int) -> str:
    if target.is_eog(token):
        return "eog"
    if left_after <= 0:
        return "max_tokens"
    if target.n_past + 1 > target.n_ctx:
        return "context_full"
    return ""


def _check_kv(target: Target, expected: int) -> None:
    if target.n_past != expected or target.kv_pos_max() != expected - 1:
        raise KVMismatch(
            f"target KV holds {target.n_past} tokens (max pos {target.kv_pos_max()}), expected {expected}"
        )
