"""Auto sizing on synthetic cost curves: it picks the sweep's optimum, and plain decoding when drafts fail."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from hetero_spec.calibration import SETTLE_ROUNDS, CostCurve
from hetero_spec.spec.policy import (CATCHUP_ROWS, AutoPolicy, MeasuredCost, Shape, best_shape, break_even,
                                      expected_emitted, round_cost_ms)


def curve(t1: float, slope: float, step: float) -> CostCurve:
    return CostCurve({n: t1 + slope * (n - 1) for n in range(1, 33)}, step, {n: step * (1 + 0.1 * n) for n in range(1, 33)})


def simulated_rate(c: CostCurve, alpha: float, shape: Shape) -> float:
    """Tokens per ms of a fixed shape if each depth is accepted with probability alpha."""
    return expected_emitted([alpha] * shape.depth) / round_cost_ms(c, shape)


@pytest.mark.parametrize("t1, slope, step, alpha", [
    (10.0, 1.5, 0.9, 0.8),  # cheap verification rows (a big target): long chains
    (10.0, 4.0, 0.9, 0.6),  # steep CPU curve (SmolLM2-like): short chains
    (10.0, 1.0, 3.0, 0.9),  # slow draft
    (5.0, 6.0, 0.5, 0.3),
])
def test_auto_picks_the_sweeps_optimum(t1, slope, step, alpha):
    c = curve(t1, slope, step)
    sweep = {k: simulated_rate(c, alpha, Shape(k)) for k in range(0, 9)}
    best_k = max(sweep, key=sweep.get)
    policy = AutoPolicy(c, max_depth=8, decay=1.0, draft_decay=1.0, min_gain=1.0)
    rng = np.random.default_rng(0)
    for _ in range(3000):  # acceptance statistics from rounds drafted at depth 8
        a = 0
        while a < 8 and rng.random() < alpha:
            a += 1
        policy.observe(8, a)
    # exact acceptance rates: exactly the sweep's optimum
    assert best_shape(c, [alpha] * 8, 1, 0, 8)[0].depth == best_k
    # rates estimated from simulated rounds: the optimum, or a depth within 2% of its speed
    chosen = policy.choose().depth
    assert sweep[chosen] >= 0.98 * sweep[best_k]
    assert abs(chosen - best_k) <= 1


@pytest.mark.parametrize("alpha", [0.6, 0.9])
def test_a_marginal_gain_is_not_worth_drafting(alpha):
    """min_gain: drafting must promise that much more than plain rounds, else plain rounds."""
    c = curve(10.0, 4.0, 0.9)
    sweep = {k: simulated_rate(c, alpha, Shape(k)) for k in range(0, 9)}
    best_k = max(sweep, key=sweep.get)
    gain = sweep[best_k] / sweep[0]
    shape, _ = best_shape(c, [alpha] * 8, 1, 0, 8, min_gain=1.08)
    assert shape.depth == (best_k if gain >= 1.08 else 0)
    assert (alpha == 0.6) == (gain < 1.08)  # both branches are exercised


def test_auto_falls_back_to_plain_rounds_when_drafts_are_rejected():
    c = curve(10.0, 3.0, 0.9)
    policy = AutoPolicy(c, max_depth=8, probe_every=10)
    for _ in range(30):
        policy.observe(policy.choose().depth or 1, 0)
    depths = [policy.choose().depth for _ in range(40)]
    assert depths.count(0) >= 36 and 0 < depths.count(1) <= 4  # plain rounds, with rare probes


def test_tree_width_costs_more_rows():
    c = curve(10.0, 3.0, 0.9)
    assert round_cost_ms(c, Shape(3, 2)) > round_cost_ms(c, Shape(3, 1))
    assert Shape(6, 2, 12).tokens == 12 and Shape(6, 3, 12).tokens == 12 and Shape(2, 2).tokens == 4
    shape, _ = best_shape(c, [0.9] * 8, 2, 12, 8)
    assert shape.width == 2 and shape.depth >= 1


def test_probes_back_off_while_drafting_does_not_pay_and_reset_when_it_does():
    c = curve(10.0, 3.0, 0.9)
    policy = AutoPolicy(c, max_depth=8, probe_every=4, max_probe_gap=64, probe_budget=None, decay=1.0, draft_decay=1.0)
    for _ in range(50):  # a draft that is never accepted
        policy.observe(1, 0)
    assert not policy.expects_drafting()

    def next_gap(accept: int) -> int:
        n = 0
        while True:
            n += 1
            d = policy.choose().depth
            policy.observe(d, accept if d else 0)
            if d:
                return n

    assert [next_gap(0) for _ in range(6)] == [4, 8, 16, 32, 64, 64]
    assert next_gap(1) == 64 and policy.probe_gap == 64  # one accepted probe does not make drafting pay
    for _ in range(200):  # the draft got good (statistics from drafted rounds)
        policy.stats.observe(4, 4)
    policy._best_shape = None
    assert policy.choose().depth > 0 and policy.probe_gap == 4


def test_shadow_probe_evidence_settles_the_probe_gap_and_teaches_every_depth_it_checked():
    """A greedy probe's chain is settled rounds later (``observe_probe``), after other rounds have
    been chosen: rejected chains still double the gap, and accepted ones raise the estimates of
    every depth they reached, until drafting pays and the gap resets."""
    c = curve(10.0, 3.0, 0.9)
    policy = AutoPolicy(c, max_depth=8, probe_every=4, max_probe_gap=64, probe_budget=None, decay=1.0, draft_decay=1.0)
    for _ in range(50):
        policy.observe(1, 0)

    def probe_then_settle(accepted: int) -> int:
        n = 0
        while not policy.choose().probe:
            n += 1
        for _ in range(3):  # the chain is checked by the next rounds' tokens
            assert policy.choose().depth == 0
        policy.observe_probe(3, accepted)
        return n + 1

    assert [probe_then_settle(0) for _ in range(3)] == [4, 8 - 3, 16 - 3]  # the 3 checking rounds count
    reached_2 = policy.stats.reached[2]
    for _ in range(50):
        if policy.expects_drafting():
            break
        probe_then_settle(3)
    assert policy.expects_drafting()
    assert policy.stats.reached[2] > reached_2 and policy.stats.alpha(3) > 0.5
    assert policy.probe_gap == 4


def test_plain_rounds_want_the_targets_rows_only_shortly_before_a_probe():
    policy = AutoPolicy(curve(10.0, 3.0, 0.9), max_depth=8, probe_every=4, max_probe_gap=64, probe_budget=None,
                        decay=1.0, draft_decay=1.0)
    for _ in range(50):
        policy.observe(1, 0)
    wanted = []
    for _ in range(4 + 8 + 16 + 32):  # probes after 4, 8, 16 and 32 plain rounds
        d = policy.choose().depth
        wanted.append("p" if d else "+" if policy.wants_rows(3) else ".")
        policy.observe(d, 0)
    assert "".join(wanted) == "+++p" + "....+++p" + "............+++p" + "." * 28 + "+++p"
    for _ in range(200):  # once drafting pays, every row is wanted
        policy.stats.observe(4, 4)
    policy._best_shape = None
    assert policy.wants_rows(0)


def test_measured_round_times_correct_the_curve():
    """Drafting that pays on the calibrated curve stops once drafted rounds are measured to cost
    twice what the curve says (plain rounds as modelled), and resumes when they cost as modelled."""
    c = curve(10.0, 3.0, 0.9)
    policy = AutoPolicy(c, max_depth=8, decay=1.0, draft_decay=1.0)
    for _ in range(300):
        policy.stats.observe(2, 1)  # depth 1 always accepted, depth 2 half the time
        policy.stats.observe(1, 1)
    policy._best_shape = None
    shape = policy.choose()
    assert shape.depth > 0
    plain_ms = round_cost_ms(c, Shape(0))
    for _ in range(SETTLE_ROUNDS + 4):  # a settled plain stretch (plain rounds among drafted ones are not counted)
        policy.observe_time(Shape(0), 0, plain_ms / 1e3)
    for _ in range(40):
        policy.observe_time(Shape(0), 0, plain_ms / 1e3)
        policy.observe_time(shape, 2, 2 * round_cost_ms(c, shape) / 1e3)
    assert policy.cost.drafted_scale == pytest.approx(2.0, rel=0.05)
    assert policy.choose().depth == 0
    for _ in range(60):
        policy.observe_time(Shape(0), 0, plain_ms / 1e3)
        policy.observe_time(shape, 1, round_cost_ms(c, shape) / 1e3)
    assert policy.choose().depth == shape.depth


def test_a_machine_that_speeds_up_does_not_price_a_resting_kind_out():
    """Lookup rounds measured during a slow spell (everything 1.5x the curve), then only plain
    rounds while the machine runs at the curve's speed: lookup must still cost what it did
    relative to plain rounds, not 1.5x more (it would never run again to correct that)."""
    c = curve(10.0, 3.0, 0.9)
    cost = MeasuredCost()
    lookup = Shape(2, source="lookup")
    for _ in range(30):  # slow spell: both kinds at 1.5x
        cost.observe("plain", 1.5 * round_cost_ms(c, Shape(0)), round_cost_ms(c, Shape(0)))
        cost.observe("lookup", 1.5 * round_cost_ms(c, lookup), round_cost_ms(c, lookup))
    assert cost.scale("lookup") == pytest.approx(1.0, abs=0.01)
    for _ in range(100):  # the machine speeds up; lookup is not chosen meanwhile
        cost.observe("plain", round_cost_ms(c, Shape(0)), round_cost_ms(c, Shape(0)))
    assert cost.scale("lookup") == pytest.approx(1.0, abs=0.01)
    cost.observe("lookup", 2.0 * round_cost_ms(c, lookup), round_cost_ms(c, lookup))  # one dear round
    assert 1.0 < cost.scale("lookup") < 1.2


def test_plain_rounds_settling_after_a_wider_decode_leave_the_plain_cost_alone():
    """A request that drafts from its first round: the one plain round among its drafted rounds comes right
    after a wide decode and costs 1.6x a settled one.  It set plain rounds' measured cost before, the
    drafted rounds priced relative to it looked 40% cheaper than they were, and auto drafted at a loss."""
    c = curve(10.0, 3.0, 0.9)
    policy = AutoPolicy(c, max_depth=8)
    policy.new_text()
    chain, t1 = Shape(3), round_cost_ms(c, Shape(0))
    policy.observe_time(chain, 1, round_cost_ms(c, chain) / 1e3)
    policy.observe_time(Shape(0), 0, 1.6 * t1 / 1e3)  # right after the wide decode
    for _ in range(20):
        policy.observe_time(chain, 1, round_cost_ms(c, chain) / 1e3)
    assert policy.cost.drafted_scale == pytest.approx(1.0, abs=0.01)
    for _ in range(SETTLE_ROUNDS):  # a plain stretch still settling: not counted
        policy.observe_time(Shape(0), 0, 1.6 * t1 / 1e3)
    assert "plain" not in policy.cost.seen
    for _ in range(40):  # settled: plain decoding runs at 0.8x the curve, and drafted rounds are dearer relatively
        policy.observe_time(Shape(0), 0, 0.8 * t1 / 1e3)
    assert policy.cost.log_ratio["plain"] == pytest.approx(np.log(0.8), abs=0.02)
    policy.observe_time(chain, 1, round_cost_ms(c, chain) / 1e3)
    assert policy.cost.drafted_scale > 1.0


def test_a_kinds_first_round_cannot_price_it_out_alone():
    """The first suffix round after a long prompt's prefill cost 2.3x its curve; taken whole, that figure
    priced suffix rounds out for the rest of the bench, since a kind not chosen is not measured again."""
    cost = MeasuredCost()
    cost.observe("plain", 10.0, 10.0)
    cost.observe("suffix", 23.0, 10.0)
    assert 1.0 < cost.scale("suffix") < 1.1
    for _ in range(30):  # what keeps being measured still wins
        cost.observe("suffix", 20.0, 10.0)
    assert cost.scale("suffix") == pytest.approx(2.0, rel=0.05)


def test_one_outlier_round_cannot_swing_the_choice():
    c = curve(10.0, 3.0, 0.9)
    policy = AutoPolicy(c, max_depth=8)
    for _ in range(10):
        policy.observe_time(Shape(0), 0, round_cost_ms(c, Shape(0)) / 1e3)
        policy.observe_time(Shape(2), 1, round_cost_ms(c, Shape(2)) / 1e3)
    policy.observe_time(Shape(2), 1, 100.0)  # a 100 s stall
    assert policy.cost.drafted_scale < 1.5


def test_lookup_is_chosen_where_it_pays_and_probed_where_it_does_not():
    c = curve(10.0, 3.0, 0.9)
    policy = AutoPolicy(c, max_depth=8, lookup_depth=4, probe_every=4, max_probe_gap=32, decay=1.0)
    for _ in range(100):  # the draft model never pays; lookup proposals are always right
        policy.stats.observe(1, 0)
        policy.lookup_buckets[0].observe(4, 4)  # short matches: choose(n) below passes none
    policy._best_shape = None
    assert policy.choose(0) == Shape(0)  # nothing offered: plain
    shape = policy.choose(3)
    assert shape.source == "lookup" and shape.depth == 3  # capped by what was offered
    assert policy.choose(9).depth == 4  # capped by lookup_depth

    for _ in range(200):  # lookup proposals turn out wrong
        policy.lookup_buckets[0].observe(1, 0)
    gaps, n = [], 0
    for _ in range(120):
        n += 1
        s = policy.choose(2)
        policy.observe(s.depth, 0, source=s.source)
        if s.depth:
            assert s in (Shape(1, source="lookup", probe=True), Shape(1, 1, probe=True))
            if s.source == "lookup":
                gaps.append(n)
                n = 0
    assert gaps[:4] == [4, 8, 16, 32]


def test_a_lookup_choice_follows_lookups_measured_cost():
    """The best lookup depth is remembered between rounds (per match bucket): lookup rounds measured
    dearer than the curve must still turn it off, and cheap ones back on."""
    c = curve(10.0, 3.0, 0.9)
    policy = AutoPolicy(c, max_depth=8, lookup_depth=4, decay=1.0)
    for _ in range(100):  # the draft never pays; short-match lookup proposals are right 80% of the time
        policy.stats.observe(1, 0)
        policy.lookup_buckets[0].observe(4, 3)
    policy._best_shape = None
    shape = policy.choose(4)
    assert shape.source == "lookup" and shape.depth > 0
    for _ in range(SETTLE_ROUNDS + 4):  # a settled plain stretch at the curve's speed
        policy.observe_time(Shape(0), 0, round_cost_ms(c, Shape(0)) / 1e3)
    for _ in range(30):  # lookup rounds three times dearer
        policy.observe_time(Shape(0), 0, round_cost_ms(c, Shape(0)) / 1e3)
        policy.observe_time(shape, 0, 3 * round_cost_ms(c, shape) / 1e3)
    assert policy.choose(4) == Shape(0)
    for _ in range(60):
        policy.observe_time(shape, 0, round_cost_ms(c, shape) / 1e3)
    assert policy.choose(4) == shape


def test_lookup_rounds_are_costed_without_a_draft_forward():
    c = curve(10.0, 3.0, 0.9)
    assert round_cost_ms(c, Shape(2, source="lookup")) == c.verify_time_ms(3)
    assert round_cost_ms(c, Shape(2)) > round_cost_ms(c, Shape(2, source="lookup"))


def test_break_even_is_the_mean_accepted_length_at_which_a_fixed_chain_matches_plain_rounds():
    c = replace(curve(10.0, 3.0, 0.9), draft_switch_ms=2.0)
    assert break_even(c, 2, "lookup") == pytest.approx(16.0 / 10.0)  # t(3) / t(1), no draft forward
    assert break_even(c, 2) == pytest.approx(round_cost_ms(c, Shape(2)) / 10.0) and break_even(c, 2) > 1.6 + 0.29
    for k in (1, 3):  # a draft accepted so that it emits exactly that many tokens a round runs at plain speed
        alpha = next(a / 1000 for a in range(1, 1000) if expected_emitted([a / 1000] * k) >= break_even(c, k))
        assert simulated_rate(c, alpha, Shape(k)) == pytest.approx(1 / 10.0, rel=0.01)


def test_drafted_rounds_pay_the_switch_once_and_it_can_turn_drafting_off():
    """A draft round's first forward runs right after a target decode (the draft's weights evicted):
    priced once per round, so it weighs on short chains most."""
    base = curve(10.0, 3.0, 0.9)
    c = replace(base, draft_switch_ms=4.0)
    for d in (1, 3):
        assert round_cost_ms(c, Shape(d)) == pytest.approx(round_cost_ms(base, Shape(d)) + 4.0)
    assert round_cost_ms(c, Shape(2, source="lookup")) == round_cost_ms(base, Shape(2, source="lookup"))
    assert round_cost_ms(c, Shape(0)) == round_cost_ms(base, Shape(0))
    alphas = [0.6] * 8  # k=1: 1.6 tokens for 13.9 ms against 10 a token; with the switch, 17.9 ms
    assert best_shape(base, alphas, 1, 0, 1)[0].depth == 1
    assert best_shape(c, alphas, 1, 0, 1)[0].depth == 0


def test_shadow_evidence_replaces_lookup_probes():
    """Plain rounds that check the offered lookup token for free teach the lookup statistics, and
    verified lookup probes stop; good evidence then makes lookup rounds the choice."""
    c = curve(10.0, 6.0, 0.9)  # steep: at the 0.5 prior, lookup does not pay
    policy = AutoPolicy(c, max_depth=8, lookup_depth=4, probe_every=4, decay=0.95)
    assert policy.choose(2).depth == 0
    probes_after_shadow = 0
    for _ in range(40):
        s = policy.choose(2)
        if s.source == "lookup" and not s.probe:
            break
        probes_after_shadow += s.source == "lookup" and policy.lookup_buckets[0].reached[1] > 0
        policy.observe(s.depth, 0, source=s.source)  # draft-model probes are rejected
        if s.depth == 0:
            policy.observe_shadow("lookup", 1.0)
    assert s.source == "lookup" and s.depth >= 1 and probes_after_shadow == 0  # depth 2 still has its prior
    assert policy.lookup_buckets[0].alpha(1) >= 0.7  # a few free confirmations suffice



def test_lookup_statistics_are_kept_per_match_length():
    """Proposals behind long matches that proved right become lookup rounds, deeper than one token
    (whole proposals were checked); those behind short matches that proved wrong stay plain, and so
    does a bucket with no evidence yet.  Pooled, the two would average to a rate at which neither pays."""
    c = curve(10.0, 6.0, 0.9)  # steep: at the 0.5 prior lookup does not pay
    policy = AutoPolicy(c, max_depth=8, lookup_depth=4, probe_every=1000, decay=0.95)
    for _ in range(30):
        policy.observe_lookup_chain(12, 4, 4)
        policy.observe_lookup_chain(2, 4, 0)
    long_match = policy.choose(4, match=12)
    assert long_match.source == "lookup" and long_match.depth >= 3
    short, middle, long_ = policy.lookup_buckets
    assert long_.alpha(3) > 0.9 and short.alpha(1) < 0.1
    assert policy.choose(4, match=2).depth == 0
    assert policy.choose(4, match=5).depth == 0 and middle.reached[1] == 0  # only its prior
    before = (list(short.reached), list(short.accepted))
    policy.observe_lookup_chain(9, 4, 1)  # one miss at depth 2 moves the long bucket, not the short one
    assert long_.reached[2] > long_.accepted[2] and (short.reached, short.accepted) == before


def test_verified_lookup_rounds_teach_the_bucket_they_were_chosen_from():
    c = curve(10.0, 1.0, 0.9)  # flat: lookup pays at the prior
    policy = AutoPolicy(c, max_depth=8, lookup_depth=4, probe_every=1000, decay=1.0)
    shape = policy.choose(4, match=12)
    assert shape.source == "lookup"
    policy.observe(shape.depth, 1, source="lookup")
    short, middle, long_ = policy.lookup_buckets
    assert long_.reached[1] == long_.reached[2] == 1 and long_.accepted[2] == 0
    assert short.reached[1] == middle.reached[1] == 0


def _avx512_curve(t1: float, step: float) -> CostCurve:
    """Shaped like the measured 2-thread AVX-512 curves: 4 rows cost less than 3 (the repacked Q4_0 kernels)."""
    ratios = {1: 1.0, 2: 1.39, 3: 1.79, 4: 1.66, 5: 1.99, 6: 2.40, 7: 2.83, 8: 2.66, 9: 3.05}
    return CostCurve({n: t1 * ratios.get(n, 0.33 * n) for n in range(1, 33)}, step,
                     {n: 0.7 * step + 0.05 * step * n for n in range(1, 33)})


def _run(policy: AutoPolicy, conditional: list[float], rounds: int, seed: int = 0) -> list[int]:
    rng = np.random.default_rng(seed)
    depths = []
    for _ in range(rounds):
        d = policy.choose().depth
        a = 0
        while a < d and rng.random() < conditional[a]:
            a += 1
        policy.observe(d, a)
        depths.append(d)
    return depths


HELD_OUT = (0.671, 0.725, 0.773, 0.802)  # the darter draft's held-out top-1 per unrolled step at 256 CPU-min
MEASURED = [0.53] + [0.64] * 7  # its acceptance in the bench: first token, then each further one


def test_probes_draft_to_the_curves_best_depth_not_one_deep():
    """One-deep probes teach nothing about depth 2 and beyond; a probe drafts to the depth that
    would pay best on the curve, so those depths are learned too."""
    cheap_rows = AutoPolicy(_avx512_curve(56.7, 1.0), max_depth=8, probe_every=1, min_gain=10.0)  # plain wins
    probe = cheap_rows.choose()
    assert probe.probe and probe.depth == 3  # 4 rows cost 1.66 t(1): depth 3 is the curve's best
    steep = AutoPolicy(curve(10.0, 6.0, 3.0), max_depth=8)
    assert steep._probe_depth() == 1


def _speed(c: CostCurve, depths: list[int]) -> float:
    """Expected tokens per ms of the depths chosen, relative to plain rounds."""
    emitted = sum(expected_emitted(MEASURED[:d]) for d in depths)
    return emitted / sum(round_cost_ms(c, Shape(d)) for d in depths) * round_cost_ms(c, Shape(0))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_trained_drafts_held_out_acceptance_starts_it_drafting_where_it_pays(seed):
    """On a big target with cheap rows (the scale-10 target, a draft step 2% of t(1)) the shipped
    draft pays at depth 3 (a fixed k=3 chain measured 1.10x there); auto with one-deep probes, a
    0.5 prior and fast forgetting drafted 21 rounds in 80 prompts.  Now it gets within 6% of the
    best fixed depth."""
    c = _avx512_curve(56.7, 1.0)
    best = max(_speed(c, [d]) for d in range(1, 9))
    assert best == pytest.approx(_speed(c, [3])) and best > 1.2
    depths = _run(AutoPolicy(c, max_depth=8, prior_alphas=HELD_OUT), MEASURED, 2000, seed)
    assert _speed(c, depths[200:]) >= 0.94 * best


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_an_optimistic_prior_gives_way_to_measured_acceptance_where_drafting_does_not_pay(seed):
    """The same prior on the small target (a draft step 23% of t(1)): drafting looks worth it at
    first, the measured acceptance says otherwise, and auto settles on plain rounds; its probes,
    frequent near break-even, cost under 1%."""
    c = _avx512_curve(4.83, 1.13)
    assert all(_speed(c, [d]) < 1.08 for d in range(1, 9))
    policy = AutoPolicy(c, max_depth=8, prior_alphas=HELD_OUT)
    assert policy.choose().depth > 0  # the prior alone says drafting pays
    depths = _run(policy, MEASURED, 2000, seed)[200:]
    assert depths.count(0) >= 0.9 * len(depths) and _speed(c, depths) >= 0.99


def _steep_big_curve() -> CostCurve:
    """The scale-10 target calibrated on a 2-core AVX-512 EPYC whose 4 rows cost 2.07 t(1)."""
    ratios = {1: 1.0, 2: 1.34, 3: 2.0, 4: 2.07, 5: 2.65, 6: 2.75, 7: 3.48, 8: 3.64}
    return CostCurve({n: 81.0 * ratios.get(n, 0.45 * n) for n in range(1, 33)}, 2.29,
                     {n: 1.5 + 0.3 * n for n in range(1, 33)})


def _resume_latency(policy: AutoPolicy, seed: int, bad_rounds: int = 300) -> int | None:
    """Rounds after a bad streak ends until auto drafts again (None: not in 3000 rounds)."""
    bad, good = [0.15] * 8, [0.62, 0.72, 0.78] + [0.8] * 5
    rng = np.random.default_rng(seed)
    for i in range(bad_rounds + 3000):
        cond = bad if i < bad_rounds else good
        shape = policy.choose()
        a = 0
        while a < shape.depth and rng.random() < cond[a]:
            a += 1
        if shape.probe:  # a shadow probe, settled by the target's next tokens
            policy.observe_probe(shape.depth, a)
            continue
        policy.observe(shape.depth, a)
        if i >= bad_rounds and shape.depth:
            return i - bad_rounds
    return None


def test_cheap_probes_do_not_back_off_so_drafting_resumes_after_a_bad_streak():
    """On a big target a shadow probe costs 3% of one round: backing off to one probe in 128 rounds
    saves nothing and leaves the statistics of a bad streak standing.  Capped by the probe budget, the
    gap stays near ``probe_every`` there and drafting resumes within a few prompts every time; on SmolLM2
    Q4_0, whose draft step is a third of a round, the probes still back off."""
    c = _steep_big_curve()
    capped = [AutoPolicy(c, max_depth=8, prior_alphas=HELD_OUT) for _ in range(4)]
    assert all(p._probe_gap_cap() <= 32 for p in capped)
    latency = [_resume_latency(p, seed) for seed, p in enumerate(capped)]
    assert all(n is not None and n <= 700 for n in latency), latency
    uncapped = [_resume_latency(AutoPolicy(c, max_depth=8, prior_alphas=HELD_OUT, probe_budget=None), seed)
                for seed in range(4)]
    assert max(n or 3000 for n in uncapped) > 700, uncapped  # what the cap fixes
    dear = AutoPolicy(_avx512_curve(6.4, 2.1), max_depth=8, prior_alphas=HELD_OUT)
    assert dear._probe_gap_cap() == 128  # the maximum: probes there back off as before


def test_forgetting_all_evidence_returns_the_statistics_to_their_prior():
    policy = AutoPolicy(curve(10.0, 3.0, 0.9), max_depth=4, prior_alphas=(0.8, 0.7))
    before = [policy.stats.alpha(d) for d in range(1, 5)]
    for _ in range(20):
        policy.stats.observe(3, 0)
    assert policy.stats.alpha(1) < 0.2
    policy.stats.forget(0.0)
    assert [policy.stats.alpha(d) for d in range(1, 5)] == pytest.approx(before)


def test_a_new_text_is_drafted_soon_after_the_last_texts_bad_streak():
    """Two requests in turn on a curve like this VM's (4 rows 1.45 t(1), a step 0.05 t(1)): the draft fails on
    the first (a quarter of its first tokens accepted) and does well on the second.  Carried over whole, the
    first text's streak kept the draft off for much of the second on some seeds; with ``new_text`` the prior
    and fresh probes bring it back within a few rounds, while a request the draft fails on still runs mostly
    plain."""
    c = CostCurve({n: 10.0 * (1 + 0.15 * (n - 1)) for n in range(1, 33)}, 0.5, {n: 0.5 + 0.05 * n for n in range(1, 33)})
    bad, good = [0.25] + [0.5] * 7, [0.8] * 8
    plain = {False: 0, True: 0}
    for seed in range(4):
        for new_text in (False, True):
            policy = AutoPolicy(c, max_depth=8, prior_alphas=HELD_OUT)
            first = _run(policy, bad, 120, seed)
            assert first[60:].count(0) >= 0.8 * 60  # the bad text runs mostly plain
            if new_text:
                policy.new_text()
            second = _run(policy, good, 60, seed + 1)
            plain[new_text] += second.count(0)
            if new_text:
                assert next(i for i, d in enumerate(second) if d > 0) <= 2
    assert plain[True] <= 8 and plain[False] >= 40


def test_a_draft_far_below_plain_keeps_its_probe_gap_across_requests():
    """On a curve like the steeper VM host's (every verified row about half a decode more, a step 0.06 t(1)) a
    draft accepted 30% of the time cannot pay: ``new_text`` does not probe early in every request.  On a flat curve the same evidence leaves the draft near break-even, and its
    probes are due at the first gap again."""
    steep = CostCurve({n: 4.5 * (1 + 0.5 * (n - 1)) for n in range(1, 33)}, 0.27, {n: 0.27 * n for n in range(1, 33)})
    flat = CostCurve({n: 10.0 * (1 + 0.15 * (n - 1)) for n in range(1, 33)}, 0.5, {n: 0.5 + 0.05 * n for n in range(1, 33)})
    gaps = {}
    for name, c in (("steep", steep), ("flat", flat)):
        policy = AutoPolicy(c, max_depth=8, prior_alphas=HELD_OUT)
        depths = _run(policy, [0.3] * 8, 400, seed=3)
        assert depths[100:].count(0) >= 0.9 * 300  # both run plain: the draft does not pay at 30%
        grown = policy.probe_gap
        policy.new_text()
        gaps[name] = (grown, policy.probe_gap, policy._draft_probe.rounds_to_due)
    grown, kept, due = gaps["steep"]
    # no probe early in the next request: the gap is kept, or restarted where probes cost what they may near
    # break-even (a probe there costs its catch-up and kept rows too, about a decode: ``_probe_cost_ms``)
    assert grown > 16 and kept > 32 and due > 32
    grown, reset, due = gaps["flat"]
    assert reset == 16 and due == 16


def test_probes_near_break_even_are_spaced_by_what_they_really_cost():
    """A probe costs its draft forwards, its catch-up and the plain rounds before it that keep their hidden
    states; where those rounds are measured dearer than plain ones, probes near break-even come rarer.  On
    the steeper VM host a probe cost about 2 decodes in all, and probing every 16 rounds put auto with the
    shipped darter 3-6 points behind lookup alone.  On the scale-10 target probes stay at the first gap."""
    small = AutoPolicy(_avx512_curve(4.6, 0.3), max_depth=8, prior_alphas=HELD_OUT)
    for i in range(30):  # the draft's first token accepted a third of the time: not expected to draft here
        small.observe(3, 1 if i % 3 == 0 else 0)
    assert not small.expects_drafting()
    for _ in range(SETTLE_ROUNDS + 10):  # settled plain rounds at the curve's speed
        small.observe_time(Shape(0), 0, 4.6e-3)
    before = small._probe_restart()
    while small.wants_rows(CATCHUP_ROWS) is False:
        small.observe_time(Shape(0), 0, 4.6e-3)
    for _ in range(20):  # rounds that keep rows for the probe: 0.25 ms each beyond a plain round
        assert small.wants_rows(CATCHUP_ROWS)
        small.observe_time(Shape(0), 0, 4.85e-3, kept_row=True)
    assert small.cost.scale("kept") == pytest.approx(4.85 / 4.6, rel=0.01)
    assert small._probe_restart() > 1.5 * before
    big = AutoPolicy(_steep_big_curve(), max_depth=8, prior_alphas=HELD_OUT)
    for _ in range(SETTLE_ROUNDS + 10):
        big.observe_time(Shape(0), 0, 81e-3)
    for _ in range(20):
        assert big.wants_rows(CATCHUP_ROWS)
        big.observe_time(Shape(0), 0, 81.25e-3, kept_row=True)
    assert big._probe_restart() == 16


def test_a_shadowed_lookup_priced_out_by_its_measured_cost_is_probed_until_it_pays_again():
    """Free checks keep lookup's acceptance current but not its cost, which only rounds that run it measure.
    After a slow spell prices lookup out, a cost probe (one copied token) comes on lookup's backoff while the
    curve alone says lookup would pay; rounds at the curve's cost then bring lookup back.  Where lookup would
    not pay even at the curve's cost, a shadowed lookup is never probed."""
    c = curve(10.0, 2.0, 0.9)
    policy = AutoPolicy(c, max_depth=0, lookup_depth=4, probe_every=4, decay=0.9)
    for _ in range(30):
        policy.observe_lookup_chain(8, 4, 4)  # long matches, proposals right: lookup pays at the curve
    chosen = policy.choose(4, match=8)
    assert chosen.source == "lookup" and chosen.depth >= 2 and not chosen.probe
    for _ in range(SETTLE_ROUNDS + 20):
        policy.observe_time(Shape(0), 0, 10.0 / 1e3)  # plain rounds at the curve
    for _ in range(10):  # a slow spell of lookup rounds
        policy.observe_time(chosen, 0, 4 * round_cost_ms(c, chosen) / 1e3)
    seen = []
    for _ in range(80):
        s = policy.choose(4, match=8)
        seen.append("probe" if s.probe else s.source if s.depth else "plain")
        if s.depth:
            policy.observe_time(s, 0, round_cost_ms(c, s) / 1e3)  # the spell is over
            policy.observe(s.depth, s.depth, source=s.source)
        else:
            policy.observe_time(s, 0, 10.0 / 1e3)
        if seen[-1] == "lookup":
            break
    assert seen[0] == "plain" and "probe" in seen and seen[-1] == "lookup"

    poor = AutoPolicy(c, max_depth=0, lookup_depth=4, probe_every=4, decay=0.9)
    for _ in range(30):
        poor.observe_lookup_chain(0, 4, 0)  # short matches, proposals wrong: lookup would not pay anyway
    assert all(poor.choose(4, match=0) == Shape(0) for _ in range(40))
