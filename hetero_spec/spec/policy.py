"""How much to draft each round: a fixed size, or ``auto`` from the cost curve and acceptance.

Auto sizing maximises expected emitted tokens per millisecond::

    E(D) = 1 + sum_{i<=D} prod_{j<=i} alpha_j            (accepted drafts + the target's own token)
    T(D) = t_verify(rows(D)) + draft time of D depths     (from the calibrated cost curve)

over the drafting depth D (a chain's k, or a tree's depth with its width fixed), where
alpha_j is the running, exponentially decayed rate at which depth j is accepted once
depth j-1 was.  D = 0 is a plain round through the same loop; when speculation cannot pay
(an untrained draft: alpha ~ 0) auto settles there and only probes with one cheap drafted
round every ``probe_every`` rounds, so it stays close to plain speed.

T(D) is the calibrated curve corrected by what rounds actually cost: calibration times
the target and the draft each on its own, while in the loop they alternate and evict each
other's caches and spin each other's thread pools.  Measured on SmolLM2 Q4_0 (2 threads):
a one-draft round cost 2.1-2.3 t(1) against the curve's 1.58, so auto trusted the curve,
drafted at break-even and ran at 0.93-0.96x of plain decoding.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol


class Curve(Protocol):
    """What the policy needs of ``hetero_spec.calibration.CostCurve``."""

    draft_step_ms: float

    def verify_time_ms(self, n: int) -> float: ...
    def draft_rows_time_ms(self, n: int) -> float: ...


@dataclass(frozen=True)
class Shape:
    """One round's drafting: ``depth`` levels, ``width`` nodes per level, at most ``total`` nodes."""

    depth: int
    width: int = 1
    total: int = 0  # 0 = depth * width

    @property
    def tokens(self) -> int:
        full = self.depth * self.width
        return min(full, self.total) if self.total else full


class FixedPolicy:
    """The same shape every round (``--draft-len N`` or a fixed tree)."""

    def __init__(self, shape: Shape) -> None:
        self.shape = shape

    def choose(self) -> Shape:
        return self.shape

    def observe(self, drafted_depth: int, accepted: int) -> None:
        pass

    def expects_drafting(self) -> bool:
        return self.shape.depth > 0

    def observe_time(self, shape: Shape, rows_consumed: int, seconds: float) -> None:
        pass


@dataclass
class AcceptanceStats:
    """Per-depth acceptance with a Beta prior and exponential forgetting (recent text matters most)."""

    max_depth: int
    decay: float = 0.95
    prior: tuple[float, float] = (1.0, 1.0)  # pseudo-counts (accepted, rejected): alpha starts at 0.5
    reached: list[float] = field(default_factory=list)
    accepted: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.reached = [0.0] * (self.max_depth + 1)
        self.accepted = [0.0] * (self.max_depth + 1)

    def observe(self, drafted_depth: int, accepted: int) -> None:
        """One verified round: depths 1..min(accepted + 1, drafted_depth) were reached."""
        for d in range(1, self.max_depth + 1):
            self.reached[d] *= self.decay
            self.accepted[d] *= self.decay
        for d in range(1, min(accepted + 1, drafted_depth) + 1):
            self.reached[d] += 1.0
            self.accepted[d] += 1.0 if d <= accepted else 0.0

    def alpha(self, d: int) -> float:
        a0, b0 = self.prior
        return (self.accepted[d] + a0) / (self.reached[d] + a0 + b0)


def expected_emitted(alphas: list[float]) -> float:
    """1 + sum_i prod_{j<=i} alpha_j (alphas[0] is depth 1)."""
    total, run = 1.0, 1.0
    for a in alphas:
        run *= a
        total += run
    return total


def round_cost_ms(curve: Curve, shape: Shape) -> float:
    """Verification of the root plus the drafted tokens, plus one draft forward per depth."""
    if shape.depth == 0:
        return curve.verify_time_ms(1)
    draft = curve.draft_step_ms + sum(curve.draft_rows_time_ms(shape.width) for _ in range(shape.depth - 1))
    return curve.verify_time_ms(1 + shape.tokens) + draft


def best_shape(curve: Curve, alphas: list[float], width: int, total: int, max_depth: int,
               min_gain: float = 1.0, drafted_scale: float = 1.0) -> tuple[Shape, float]:
    """argmax over depth 0..max_depth of E / T; returns the shape and its tokens per ms.

    ``drafted_scale``: what drafted rounds really cost relative to plain rounds, each against
    the curve (``MeasuredCost.drafted_scale``).

    A drafted shape must beat plain rounds by the factor ``min_gain``: the cost model leaves
    out the round's bookkeeping and the draft's catch-up, and the acceptance rates are noisy
    estimates, so a shape that promises only a marginal gain loses in practice."""
    plain_rate = 1.0 / round_cost_ms(curve, Shape(0))
    best, best_rate = Shape(0, width, total), plain_rate
    for d in range(1, max_depth + 1):
        shape = Shape(d, width, total)
        rate = expected_emitted(alphas[:d]) / (drafted_scale * round_cost_ms(curve, shape))
        if rate > best_rate and rate >= min_gain * plain_rate:
            best, best_rate = shape, rate
    return best, best_rate


