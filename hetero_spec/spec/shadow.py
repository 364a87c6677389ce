"""Greedy proposals checked against the tokens the target emits next instead of verified rows.

Pure bookkeeping over token ids: the round loop (``spec.orchestrator``) opens a chain and feeds it
every emitted token; the chain reports to the callback it was opened with once it is settled.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable


@dataclass
class ShadowChain:
    """A greedy proposal checked against the tokens the target emits next, whatever kind of round
    emits them, instead of verified rows: a draft probe's chain, or a prompt-lookup proposal that a
    plain round left unverified (its whole chain, not just its first token, teaches the lookup
    statistics, so that their deeper estimates do not sit at the prior while lookup never runs).

    A probe that drafts one token teaches auto nothing about depths 2 and beyond, and a verified
    probe of k tokens costs a (k+1)-row decode (about 2.4 plain rounds on SmolLM2 Q4_0 for k=1).
    Checked this way, k tokens cost k draft steps (about 1 ms each) and no target row.  The
    evidence reaches the policy (``settle(depth, accepted)``: ``observe_probe``, or
    ``observe_lookup_chain`` for the match length behind the proposal) as one drafted round of depth
    k once the chain is settled: at the first mismatch, when every token matched, or, cut short by
    the end of the generation, for the depths that were checked."""

    guesses: list[int] = field(default_factory=list)
    matched: int = 0
    settle: Callable[[int, int], None] | None = None

    def open(self, guesses: list[int], settle: Callable[[int, int], None]) -> None:
        self.guesses, self.matched, self.settle = list(guesses), 0, settle

    def check(self, tokens: list[int]) -> None:
        for tok in tokens:
            if not self.guesses:
                return
            if tok != self.guesses[self.matched]:
                self._settle(len(self.guesses))
                return
            self.matched += 1
            if self.matched == len(self.guesses):
                self._settle(len(self.guesses))

    def close(self) -> None:
        if self.guesses and self.matched:
            self._settle(self.matched)
        self.guesses = []

    def _settle(self, depth: int) -> None:
        self.settle(depth, self.matched)
        self.guesses, self.matched = [], 0
