"""Prompt-lookup proposals: continue the latest earlier occurrence of the text's last n tokens.

llama.cpp's lookup decoding, as a second source of drafts next to the draft model.  It
costs no draft forward, only verification rows, and it is right where text repeats:
code that reuses its own identifiers, answers that quote the prompt.  Measured on the
scale-10 cost-equivalent target, llama-cpp-python's prompt lookup ran at 1.12x of plain
decoding on HumanEval, where the draft model did not pay.  Auto sizing keeps its own
acceptance statistics for these proposals (``spec/policy.py``), per length of the match behind
them: on SmolLM2's greedy answers to the bench prompts the first proposed token was right 59%
of the time after a match of 2-3 tokens, 77% after 4-7 and 94% after 8 or more
(``scripts/replay_lookup.py``).
"""
from __future__ import annotations


class NgramLookup:
    """An index from every n-gram (``n_min`` <= n <= ``n_max``) to where it last continued."""

    def __init__(self, tokens: list[int] = (), n_min: int = 2, n_max: int = 4) -> None:
        if not 1 <= n_min <= n_max:
            raise ValueError(f"need 1 <= n_min <= n_max, not {n_min}, {n_max}")
        self.n_min, self.n_max = n_min, n_max
        self.tokens: list[int] = []
        self._next: dict[tuple[int, ...], int] = {}  # n-gram -> index of the token after its latest occurrence
        self.extend(tokens)

    def extend(self, tokens) -> None:
        """Append text; the n-grams that now have a continuation enter the index (latest wins)."""
        t = self.tokens
        for tok in tokens:
            t.append(int(tok))
            j = len(t) - 1  # the new token continues every n-gram that ends just before it
            for n in range(self.n_min, min(self.n_max, j) + 1):
                self._next[tuple(t[j - n : j])] = j

    def propose(self, k: int) -> list[int]:
        """Up to ``k`` tokens that followed the longest earlier match of the text's suffix; [] if none."""
        return self.propose_matched(k)[0]

    def propose_matched(self, k: int, longest: int = 64) -> tuple[list[int], int]:
        """``propose(k)`` and the length of the match behind it, counted back past ``n_max`` up to
        ``longest`` tokens (0 with no proposal): the longer the match, the likelier the proposal."""
        t = self.tokens
        end = len(t)
        for n in range(min(self.n_max, end), self.n_min - 1, -1):
            j = self._next.get(tuple(t[end - n :]))
            if j is not None:
                while n < longest and j - n > 0 and t[j - n - 1] == t[end - n - 1]:
                    n += 1
                return t[j : j + k], n
        return [], 0


def lookup_evidence(offered: list[int], depth: int, accepted: int, bonus: int, greedy: bool) -> tuple[int, int]:
    """(drafted depth, accepted) that a verified chain of the first ``depth`` tokens ``offered`` teaches:
    a greedy chain accepted whole also checks the next offered token against the ``bonus`` token, so
    the statistics learn one depth beyond what was verified."""
    if greedy and accepted == depth < len(offered):
        return depth + 1, depth + int(bonus == offered[depth])
    return depth, accepted