@dataclass
class MeasuredCost:
    """Running ratio of measured to modelled round time, for plain and for drafted rounds.

    Kept in log space with exponential forgetting; single observations are clipped, so a
    page fault or a noisy neighbour cannot swing the choice.  The draft's catch-up over the
    rows accumulated since it last ran is part of the model of the round it happens in."""

    decay: float = 0.9
    log_ratio: dict[bool, float] = field(default_factory=lambda: {False: 0.0, True: 0.0})
    seen: dict[bool, int] = field(default_factory=lambda: {False: 0, True: 0})

    def observe(self, drafted: bool, measured_ms: float, modelled_ms: float) -> None:
        if measured_ms <= 0 or modelled_ms <= 0:
            return
        r = min(max(math.log(measured_ms / modelled_ms), -0.7), 1.4)  # 0.5x .. 4x
        w = self.decay if self.seen[drafted] else 0.0
        self.log_ratio[drafted] = w * self.log_ratio[drafted] + (1 - w) * r
        self.seen[drafted] += 1

    @property
    def drafted_scale(self) -> float:
        """Drafted rounds' cost against the curve, relative to plain rounds' (1 until both are seen)."""
        if not (self.seen[False] and self.seen[True]):
            return 1.0
        return math.exp(self.log_ratio[True] - self.log_ratio[False])


class AutoPolicy:
    """Chooses the depth each round from the cost curve and the running acceptance statistics.

    While plain rounds win it probes with one cheap drafted round every ``probe_every`` plain
    rounds; each probe after which plain rounds still win doubles that gap (up to
    ``max_probe_gap``), since a probe costs a two-row verification and the draft's catch-up
    on every row since the last one; measured on SmolLM2 Q4_0, resetting the gap on any
    accepted probe kept auto at 0.95x of plain decoding with a draft accepted half the time.
    The gap resets once drafting is expected to pay.  Round times come back through
    ``observe_time`` and correct the curve (``MeasuredCost``).
    """

    def __init__(self, curve: Curve, *, width: int = 1, total: int = 0, max_depth: int = 8,
                 probe_every: int = 16, max_probe_gap: int = 128, decay: float = 0.95,
                 min_gain: float = 1.08) -> None:
        self.curve, self.width, self.total, self.max_depth = curve, width, total, max_depth
        self.stats = AcceptanceStats(max_depth, decay=decay)
        self.probe_every, self.max_probe_gap = probe_every, max_probe_gap
        # measured on SmolLM2 Q4_0 (2 threads): with min_gain 1.0 auto drafted on estimates
        # within a few % of break-even and ran at 0.92-0.95x of plain decoding
        self.min_gain = min_gain
        self._probe_gap = probe_every
        self._plain_streak = 0
        self._probing = False
        self._best_shape: Shape | None = None  # valid until the statistics change
        self.cost = MeasuredCost()
        self._scale_used = 1.0  # drafted_scale at the last search

    def _best(self) -> Shape:
        # Plain rounds leave the statistics alone, so a long plain stretch pays for this search
        # once instead of once per token (on a ~4 ms/token target that was about 1%).
        if self._best_shape is None:
            alphas = [self.stats.alpha(d) for d in range(1, self.max_depth + 1)]
            self._scale_used = self.cost.drafted_scale
            self._best_shape = best_shape(self.curve, alphas, self.width, self.total, self.max_depth,
                                          self.min_gain, self._scale_used)[0]
        return self._best_shape

    def expects_drafting(self) -> bool:
        return self._best().depth > 0

    def choose(self) -> Shape:
        shape = self._best()
        self._probing = False
        if shape.depth == 0:
            self._plain_streak += 1
            if self._plain_streak >= self._probe_gap:  # keep learning whether the draft got useful
                self._plain_streak = 0
                self._probing = True
                return Shape(1, 1)
            return shape
        self._plain_streak = 0
        self._probe_gap = self.probe_every  # drafting pays again: probe promptly once it stops paying
        return shape

    def observe(self, drafted_depth: int, accepted: int) -> None:
        if drafted_depth > 0:
            self.stats.observe(drafted_depth, accepted)
            self._best_shape = None
        if self._probing:  # the gap resets only once drafting is expected to pay again
            self._probe_gap = self.probe_every if self.expects_drafting() else min(2 * self._probe_gap,
                                                                                   self.max_probe_gap)

    def observe_time(self, shape: Shape, rows_consumed: int, seconds: float) -> None:
        """One round's wall time; ``rows_consumed``: real rows the draft caught up on in it."""
        modelled = round_cost_ms(self.curve, shape)
        if shape.depth > 0 and rows_consumed > 1:
            modelled += self.curve.draft_rows_time_ms(rows_consumed) - self.curve.draft_rows_time_ms(1)
        self.cost.observe(shape.depth > 0, 1e3 * seconds, modelled)
        if abs(math.log(self.cost.drafted_scale / self._scale_used)) > 0.03:
            self._best_shape = None  # plain rounds arrive every token: search again only on a real change

    @property
    def probe_gap(self) -> int:
        """Plain rounds before the next probe while plain rounds win."""
        return self._probe_gap
