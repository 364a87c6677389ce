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
the target and the draft each on its own (plus the draft's switch, a step right after a
target decode: ``CostCurve.draft_switch_ms``), while in the loop they alternate and evict
each other's caches and spin each other's thread pools.  Measured on SmolLM2 Q4_0 (2 threads):
a one-draft round cost 2.1-2.3 t(1) against the curve's 1.58, so auto trusted the curve,
drafted at break-even and ran at 0.93-0.96x of plain decoding.

The acceptance estimates start from the draft's own held-out top-1 per unrolled step where
its file records one (``draft.checkpoint.read_held_out_acceptance``), forget slowly (0.98 per
drafted round), and probes stay frequent while drafting is estimated near break-even.  With a
0.5 prior, fast forgetting and one-deep probes, auto on the scale-10 target (2 threads, AVX-512
EPYC) drafted 21 rounds in 80 prompts while a fixed k=3 chain ran at 1.10x of plain decoding:
a bad streak stopped drafting, and the statistics, updated by rare probes only, stayed low.
"""
from __future__ import annotations

import math
from bisect import bisect_right
from dataclasses import dataclass, field
from typing import Protocol, Sequence

from ..calibration import SETTLE_ROUNDS


class Curve(Protocol):
    """What the policy needs of ``hetero_spec.calibration.CostCurve``."""

    draft_step_ms: float
    draft_switch_ms: float

    def verify_time_ms(self, n: int) -> float: ...
    def draft_rows_time_ms(self, n: int) -> float: ...


@dataclass(frozen=True)
class Shape:
    """One round's drafting: ``depth`` levels, ``width`` nodes per level, at most ``total`` nodes.

    ``source``: "draft" (the draft model), "lookup" (prompt lookup: a chain, no draft forward) or "suffix"
    (the suffix structure, ``spec/suffix.py``: a tree of ``total`` nodes, no draft forward)."""

    depth: int
    width: int = 1
    total: int = 0  # 0 = depth * width
    source: str = "draft"
    probe: bool = False  # asked for to learn the acceptance, not because it is expected to pay

    @property
    def kind(self) -> str:
        """What the round costs like: "plain", "draft" or "lookup"."""
        return "plain" if self.depth == 0 else self.source

    @property
    def tokens(self) -> int:
        full = self.depth * self.width
        return min(full, self.total) if self.total else full


class FixedPolicy:
    """The same shape every round (``--draft-len N`` or a fixed tree)."""

    lookup_depth = 0  # never proposes from prompt lookup
    suffix_depth = 0  # ... nor from the suffix structure

    def __init__(self, shape: Shape) -> None:
        self.shape = shape

    def choose(self, lookup: int = 0, match: int = 0, suffix: Sequence[int] = (), suffix_match: int = 0,
               suffix_boost: Sequence[float] = (), suffix_cached: bool = False) -> Shape:
        return self.shape

    def observe(self, drafted_depth: int, accepted: int, source: str = "draft") -> None:
        pass

    def observe_shadow(self, source: str, p_accept: float) -> None:
        pass

    def observe_probe(self, drafted_depth: int, accepted: int) -> None:
        pass

    def observe_lookup_chain(self, match: int, drafted_depth: int, accepted: int) -> None:
        pass

    def observe_suffix_chain(self, match: int, drafted_depth: int, accepted: int, cached: bool = False) -> None:
        pass

    def observe_suffix_tail(self, match: int, cached: bool, first: int, drafted_depth: int, accepted: int) -> None:
        pass

    def expects_drafting(self) -> bool:
        return self.shape.depth > 0

    def wants_rows(self, within: int) -> bool:
        return self.shape.depth > 0  # its rounds draft (a subclass may still keep the prompt rows lazy)

    def observe_time(self, shape: Shape, rows_consumed: int, seconds: float, kept_row: bool = False) -> None:
        pass


@dataclass
class AcceptanceStats:
    """Per-depth acceptance with a Beta prior and exponential forgetting (recent text matters most)."""

    max_depth: int
    decay: float = 0.95
    prior: tuple[float, float] = (1.0, 1.0)  # pseudo-counts (accepted, rejected): alpha starts at 0.5
    prior_alphas: tuple[float, ...] = ()  # per depth (1, 2, ...): a prior mean instead of 0.5, same weight
    reached: list[float] = field(default_factory=list)
    accepted: list[float] = field(default_factory=list)
    version: int = 0  # counts observations: a choice cached from these figures is stale once it moves

    def __post_init__(self) -> None:
        self.reached = [0.0] * (self.max_depth + 1)
        self.accepted = [0.0] * (self.max_depth + 1)
        weight = sum(self.prior)
        means = list(self.prior_alphas) or [self.prior[0] / weight]
        means += [means[-1]] * (self.max_depth - len(means))  # deeper than measured: the deepest figure
        self._priors = [self.prior] + [(weight * m, weight * (1.0 - m)) for m in means[: self.max_depth]]

    def observe(self, drafted_depth: int, accepted: int, first: int = 1) -> None:
        """One verified round: depths 1..min(accepted + 1, drafted_depth) were reached.  ``first`` > 1:
        evidence on depths ``first`` and beyond alone, whose earlier depths a round already counted (the
        unverified rest of a proposal that round accepted whole); it adds to that round and forgets nothing."""
        self.version += 1
        if first == 1:
            for d in range(1, self.max_depth + 1):
                self.reached[d] *= self.decay
                self.accepted[d] *= self.decay
        for d in range(first, min(accepted + 1, drafted_depth, self.max_depth) + 1):
            self.reached[d] += 1.0
            self.accepted[d] += 1.0 if d <= accepted else 0.0

    def observe_first(self, p_accept: float) -> None:
        """Evidence on depth 1 alone: a proposal checked against the target's own next token."""
        self.version += 1
        for d in range(1, self.max_depth + 1):
            self.reached[d] *= self.decay
            self.accepted[d] *= self.decay
        self.reached[1] += 1.0
        self.accepted[1] += p_accept

    def forget(self, keep: float) -> None:
        """Keep ``keep`` of the evidence (0: back to the prior), as ``decay`` does over rounds."""
        self.version += 1
        self.reached = [r * keep for r in self.reached]
        self.accepted = [a * keep for a in self.accepted]

    def alpha(self, d: int) -> float:
        a0, b0 = self._priors[d]
        return (self.accepted[d] + a0) / (self.reached[d] + a0 + b0)


