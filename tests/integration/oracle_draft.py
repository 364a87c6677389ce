"""A test double of the Draft protocol that knows the right answer and errs on purpose.

The untrained draft is almost always rejected, which leaves the partial-acceptance and
full-acceptance paths of the round loop unexercised.  This draft proposes the target's
own greedy continuation, corrupting each proposal with probability ``error_rate``, so
rounds accept 0..k tokens and every branch of the orchestrator runs against the real
target.  It follows the real draft's cache contract (cells, rollback by position).
"""
from __future__ import annotations

import numpy as np


class OracleDraft:
    def __init__(self, reference: list[int], error_rate: float, seed: int = 0, max_positions: int = 4096) -> None:
        self.reference = reference  # prompt + plain greedy output
        self.error_rate = error_rate
        self.rng = np.random.default_rng(seed)
        self.cell_tokens: list[int] = []  # cell i was computed from x_{i+1}
        self.max_positions = max_positions
        self.features_seen = 0
        self.context: list[int] = []  # the text as the orchestrator reports it (add_context)

    @property
    def n(self) -> int:
        return len(self.cell_tokens)

    def rollback(self, n_keep: int) -> None:
        assert 0 <= n_keep <= self.n
        del self.cell_tokens[n_keep:]

    def skip(self, n: int) -> None:
        self.cell_tokens.extend([-1] * n)  # positions whose features were never computed

    def add_context(self, tokens) -> int:
        self.context.extend(int(t) for t in tokens)
        return 0

    def prefill(self, features: np.ndarray, tokens) -> None:
        assert features.shape[0] == len(tokens) and features.dtype == np.float32
        self.features_seen += features.shape[0]
        self.cell_tokens.extend(int(t) for t in tokens)

    def propose(self, features: np.ndarray, tokens, k: int) -> list[int]:
        assert features.shape[0] == len(tokens) and features.dtype == np.float32
        self.features_seen += features.shape[0]
        self.cell_tokens.extend(int(t) for t in tokens)
        out = []
        for j in range(k):
            nxt = self.n + 1  # the last cell holds x_n, so the proposal is x_{n+1}
            tok = self.reference[nxt] if nxt < len(self.reference) else 0
            if self.rng.random() < self.error_rate:
                tok = (tok + 1) % 49152
            out.append(tok)
            if j + 1 < k:
                self.cell_tokens.append(tok)
        return out
