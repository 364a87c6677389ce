"""Per-round records and their running aggregate; rendering is left to the callers."""
from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class Round:
    """One draft -> verify -> accept round.

    ``emitted`` counts the accepted draft tokens plus the one token the target
    contributes itself (the bonus, or the correction at the first mismatch); it is
    the "mean accepted length" convention of EAGLE/Dovetail papers.
    """

    drafted: int  # k draft tokens proposed this round
    accepted: int  # draft tokens the target agreed with (0..k)
    emitted: int  # tokens appended to the output this round (accepted + 1, less if a stop hit)
    draft_s: float  # wall time in the draft (prefill catch-up + proposals)
    verify_s: float  # wall time in the target decode
    overhead_s: float  # everything else: acceptance, rollback, bookkeeping
    bytes_to_target: int  # token ids sent to the target
    bytes_to_draft: int  # hidden-state rows (and their token ids) sent to the draft
    source: str = "draft"  # where the drafts came from: "draft" (the model), "lookup" (prompt lookup), "suffix"
    shadow: int = 0  # tokens a greedy probe drafted without verifying them (spec.shadow.ShadowChain)
    levels: int = 0  # draft-model forwards: a chain's k; a tree's first step and its batched forwards; 0 for copies
    draft_rows: int = 0  # rows of a tree's batched forwards after its first step (0 for chains and copies)


@dataclass
class RunStats:
    """Aggregate of one generation; ``observe`` each Round, then read or ``to_dict``."""

    prompt_tokens: int = 0
    new_tokens: int = 0  # every generated token, the one the prefill yields included
    prefill_s: float = 0.0
    stop_reason: str = ""
    rounds: list[Round] = field(default_factory=list)
    wall_s: float = 0.0
    kernels: str = ""  # llama.cpp's weight buffer types and the kernel plan (target.kernels.KernelPlan)

    def observe(self, r: Round) -> None:
        self.rounds.append(r)

    @property
    def mean_accepted_length(self) -> float:
        """Accepted draft tokens plus the bonus token per round (1.0 = no speedup from drafts)."""
        full = [r.accepted + 1 for r in self.rounds]
        return statistics.fmean(full) if full else 0.0

    @property
    def tokens_per_s(self) -> float:
        """Decode speed: tokens after the first (which the prefill yields) over the time after the prefill."""
        gen = self.wall_s - self.prefill_s
        return (self.new_tokens - 1) / gen if gen > 0 and self.new_tokens > 1 else 0.0

    def total(self, name: str) -> float:
        return sum(getattr(r, name) for r in self.rounds)

    def to_dict(self) -> dict:
        n = max(len(self.rounds), 1)
        return {
            "prompt_tokens": self.prompt_tokens,
            "new_tokens": self.new_tokens,
            "rounds": len(self.rounds),
            "stop_reason": self.stop_reason,
            "mean_accepted_length": self.mean_accepted_length,
            "tokens_per_s": self.tokens_per_s,
            "wall_s": self.wall_s,
            "prefill_s": self.prefill_s,
            "draft_s": self.total("draft_s"),
            "verify_s": self.total("verify_s"),
            "overhead_s": self.total("overhead_s"),
            "overhead_ms_per_round": 1e3 * self.total("overhead_s") / n,
            "bytes_to_target": self.total("bytes_to_target"),
            "bytes_to_draft": self.total("bytes_to_draft"),
            "accepted_histogram": _histogram([r.accepted for r in self.rounds]),
            "lookup_rounds": sum(r.source == "lookup" for r in self.rounds),
            "suffix_rounds": sum(r.source == "suffix" for r in self.rounds),
            "kernels": self.kernels,
        }

    def summary(self) -> str:
        d = self.to_dict()
        return (
            f"{d['new_tokens']} tokens in {d['wall_s']:.2f}s (prefill {d['prefill_s']:.2f}s, then "
            f"{d['tokens_per_s']:.1f} tok/s), "
            f"mean accepted length {d['mean_accepted_length']:.2f} over {d['rounds']} rounds, "
            f"stop: {d['stop_reason']}"
        )


def _histogram(values: list[int]) -> dict[int, int]:
    out: dict[int, int] = {}
    for v in values:
        out[v] = out.get(v, 0) + 1
    return dict(sorted(out.items()))


def round_to_dict(r: Round) -> dict:
    return asdict(r)