def expected_emitted(alphas: list[float]) -> float:
    """1 + sum_i prod_{j<=i} alpha_j (alphas[0] is depth 1)."""
    total, run = 1.0, 1.0
    for a in alphas:
        run *= a
        total += run
    return total


def round_cost_ms(curve: Curve, shape: Shape) -> float:
    """Verification of the root plus the drafted tokens, plus one draft forward per depth and the
    first one's switch from the target (none for lookup)."""
    if shape.depth == 0:
        return curve.verify_time_ms(1)
    if shape.source in ("lookup", "suffix"):
        return curve.verify_time_ms(1 + shape.tokens)
    draft = curve.draft_step_ms + curve.draft_switch_ms
    draft += sum(curve.draft_rows_time_ms(shape.width) for _ in range(shape.depth - 1))
    return curve.verify_time_ms(1 + shape.tokens) + draft


def break_even(curve: Curve, k: int, source: str = "draft") -> float:
    """The mean accepted length (tokens a round) at which chains of ``k`` drafts from ``source`` match plain
    decoding on ``curve``: such a round's cost in one-row decodes.  A property of the machine alone, so a user
    can set it beside a draft's measured acceptance before training or running one."""
    return round_cost_ms(curve, Shape(k, source=source)) / round_cost_ms(curve, Shape(0))


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
    """Running ratio of measured to modelled round time, per kind of round (``Shape.kind``).

    Kept in log space with exponential forgetting; single observations are clipped, so a
    page fault or a noisy neighbour cannot swing the choice.  The draft's catch-up over the
    rows accumulated since it last ran is part of the model of the round it happens in."""

    decay: float = 0.9
    log_ratio: dict[str, float] = field(default_factory=dict)
    seen: dict[str, int] = field(default_factory=dict)

    def observe(self, kind: str, measured_ms: float, modelled_ms: float) -> None:
        """Plain rounds: their ratio to the curve.  Other kinds: their ratio *relative to plain
        rounds' at the time*, so that a machine whose speed drifts (turbo, thermal limits, a busy
        neighbour) moves every kind at once.  Kept absolute, a kind that stopped running kept the
        ratio of a slow spell while plain rounds sped up, looked dearer and dearer, and never ran
        again to correct it: measured on a VM whose plain decoding sped up 1.4x during a bench,
        auto stopped using prompt lookup for its last 40 prompts."""
        if measured_ms <= 0 or modelled_ms <= 0:
            return
        r = min(max(math.log(measured_ms / modelled_ms), -0.7), 1.4)  # 0.5x .. 4x
        if kind != "plain":
            r -= self.log_ratio.get("plain", 0.0)
        # Plain rounds (settled ones only, ``AutoPolicy.observe_time``) start from the mean of their first
        # figures, so that the other kinds are soon measured against them.  The other kinds start from the
        # curve, as if it had been measured: a kind's first figure alone set it before, and one slow round
        # (the first after a long prompt's prefill cost 2.3x its curve) then priced the kind out for good,
        # since a kind that is not chosen is not measured again.
        n = self.seen.get(kind, 0)
        w = min(self.decay, n / (n + 1)) if kind == "plain" else self.decay
        self.log_ratio[kind] = w * self.log_ratio.get(kind, 0.0) + (1 - w) * r
        self.seen[kind] = n + 1

    def scale(self, kind: str) -> float:
        """Rounds of ``kind``: their cost against the curve relative to plain rounds' (1 until both are seen)."""
        if kind == "plain" or not (self.seen.get("plain") and self.seen.get(kind)):
            return 1.0
        return math.exp(self.log_ratio[kind])

    @property
    def drafted_scale(self) -> float:
        return self.scale("draft")


