"""Keep benchmark prompts out of training data: exact matches and shared word 8-grams.

WHY: a draft trained on the very prompts it is benchmarked on would report acceptance it
never earned.  ShareGPT holds copies of popular prompts (MT-Bench questions, HumanEval
stubs), so every user turn of a training conversation is compared with every turn of the
four shipped sets.
"""
from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass, field

from hetero_spec.bench.prompts import DATASETS, shipped_text

NGRAM = 8
_WORD = re.compile(r"\w+")


def _words(text: str) -> list[str]:
    return _WORD.findall(text.lower())


def _ngrams(words: list[str], n: int = NGRAM) -> set[tuple[str, ...]]:
    return {tuple(words[i : i + n]) for i in range(len(words) - n + 1)}


@dataclass
class BenchFilter:
    """Every turn of the shipped bench sets, as normalised texts and word 8-grams."""

    exact: set[str] = field(default_factory=set)
    grams: set[tuple[str, ...]] = field(default_factory=set)
    counts: Counter = field(default_factory=Counter)  # "exact" / "ngram" -> conversations dropped

    @classmethod
    def shipped(cls) -> "BenchFilter":
        f = cls()
        for name in DATASETS:
            for line in shipped_text(name).splitlines():
                if line.strip():
                    for turn in json.loads(line)["turns"]:
                        words = _words(turn)
                        f.exact.add(" ".join(words))
                        f.grams |= _ngrams(words)
        return f

    def reason(self, texts: list[str]) -> str | None:
        """'exact' or 'ngram' when any text matches a bench turn, else None."""
        for text in texts:
            words = _words(text)
            if " ".join(words) in self.exact:
                return "exact"
            if not self.grams.isdisjoint(_ngrams(words)):
                return "ngram"
        return None

    def keep(self, texts: list[str]) -> bool:
        why = self.reason(texts)
        if why is not None:
            self.counts[why] += 1
        return why is None
