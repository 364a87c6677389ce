"""The draft's head plus the target's head rows of the tokens in the text: a reduced head can propose them.

WHY: a draft with a reduced vocabulary (8,192 of SmolLM2's 49,152 rows) can never propose a token
outside its rows, and the target copies many such tokens from the prompt: names, numbers' units,
identifiers (" bananas", " Lily", " lst").  On the target's own greedy answers to the shipped bench
prompts, 6-9% of the tokens were outside the shipped draft's rows, and every one of them is a
certain rejection.  Tokens already in the prompt or the answer so far covered all but 0.3-3% of
the answers.  The draft predicts the target's *feature*, and the target's head turns any feature
into a logit for any token, so a row added for a seen token needs no training: it is the frozen
target row itself, the same row a full-vocabulary draft would use.  A few hundred extra rows cost
a few hundred dot products per draft step, against 8,192 in the reduced head.
"""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import torch

# At most this many added rows (a long chat stops adding new ones until the draft is reset): the
# head then costs at most half again its reduced size per step.
MAX_CONTEXT_ROWS = 4096


class ContextHead:
    """Logits over the draft's own head rows, then over rows added for tokens seen in the text.

    >>> head = ContextHead(base, d2t, target_head)   # base: feat [B, n_embd] -> logits [B, len(d2t)]
    >>> head.add(prompt_ids)                          # target rows for the ids outside d2t
    >>> head.d2t[head(feat).argmax(-1)]               # row -> target id, over both parts
    """

    def __init__(self, base: Callable[[torch.Tensor], torch.Tensor], d2t: np.ndarray,
                 target_head: torch.Tensor | None, *, dtype: torch.dtype, device: torch.device,
                 limit: int = MAX_CONTEXT_ROWS) -> None:
        """``target_head`` [n_vocab, n_embd]: the frozen target rows to add from, or None (a full head,
        or an imported head with its own rows, which target rows would not match): nothing is added."""
        self.base = base
        self._base_d2t = np.asarray(d2t, dtype=np.int64)
        self._source = target_head
        self._dtype, self._device, self.limit = dtype, device, limit
        self.clear()

    def clear(self) -> None:
        """Back to the draft's own rows (a new conversation)."""
        self.d2t = self._base_d2t  # [n_rows] int64: head row -> target id
        self.d2t_t = torch.as_tensor(self.d2t, device=self._device)
        self._extra: torch.Tensor | None = None  # [n_added, n_embd] in the draft's dtype
        if self._source is not None:
            self._covered = np.zeros(self._source.shape[0], dtype=bool)  # [n_vocab]
            self._covered[self._base_d2t] = True

    def fresh(self) -> "ContextHead":
        """A head over the same rows with nothing added: one per text (a server slot each)."""
        return ContextHead(self.base, self._base_d2t, self._source, dtype=self._dtype, device=self._device,
                           limit=self.limit)

    @property
    def n_added(self) -> int:
        return 0 if self._extra is None else self._extra.shape[0]

    def add(self, tokens: Sequence[int]) -> int:
        """Add the target rows of any of ``tokens`` the head lacks; returns how many rows were added."""
        if self._source is None or self.n_added >= self.limit:
            return 0
        covered = self._covered
        if len(tokens) == 1:  # every round's call: one token, nearly always covered (84 us -> 1 us a token)
            t = int(tokens[0])
            if not 0 <= t < len(covered) or covered[t]:
                return 0
        ids = np.unique(np.asarray(tokens, dtype=np.int64))
        ids = ids[(ids >= 0) & (ids < len(covered))]
        new = ids[~covered[ids]][: self.limit - self.n_added]
        if len(new) == 0:
            return 0
        self._covered[new] = True
        rows = self._source[torch.from_numpy(new)].to(self._device, self._dtype)
        self._extra = rows if self._extra is None else torch.cat([self._extra, rows])
        self.d2t = np.concatenate([self.d2t, new])
        self.d2t_t = torch.as_tensor(self.d2t, device=self._device)
        return len(new)

    def greedy(self, feat: torch.Tensor) -> torch.Tensor:
        """feat [1, n_embd] -> the target id [] of the best row over both parts, on the device.

        Through the base's ``best`` where it has one (``RescoredInt8Head``: the argmax without the full
        logits), else the argmax of ``self(feat)``."""
        best = getattr(self.base, "best", None)
        if best is None:
            return self.d2t_t[self(feat)[0].argmax()]
        return self.pick(feat, *best(feat))

    def pick(self, feat: torch.Tensor, row: torch.Tensor, score: torch.Tensor) -> torch.Tensor:
        """The target id [] for feat [1, n_embd] whose best draft row is ``row`` [] with logit ``score`` []: that
        row's id, unless an added row scores higher (a tie goes to the draft row, as an argmax over both parts)."""
        if self._extra is not None:
            extra = (feat.to(self._extra.dtype) @ self._extra.t())[0]  # [n_added]
            j = extra.argmax()
            row = torch.where(extra[j].to(score.dtype) > score, j + len(self._base_d2t), row)
        return self.d2t_t[row]

    def __call__(self, feat: torch.Tensor) -> torch.Tensor:
        """feat [B, n_embd] -> logits [B, len(self.d2t)]: the draft's head, then the added rows."""
        logits = self.base(feat)
        if self._extra is None:
            return logits
        return torch.cat([logits, (feat.to(self._extra.dtype) @ self._extra.t()).to(logits.dtype)], dim=-1)