@dataclass
class Backoff:
    """Probe once every ``gap`` eligible rounds; the gap doubles after each probe that leaves the
    probed source not paying, up to ``max_gap``, and resets once it pays."""

    first: int
    max_gap: int
    gap: int = 0
    streak: int = 0

    def __post_init__(self) -> None:
        self.gap = self.first

    def due(self) -> bool:
        self.streak += 1
        if self.streak >= self.gap:
            self.streak = 0
            return True
        return False

    def settle(self, pays: bool, cap: int | None = None, restart: int | None = None) -> None:
        """``cap``: the longest gap allowed now (``max_gap`` if None); ``restart``: the gap when it pays
        (``first`` if None)."""
        self.gap = (restart or self.first) if pays else min(2 * self.gap, cap or self.max_gap)

    def reset(self, restart: int | None = None) -> None:
        self.streak, self.gap = 0, restart or self.first

    @property
    def rounds_to_due(self) -> int:
        """Eligible rounds until the probe (1: the next one)."""
        return self.gap - self.streak


# The share of the draft's acceptance evidence a new request starts with.  Acceptance differs more between
# prompts than within one: the shipped darter's first mt_bench prompt left depth 1 at 0.2, which kept the
# draft off through the whole next prompt, where the fixed chain ran at 1.29x (auto 1.21x, on lookup).
# With a quarter kept, auto on mt_bench went from 1.07x to 1.18x, the fixed chain's figure in the same
# run (SmolLM2 Q4_0, 2 threads, docs/bench.md); with none kept, a user's bad domain would cost every request
# its first rounds.
NEW_TEXT_KEEP = 0.25
BREAK_EVEN_BAND = 0.95  # drafting estimated at least this fraction of plain speed keeps probes frequent
# Draft probes back off only while they cost more than this share of the plain rounds between them, priced
# at what a probe costs (``AutoPolicy._probe_cost_ms``: its draft forwards, its catch-up and the rounds that
# keep rows for it).  On the scale-10 target (a step 0.03 t(1)) the gap then stays at 16-28 rounds:
# backing off to 128 only froze the statistics there, and after a bad streak on mt_bench auto drafted
# no round in the next 60 prompts (one probe a prompt, docs/bench.md).  On SmolLM2 Q4_0 (a step
# 0.3 t(1)) the gap still grows to 128.
PROBE_BUDGET = 0.005
# Near break-even, where the estimate decides and a bad streak would freeze it, draft probes may take this
# share of the plain rounds' time; elsewhere ``PROBE_BUDGET``.  Both price a probe at what it really costs
# (``_probe_cost_ms``): on the scale-10 target that leaves the first gap (16 rounds); on SmolLM2 Q4_0 on
# a host where 2 rows cost 2.4 decodes, a probe cost 2 decodes in all, and probes every 16 rounds put auto
# 3-6 points behind lookup alone.
NEAR_BREAK_EVEN_PROBE_BUDGET = 0.02
# Most rows a draft catches up on before it drafts; older pending rows become holes.  After a
# plain stretch auto probes with one drafted round, and catching up on all 128 rows since
# the last probe took 6.2 ms against 1.0 ms for 8 and 2.0 ms for 32 (eagle draft, 1 thread):
# most of the probe's cost.  An EAGLE-style draft leans on the recent rows.
CATCHUP_ROWS = 16
# Prompt-lookup statistics are kept apart by the length of the match behind a proposal (the lower
# bounds of the buckets, in tokens): on SmolLM2's greedy answers to the bench prompts the first
# proposed token was right 59% of the time after a match of 2-3 tokens, 77% after 4-7 and 94% after
# 8 or more (the mean run of right tokens 2.8, 4.5 and 9.1).  Pooled, the estimate sat near the
# short matches' rate; and with only first tokens checked on plain rounds, depth 2 and beyond kept
# their 0.5 prior.  Replayed on the scale-10 curve (scripts/replay_lookup.py), auto then ran
# 1 lookup round in 90 prompts; kept apart, with whole proposals checked (``observe_lookup_chain``),
# 818, at 1.085x plain speed on average over the prompts (1.00x before).
LOOKUP_MATCH_BUCKETS = (0, 4, 8)


def lookup_bucket(match: int) -> int:
    """The index in ``LOOKUP_MATCH_BUCKETS`` of a proposal behind a match of ``match`` tokens."""
    return bisect_right(LOOKUP_MATCH_BUCKETS, match, 1) - 1


# The suffix structure's statistics, per length of the match behind a proposal, like prompt lookup's; its
# matches run longer (it counts back 32 tokens, and matches in past outputs often run that far).  Kept apart
# again for proposals that come from past outputs only: on gsm8k a long match in another problem's answer
# ("so she sold ...") continues with that problem's numbers, while in agentic replay it is the answer.
SUFFIX_MATCH_BUCKETS = (0, 4, 8, 16)


# What auto believes of each suffix bucket before it has seen a round of it: the conditional acceptance per
# depth (1, 2, ...; deeper ones take the last figure) of the proposed chain, measured over SmolLM2 Q4_0's
# greedy answers to 20 prompts of each of the 7 bench sets (``scripts/replay_suffix.py``, docs/suffix.md).  A
# match of 16 or more in the request's own text continued right 98-99% of the time at every depth, a match
# of 2-3 tokens in past outputs 30% at the first; with every bucket at 0.5, auto verified its first long
# copies 3 deep (the 4-row round the 0.5 prior allows) and learnt the deeper depths only from rounds that
# reached them.  The prior weighs as two rounds (``AcceptanceStats.prior``), so a workload's own rates take
# over within a few rounds.
SUFFIX_PRIOR_ALPHAS = (
    (0.55, 0.65, 0.8), (0.75, 0.8, 0.85, 0.9), (0.9, 0.92, 0.93), (0.98,),  # the request's own text
    (0.3, 0.35, 0.6), (0.45, 0.6, 0.7, 0.75, 0.8), (0.75, 0.83, 0.85), (0.93, 0.95),  # past outputs alone
)


