"""The draft model in the batched engine: one set of weights, a KV cache and context rows per slot.

WHY per slot: a draft's state is its text (the cells of every position it has read, and the target's
head rows of tokens seen in that text, ``draft/context_head.py``), so each sequence of the engine needs
its own, while the weights, the largest part of a draft step's memory traffic, are shared.  The slots'
caches are views into one tensor per block, ``[n_slots, n_kv, positions, head_dim]``.

Real rows arrive after every decode: the target's features of each kept row with the token picked
after it (a prompt row's next prompt token, a generated row's answer token).  They queue per slot and
are read the next time that slot drafts, in one forward, so a step that does not draft costs nothing
here.  Positions whose cells were reused from an earlier request have no features; the draft skips
them (``DraftRunner.skip``), as ``HeteroSpec`` does for a reused prefix.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from ..draft.context_head import ContextHead
from ..draft.runner import DraftCache, DraftRunner
from ..errors import DraftError

FLUSH_ROWS = 1024  # real rows a slot may queue while it does not draft (7 MB of SmolLM2's taps); then they are read


@dataclass
class SlotDraft:
    """One slot's draft state: its cache cells and context rows, and the real rows not read yet."""

    cache: DraftCache
    head: ContextHead
    feats: list[np.ndarray] = field(default_factory=list)  # [m_i, feature_size] float32 blocks
    tokens: list[int] = field(default_factory=list)  # the token that followed each queued row
    active: bool = False  # serving a request the draft drafts for (greedy)

    @property
    def queued(self) -> int:
        return len(self.tokens)


class SlotDrafts:
    """``runner``'s weights drafting for ``n_slots`` sequences, each with its own cache and context rows.

    >>> drafts = SlotDrafts(runner, n_slots=4)
    >>> drafts.start(seq, prompt, reused=0)          # a request takes the slot
    >>> drafts.feed(seq, features, next_tokens)      # after each decode, the kept rows
    >>> drafts.propose([0, 2], k=3)                  # {seq: [3 ids]}
    """

    def __init__(self, runner: DraftRunner, n_slots: int) -> None:
        self.runner = runner
        runner.cuda_graph = False  # a captured step is bound to one cache's buffers, and slots swap caches
        cfg, dev, dtype = runner.cfg, runner.device, runner.dtype
        shape = (n_slots, cfg.n_kv_heads, cfg.max_positions, cfg.head_dim)
        k = [torch.zeros(shape, device=dev, dtype=dtype) for _ in range(cfg.n_blocks)]
        v = [torch.zeros(shape, device=dev, dtype=dtype) for _ in range(cfg.n_blocks)]
        gates = [torch.zeros(n_slots, cfg.max_positions, device=dev) for _ in range(cfg.n_blocks)]
        holes = torch.zeros(n_slots, cfg.max_positions, device=dev)
        self.slots = [SlotDraft(DraftCache(k=[t[s:s + 1] for t in k], v=[t[s:s + 1] for t in v],
                                           log_gate=[g[s] for g in gates], holes=holes[s]),
                                runner._head.fresh()) for s in range(n_slots)]
        self.step_ms: float | None = None  # measured: one draft step for the slots that drafted together

    @property
    def feature_size(self) -> int:
        return self.runner.cfg.input_size

    def start(self, seq: int, prompt: list[int], reused: int, active: bool = True) -> None:
        """Slot ``seq`` takes a request: an empty cache past the ``reused`` prompt cells (skipped: no features),
        context rows for the prompt's tokens."""
        s = self.slots[seq]
        s.cache.n = 0
        s.head.clear()
        s.feats, s.tokens, s.active = [], [], active
        if not active:
            return
        s.head.add(prompt)
        self._use(s)
        self.runner.skip(min(reused, self.runner.max_positions))

    def stop(self, seq: int) -> None:
        self.slots[seq].active = False
        self.slots[seq].feats, self.slots[seq].tokens = [], []

    def feed(self, seq: int, features: np.ndarray, next_tokens: list[int]) -> None:
        """Real rows of slot ``seq``, in position order: the target's features [m, feature_size] of the rows it
        kept, and the token that followed each."""
        s = self.slots[seq]
        if not s.active or not next_tokens:
            return
        s.feats.append(np.asarray(features, dtype=np.float32).reshape(len(next_tokens), -1))
        s.tokens.extend(int(t) for t in next_tokens)
        s.head.add(next_tokens)
        if s.queued >= FLUSH_ROWS:
            self._read(s)

    def propose(self, seqs: list[int], k: int) -> dict[int, list[int]]:
        """``k`` greedy drafts for each slot of ``seqs`` that has real rows queued, reading them first."""
        out: dict[int, list[int]] = {}
        t0 = time.perf_counter()
        for seq in seqs:
            s = self.slots[seq]
            if not s.active or not s.queued or s.cache.n + s.queued + k > self.runner.max_positions:
                continue
            feats, tokens = np.concatenate(s.feats), s.tokens
            s.feats, s.tokens = [], []
            self._use(s)
            n_real = s.cache.n + len(tokens)
            try:
                out[seq] = self.runner.propose(feats, tokens, k)
            except DraftError:
                s.active = False  # its cells are full: the slot goes on without drafts
                continue
            self.runner.rollback(n_real)  # the drafted cells go; the real rows stay
        if out:
            ms = 1e3 * (time.perf_counter() - t0) / k
            self.step_ms = ms if self.step_ms is None else 0.8 * self.step_ms + 0.2 * ms
        return out

    def _read(self, s: SlotDraft) -> None:
        """Read the queued rows without proposing (a slot that has not drafted for a while)."""
        if s.cache.n + s.queued > self.runner.max_positions:
            s.active = False
            return
        self._use(s)
        self.runner.prefill(np.concatenate(s.feats), s.tokens)
        s.feats, s.tokens = [], []

    def _use(self, s: SlotDraft) -> None:
        """Point the runner at slot ``s``'s cache and context rows."""
        self.runner.cache, self.runner._head = s.cache, s.head
