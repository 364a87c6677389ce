"""Prompt cells kept in host memory after their slot moves on: the engine's ``--cache-ram``.

WHY: a slot's cells are lost when the next request takes the slot, yet they are often the start of a
later request: the next turn of a conversation that was served while other conversations took every
slot, a repeated system prompt or few-shot preamble, the same prompt asked again.  Recomputing them
costs a prefill (on a CPU, the largest part of a short request's time to first token); copying them
back costs a memcpy of the KV cells (about 12 KB a token for SmolLM2 with q8_0 cells).  llama-server
does the same with its ``--cache-ram`` prompt cache.

The engine saves a free slot's cells here just before a request that shares less of them takes the
slot (``llama_state_seq_get_data``), and before a request's prompt is fed it restores the saved entry
that holds the longest start of the prompt, if that is longer than what the slot's own cells hold
(``llama_state_seq_set_data``), then drops the cells past the shared start.  Restored cells are the
bytes the decode wrote, in their order, so an answer stays what the request alone would get (tested
bit for bit in tests/integration/test_engine.py).  Memory is bounded: least recently used entries go
first.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass

from ..target.llama_target import common_prefix

MIN_TOKENS = 16  # shorter starts are not worth an entry (a BOS and a template's first tokens)


@dataclass(frozen=True)
class SavedCells:
    """One sequence's cells: the tokens at positions 0..n-1 and llama.cpp's serialized state of them."""

    tokens: tuple[int, ...]
    state: bytes

    @property
    def size(self) -> int:
        return len(self.state)


class PromptCache:
    """Saved cells of past requests, at most ``limit_bytes`` of them, least recently used evicted first.

    >>> cache = PromptCache(limit_bytes=256 << 20)
    >>> cache.save(tokens, lambda: target.save_cells(seq))   # the slot's cells, before they are dropped
    >>> n, entry = cache.best(prompt)                        # entry.tokens[:n] == prompt[:n]
    """

    def __init__(self, limit_bytes: int, min_tokens: int = MIN_TOKENS) -> None:
        if limit_bytes < 0:
            raise ValueError(f"the prompt cache's limit must be >= 0 bytes, not {limit_bytes}")
        self.limit_bytes = limit_bytes
        self.min_tokens = min_tokens
        self._entries: collections.OrderedDict[tuple[int, ...], SavedCells] = collections.OrderedDict()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def covers(self, tokens: list[int]) -> bool:
        """True if an entry already holds ``tokens`` (as its whole text or its start)."""
        key = tuple(tokens)
        return any(k[:len(key)] == key for k in self._entries if len(k) >= len(key))

    def save(self, tokens: list[int], read_state) -> bool:
        """Keep the cells of ``tokens`` (``read_state()`` serializes them, called only if they are kept): not when
        too short, already covered, or larger than the whole cache.  Entries that are a start of ``tokens`` go, as
        it holds them too.  Returns whether it was kept."""
        if len(tokens) < self.min_tokens or self.limit_bytes == 0 or self.covers(tokens):
            return False
        state = bytes(read_state())
        if len(state) > self.limit_bytes:
            return False
        key = tuple(tokens)
        for old in [k for k in self._entries if k == key[:len(k)]]:
            self._drop(old)
        while self._entries and self.bytes + len(state) > self.limit_bytes:
            self._drop(next(iter(self._entries)))
        self._entries[key] = SavedCells(key, state)
        self.bytes += len(state)
        return True

    def best(self, prompt: list[int]) -> tuple[int, SavedCells | None]:
        """The entry sharing the longest start with ``prompt`` (all but its last token at most: that row must be
        decoded for its logits), and that length; (0, None) below ``min_tokens``.  A hit becomes most recent."""
        head = tuple(prompt[:-1])
        n, found = 0, None
        for key, entry in self._entries.items():
            m = common_prefix(key, head)
            if m > n:
                n, found = m, entry
        if found is None or n < self.min_tokens:
            return 0, None
        self._entries.move_to_end(found.tokens)
        return n, found

    def _drop(self, key: tuple[int, ...]) -> None:
        self.bytes -= self._entries.pop(key).size