def suffix_bucket(match: int, cached: bool = False) -> int:
    """The index of the statistics of a proposal behind a match of ``match`` tokens: ``SUFFIX_MATCH_BUCKETS``'
    for the request's own text, the same again after them for past outputs alone (``cached``)."""
    return bisect_right(SUFFIX_MATCH_BUCKETS, match, 1) - 1 + (len(SUFFIX_MATCH_BUCKETS) if cached else 0)


class AutoPolicy:
    """Chooses each round's source and depth from the cost curve and running acceptance statistics.

    Two sources: the draft model (chains, or trees of ``width``) and, with ``lookup_depth``
    > 0, prompt lookup, whose chains cost verification rows only and which the caller offers
    with the number of tokens it found and the length of the match behind them
    (``choose(lookup=n, match=m)``).  Each keeps its own acceptance statistics, lookup's per
    match-length bucket (``LOOKUP_MATCH_BUCKETS``).  While plain rounds win, each source is probed with one cheap
    round every ``probe_every`` eligible rounds; each probe after which it still does not
    pay doubles that gap (up to ``max_probe_gap``), since a probe costs a two-row
    verification (and the draft's catch-up); measured on SmolLM2 Q4_0, resetting the gap on
    any accepted probe kept auto at 0.95x of plain decoding with a draft accepted half the
    time.  Round times come back through ``observe_time`` and correct the curve
    (``MeasuredCost``).

    A third source, with ``suffix_depth`` > 0: the suffix structure's trees (``spec/suffix.py``), offered
    per round as their node counts per depth (``choose(suffix=sizes, suffix_match=m)``), priced as
    verification rows only, with statistics per match bucket (``SUFFIX_MATCH_BUCKETS``) and probes like
    lookup's.  ``max_depth`` 0: there is no draft model, and the policy never drafts or probes with one.
    """

    def __init__(self, curve: Curve, *, width: int = 1, total: int = 0, max_depth: int = 8,
                 probe_every: int = 16, max_probe_gap: int = 128, decay: float = 0.95, draft_decay: float = 0.98,
                 min_gain: float = 1.08, lookup_depth: int = 0, prior_alphas: tuple[float, ...] = (),
                 probe_budget: float | None = PROBE_BUDGET, suffix_depth: int = 0, suffix_nodes: int = 12) -> None:
        self.curve, self.width, self.total, self.max_depth = curve, width, total, max_depth
        # The draft's own held-out acceptance per depth, where its file records one: a trained draft
        # starts where training left it, not at 0.5, which undervalues every depth past the first.
        # Its statistics forget more slowly than lookup's (whose acceptance follows the text):
        # at 0.95 (about 20 rounds' memory) the estimate of a draft near break-even swung across it
        # and drafting stopped on a bad streak (simulated on the scale-10 curve: 1.02-1.17x against
        # 1.18-1.22x at 0.98, the fixed best shape 1.22x).
        self.stats = AcceptanceStats(max_depth, decay=draft_decay, prior_alphas=prior_alphas)
        self.lookup_depth = lookup_depth
        self.lookup_buckets = [AcceptanceStats(max(1, lookup_depth), decay=decay) for _ in LOOKUP_MATCH_BUCKETS]
        self._bucket = 0  # the match-length bucket of the lookup proposal offered this round
        # measured on SmolLM2 Q4_0 (2 threads): with min_gain 1.0 auto drafted on estimates
        # within a few % of break-even and ran at 0.92-0.95x of plain decoding
        self.min_gain = min_gain
        self.probe_budget = probe_budget  # None: draft probes back off to max_probe_gap whatever they cost
        self._draft_probe = Backoff(probe_every, max_probe_gap)
        self._lookup_probe = Backoff(probe_every, max_probe_gap)
        self._probing = ""  # the source of the probe just handed out
        self._lookup_shadowed = False  # unverified lookup proposals are being checked for free
        self._best_shape: Shape | None = None  # valid until the statistics change
        self._best_rate = 0.0
        # ``_best_lookup`` per match bucket (with the version of its statistics), for each number of tokens
        # offered, valid until those statistics or lookup's measured cost change: a proposal is offered
        # on most plain rounds, and searching its depths every time cost about 25 us of a SmolLM2 Q4_0
        # round (cache-cold after the decode).  The curve's part of each depth's cost never changes.
        self._lookup_best: list[tuple[int, list[tuple[Shape, float]]] | None] = [None] * len(LOOKUP_MATCH_BUCKETS)
        self._lookup_cost_ms = [round_cost_ms(curve, Shape(d, source="lookup")) for d in range(lookup_depth + 1)]
        # per match bucket, with its statistics' version: whether lookup would pay at the curve's cost alone
        self._lookup_at_curve: list[tuple[int, bool] | None] = [None] * len(LOOKUP_MATCH_BUCKETS)
        self.cost = MeasuredCost()
        self._scale_used = 1.0  # drafted_scale at the last search
        self._t1_ms = curve.verify_time_ms(1)
        self._since_wide = 0  # plain rounds since the last decode wider than one row (a round's, or a prompt's)
        # The suffix structure (``spec/suffix.py``): trees of up to ``suffix_nodes`` nodes, statistics per
        # match bucket of the depth along the tree a round reached, and probes like lookup's.  max_depth 0
        # means there is no draft model: the copy sources alone, and never a draft probe.
        self.suffix_depth = suffix_depth
        self.suffix_buckets = [AcceptanceStats(max(1, suffix_depth), decay=decay, prior_alphas=prior)
                               for prior in SUFFIX_PRIOR_ALPHAS]
        self._suffix_bucket = 0
        self._suffix_probe = Backoff(probe_every, max_probe_gap)
        self._suffix_shadowed = False
        self._suffix_emitted: list[tuple[int, list[float]] | None] = [None] * len(self.suffix_buckets)
        self._verify_ms = ([0.0] + [curve.verify_time_ms(n) for n in range(1, max(suffix_nodes, suffix_depth) + 2)]
                           if suffix_depth else [])

    def _best(self) -> Shape:
        # Plain rounds leave the statistics alone, so a long plain stretch pays for this search
        # once instead of once per token (on a ~4 ms/token target that was about 1%).
        if self._best_shape is None:
            alphas = [self.stats.alpha(d) for d in range(1, self.max_depth + 1)]
            self._scale_used = self.cost.drafted_scale
            self._best_shape, self._best_rate = best_shape(self.curve, alphas, self.width, self.total,
                                                           self.max_depth, self.min_gain, self._scale_used)
        return self._best_shape

    @property
    def _round_lookup_stats(self) -> AcceptanceStats:
        """The lookup statistics for this round's proposal: the bucket ``choose`` found it in."""
        return self.lookup_buckets[self._bucket]

    def _best_lookup(self, available: int) -> tuple[Shape, float]:
        """The best lookup chain of at most ``available`` tokens, or Shape(0) if none beats plain by min_gain."""
        known, version = self._lookup_best[self._bucket], self._round_lookup_stats.version
        if known is None or known[0] != version:
            known = self._lookup_best[self._bucket] = (version, self._search_lookup(self.cost.scale("lookup")))
        table = known[1]
        return table[max(0, min(available, len(table) - 1))]

    def _search_lookup(self, scale: float) -> list[tuple[Shape, float]]:
        """``_best_lookup`` for every ``available`` from 0 to ``lookup_depth``, in one pass over the depths, with
        lookup's rounds at ``scale`` times their curve cost (1: the curve's alone)."""
        plain_rate = 1.0 / self._lookup_cost_ms[0]
        best, best_rate = Shape(0), plain_rate
        alphas = [self._round_lookup_stats.alpha(d) for d in range(1, self.lookup_depth + 1)]
        table = [(best, best_rate)]
        for d in range(1, self.lookup_depth + 1):
            rate = expected_emitted(alphas[:d]) / (scale * self._lookup_cost_ms[d])
            if rate > best_rate and rate >= self.min_gain * plain_rate:
                best, best_rate = Shape(d, source="lookup"), rate
            table.append((best, best_rate))
        return table

    def _lookup_priced_out(self) -> bool:
        """Whether this round's lookup statistics would pay at the curve's cost but not at the measured one.

        WHY: greedy rounds check lookup's proposals against the target's own tokens for free
        (``observe_lookup_chain``), so its acceptance stays current without probes; but its cost is measured
        only on rounds that run it.  Once the measured cost drifts past break-even, no lookup round runs and
        nothing measures it again: in one bench run (SmolLM2 Q4_0, a host where 2 rows cost 2 decodes) auto
        copied in 26 rounds, none after its 9th prompt, where lookup alone copied in 377.  Then probes, on
        lookup's backoff, measure the cost again.  Cached per bucket until its statistics change."""
        known, version = self._lookup_at_curve[self._bucket], self._round_lookup_stats.version
        if known is None or known[0] != version:
            known = self._lookup_at_curve[self._bucket] = (version, self._search_lookup(1.0)[-1][0].depth > 0)
        return known[1] and self._best_lookup(self.lookup_depth)[0].depth == 0

    def _best_suffix(self, sizes: Sequence[int], boost: Sequence[float] = ()) -> tuple[Shape, float]:
        """The best depth of this round's suffix proposal, as its most probable path (a chain: Shape(d, 1, d))
        or as its tree (``sizes[d]``: nodes of depth <= d; Shape(d, sizes[d], sizes[d])), or Shape(0) if none
        beats plain rounds by ``min_gain``.

        The statistics are the chain's (what the chain would have accepted, tree rounds included); a tree
        is expected to reach depth j ``boost[j]`` times as often (``SuffixProposal.boost``), capped by its
        reach one level up.  On a CPU a verified row costs a good part of a decode, so a sibling must be
        likely to pay for its row.  Without ``boost`` the tree is priced at the chain's acceptance.  A few
        microseconds: the reach per depth is kept per bucket until its statistics change, and the curve's
        times are precomputed."""
        stats, b = self.suffix_buckets[self._suffix_bucket], self._suffix_bucket
        known = self._suffix_emitted[b]
        if known is None or known[0] != stats.version:
            reach = [1.0]
            for d in range(1, self.suffix_depth + 1):
                reach.append(reach[-1] * stats.alpha(d))
            known = self._suffix_emitted[b] = (stats.version, reach)
        reach, scale, verify = known[1], self.cost.scale("suffix"), self._verify_ms
        t = lambda n: scale * (verify[n] if n < len(verify) else self.curve.verify_time_ms(n))
        plain_rate = 1.0 / self._t1_ms
        best, best_rate = Shape(0), plain_rate
        chain_emitted = tree_emitted = 1.0
        tree_reach = 1.0
        # the chain may run deeper than the tree (whose nodes are capped): past the tree's depth it stands alone
        for d in range(1, min(max(len(sizes), len(boost)), self.suffix_depth + 1)):
            chain_emitted += reach[d]
            options = []
            if d < len(sizes):
                tree_reach = min(tree_reach, reach[d] * (boost[d] if d < len(boost) else 1.0))
                tree_emitted += tree_reach
                options.append((tree_emitted / t(1 + sizes[d]), Shape(d, sizes[d], sizes[d], source="suffix")))
            if d < len(boost) and (d >= len(sizes) or sizes[d] > d):
                options.append((chain_emitted / t(1 + d), Shape(d, 1, d, source="suffix")))
            for rate, shape in options:
                if rate > best_rate and rate >= self.min_gain * plain_rate:
                    best, best_rate = shape, rate
        return best, best_rate

    def _best_drafted(self, width: int, total: int, scale: float) -> tuple[int, float]:
        """The best drafting depth (at least 1) and its tokens per ms, with no plain-round
        alternative and no margin: what a probe needs, where ``best_shape`` answers "plain"."""
        alphas = [self.stats.alpha(d) for d in range(1, self.max_depth + 1)]
        rates = {d: expected_emitted(alphas[:d]) / (scale * round_cost_ms(self.curve, Shape(d, width, total)))
                 for d in range(1, self.max_depth + 1)}
        best = max(rates, key=rates.get)
        return best, rates[best]

    def _probe_depth(self) -> int:
        """The depth a draft probe drafts to: the best chain on the curve alone (no margin, no
        measured correction).  A probe only one deep teaches nothing about depths 2 and beyond.
        (A greedy chain probe drafts this deep too, but verifies nothing: the target's next tokens
        check it, ``spec.shadow.ShadowChain``.)"""
        return self._best_drafted(1, 0, 1.0)[0]

    def _probe_cost_ms(self) -> float:
        """What a draft probe adds to plain decoding: its draft forwards, the catch-up over the
        ``CATCHUP_ROWS`` rows before it, and those rows' rounds, which keep their hidden states for it
        (measured against plain rounds: the "kept" kind of ``MeasuredCost``)."""
        depth = self._probe_depth()
        draft_ms = round_cost_ms(self.curve, Shape(depth)) - self.curve.verify_time_ms(1 + depth)
        catch_up_ms = self.curve.draft_rows_time_ms(CATCHUP_ROWS) - self.curve.draft_rows_time_ms(1)
        keep_ms = CATCHUP_ROWS * self._t1_ms * max(0.0, self.cost.scale("kept") - 1.0)
        return draft_ms + catch_up_ms + keep_ms

    def _probe_gap(self, budget: float) -> int:
        """The gap between draft probes at which they cost ``budget`` of the plain rounds between them
        (within ``probe_every`` .. ``max_probe_gap``)."""
        gap = math.ceil(self._probe_cost_ms() / (budget * self._t1_ms))
        return min(self._draft_probe.max_gap, max(self._draft_probe.first, gap))

    def _probe_gap_cap(self) -> int | None:
        """The longest gap between draft probes worth having: the one at which probes cost
        ``probe_budget`` of the plain rounds between them (never below ``probe_every``).  Rarer
        probes would save almost nothing and leave the acceptance statistics stale."""
        return self._probe_gap(self.probe_budget) if self.probe_budget else None

    def _probe_restart(self) -> int:
        """The probe gap while the draft pays or is near paying: the first gap while it is expected to
        draft, else the one at which probes cost ``NEAR_BREAK_EVEN_PROBE_BUDGET`` of the time."""
        return self._draft_probe.first if self.expects_drafting() else self._probe_gap(NEAR_BREAK_EVEN_PROBE_BUDGET)

    def _settle_draft_probe(self) -> None:
        near = self.expects_drafting() or self._near_break_even()
        self._draft_probe.settle(near, self._probe_gap_cap(), self._probe_restart() if near else None)

    def _near_break_even(self) -> bool:
        """Whether the best drafted shape, at the measured cost, is within ``BREAK_EVEN_BAND`` of plain
        rounds.  There the estimate decides, and it is noisy: a bad streak stops drafting and then
        freezes the statistics low, since only probes update them.  Near break-even probing stays as
        frequent as its cost allows (``_probe_restart``); far below it, the gap doubles."""
        rate = self._best_drafted(self.width, self.total, self.cost.drafted_scale)[1]
        return rate >= BREAK_EVEN_BAND / round_cost_ms(self.curve, Shape(0))

    def new_text(self) -> None:
        """A request starts: the draft's statistics keep ``NEW_TEXT_KEEP`` of their evidence, and, where the
        draft is then within reach of paying, its probes are due at the first gap again.  The statistics still
        persist across requests (a draft that fails on a user's domain stays off after a few rounds), but one
        text's streak no longer decides the next.  Where even the lightened evidence leaves drafting far below
        plain rounds, as on a machine whose verified rows cost nearly a decode each, the probes keep their
        grown gap: reset every request, they cost auto 1-3% of a 128-token answer there (a probe's catch-up
        and the rounds that keep rows for it), and they cannot find a draft that pays."""
        self.stats.forget(NEW_TEXT_KEEP)
        self._best_shape = None
        self._since_wide = 0  # the prompt's decode
        if self.max_depth and (self.expects_drafting() or self._near_break_even()):
            self._draft_probe.reset(self._probe_restart())

    def expects_drafting(self) -> bool:
        """Whether the draft model is expected to run soon (it then needs the prompt's rows)."""
        return self._best().depth > 0

    def wants_rows(self, within: int) -> bool:
        """Whether the draft model will want the hidden state of a plain round now: drafting is expected,
        or its next probe is at most ``within`` rounds away (a probe catches up on that many recent
        rows at most, older ones are holes anyway).  Other plain rounds decode without embeddings,
        as plain decoding does (measured on SmolLM2 Q4_0, 2 threads: rounds with embeddings on ran at
        0.975x of the raw loop)."""
        return self.expects_drafting() or (self.max_depth > 0 and self._draft_probe.rounds_to_due <= within)

    def choose(self, lookup: int = 0, match: int = 0, suffix: Sequence[int] = (), suffix_match: int = 0,
               suffix_boost: Sequence[float] = (), suffix_cached: bool = False) -> Shape:
        """This round's shape; ``lookup``: tokens prompt lookup offers this round (0: no match);
        ``match``: the length of the match behind them (``NgramLookup.propose_matched``);
        ``suffix``: the suffix structure's tree this round, as its nodes of depth <= d for each d
        (``SuffixProposal.sizes``; () without a proposal); ``suffix_match``: the match behind it;
        ``suffix_boost``: ``SuffixProposal.boost``, which lets a chain of its most probable path compete;
        ``suffix_cached``: it comes from past outputs alone (``SuffixProposal.cached``)."""
        shape = self._best()
        self._probing = ""
        self._bucket = lookup_bucket(match)
        if len(suffix) > 1 and self.suffix_depth:
            self._suffix_bucket = suffix_bucket(suffix_match, suffix_cached)
            sshape, srate = self._best_suffix(suffix, suffix_boost)
            if sshape.depth and srate > self._best_rate:
                self._suffix_probe.reset()
                return sshape
            if shape.depth == 0 and not self._suffix_shadowed and self._suffix_probe.due():
                self._probing = "suffix"
                return Shape(1, 1, 1, source="suffix", probe=True)
        if lookup and self.lookup_depth:
            lshape, lrate = self._best_lookup(min(lookup, self.lookup_depth))
            if lshape.depth and lrate > self._best_rate:
                self._lookup_probe.reset()
                return lshape
            if (shape.depth == 0 and (not self._lookup_shadowed or self._lookup_priced_out())
                    and self._lookup_probe.due()):
                self._probing = "lookup"
                return Shape(1, source="lookup", probe=True)
        if shape.depth == 0:
            if self.max_depth and self._draft_probe.due():  # keep learning whether the draft got useful
                self._probing = "draft"
                return Shape(self._probe_depth(), 1, probe=True)
            return shape
        self._draft_probe.reset()  # drafting pays again: probe promptly once it stops paying
        return shape

    def observe(self, drafted_depth: int, accepted: int, source: str = "draft") -> None:
        if drafted_depth > 0:
            if source == "suffix":
                self.suffix_buckets[self._suffix_bucket].observe(drafted_depth, accepted)
            else:
                (self._round_lookup_stats if source == "lookup" else self.stats).observe(drafted_depth, accepted)
            if source == "draft":
                self._best_shape = None
        if self._probing == "draft":  # the gap grows only while drafting is clearly not worth it
            self._settle_draft_probe()
        elif self._probing == "lookup":
            self._lookup_probe.settle(self._best_lookup(self.lookup_depth)[0].depth > 0)
        elif self._probing == "suffix":  # whether a chain as deep as allowed would pay at this match length
            self._suffix_probe.settle(self._best_suffix(range(self.suffix_depth + 1))[0].depth > 0)

    def observe_suffix_chain(self, match: int, drafted_depth: int, accepted: int, cached: bool = False) -> None:
        """A greedy suffix proposal's most probable path, ``drafted_depth`` tokens behind a match of ``match``
        tokens, that no round verified: the target's own tokens would have accepted ``accepted`` of them
        (``spec.shadow.ShadowChain``).  The suffix source needs no probes while this arrives."""
        self.suffix_buckets[suffix_bucket(match, cached)].observe(drafted_depth, accepted)
        self._suffix_shadowed = True

    def observe_suffix_tail(self, match: int, cached: bool, first: int, drafted_depth: int, accepted: int) -> None:
        """The rest of a greedy suffix chain, from depth ``first`` on, after a round that accepted every token
        before it (its verified rows and the bonus token): the target's next tokens would have accepted
        ``accepted`` of its first ``drafted_depth`` tokens (``spec.shadow.ShadowChain``).  WHY: a round
        teaches one depth past what it verified, so a depth auto does not verify yet learns only one round
        at a time; with 0.5 at every depth, auto verified 3 tokens a round on agentic replay (SmolLM2 Q4_0)
        where 3 of 3 were accepted in most rounds.  Where a workload's rates differ from the priors
        (``SUFFIX_PRIOR_ALPHAS``), this is how the deep depths catch up, at no row's cost."""
        self.suffix_buckets[suffix_bucket(match, cached)].observe(first - 1 + drafted_depth, first - 1 + accepted,
                                                                  first=first)

    def observe_probe(self, drafted_depth: int, accepted: int) -> None:
        """The settled evidence of a greedy shadow probe handed out earlier (``spec.shadow.
        ShadowChain``): its chain of ``drafted_depth`` tokens would have had ``accepted`` accepted.
        It arrives once the target's own tokens have settled it, possibly rounds later."""
        self.stats.observe(drafted_depth, accepted)
        self._best_shape = None
        self._settle_draft_probe()

    def observe_lookup_chain(self, match: int, drafted_depth: int, accepted: int) -> None:
        """A greedy prompt-lookup proposal of ``drafted_depth`` tokens, behind a match of ``match``
        tokens, that no round verified: the target's own tokens would have accepted ``accepted`` of
        them (``spec.shadow.ShadowChain``).  Lookup needs no probes while this arrives."""
        self.lookup_buckets[lookup_bucket(match)].observe(drafted_depth, accepted)
        self._lookup_shadowed = True

    def observe_shadow(self, source: str, p_accept: float) -> None:
        """A plain round checked the first token of a proposal of ``source`` it did not verify:
        ``p_accept`` is the probability verification would have accepted it (sampled rounds; greedy
        lookup proposals are checked whole, ``observe_lookup_chain``).  Lookup needs no probes while
        this arrives."""
        if source == "suffix":
            self.suffix_buckets[self._suffix_bucket].observe_first(p_accept)
            self._suffix_shadowed = True
            return
        (self._round_lookup_stats if source == "lookup" else self.stats).observe_first(p_accept)
        if source == "lookup":
            self._lookup_shadowed = True
        else:
            self._best_shape = None

    def observe_time(self, shape: Shape, rows_consumed: int, seconds: float, kept_row: bool = False) -> None:
        """One round's wall time; ``rows_consumed``: real rows the draft caught up on in it; ``kept_row``: a
        plain round that kept its hidden state for the draft (``wants_rows``), measured as the "kept" kind,
        what a probe's rows cost (``_probe_cost_ms``).

        The ``SETTLE_ROUNDS`` plain rounds after a wider decode (a drafted round, or the prompt's) are not
        counted: they cost more than settled plain decoding (llama.cpp rebuilds its graph, and the host's
        caches or clocks settle over several decodes), which the calibration charges to the wider round
        (``calibration._round_among_plain_rounds``).  Counted as plain, the one such round of a request that
        drafted from its first round set plain rounds at 1.6x the curve; the drafted rounds, priced against
        that, looked 40% cheaper than they were, and auto drafted chains accepted 45% of the time at 0.79x of
        plain decoding (SmolLM2 Q4_0 and the shipped darter, mt_bench, on a host where 2 rows cost 1.7
        decodes)."""
        settling = self._since_wide < SETTLE_ROUNDS
        self._since_wide = 0 if shape.depth else self._since_wide + 1
        if shape.depth == 0:  # every plain round, so kept short
            if settling:
                return
            if kept_row or self.cost.seen.get("plain"):  # the other kinds' ratios are kept relative to plain
                # rounds', so a plain round changes no choice
                self.cost.observe("kept" if kept_row else "plain", 1e3 * seconds, self._t1_ms)
                return
            # the first settled plain round goes on: from now on the other kinds' ratios count, search again
        modelled = round_cost_ms(self.curve, shape)
        if shape.kind == "draft" and rows_consumed > 1:
            modelled += self.curve.draft_rows_time_ms(rows_consumed) - self.curve.draft_rows_time_ms(1)
        self.cost.observe(shape.kind, 1e3 * seconds, modelled)
        # lookup's measured cost is kept relative to plain rounds' (and 1 until both are seen)
        self._lookup_best = [None] * len(LOOKUP_MATCH_BUCKETS)
        if abs(math.log(self.cost.drafted_scale / self._scale_used)) > 0.03:
            self._best_shape = None  # plain rounds arrive every token: search again only on a real change

    @property
    def probe_gap(self) -> int:
        """Plain rounds before the next draft-model probe while plain rounds win."""
        return self._draft_probe.gap
