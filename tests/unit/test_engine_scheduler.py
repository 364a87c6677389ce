"""The engine's scheduler without a model: FIFO admission, prefix affinity, the bound, and a step's layout."""
from __future__ import annotations

import pytest

from hetero_spec.engine.cost import StepCost, micro_batches
from hetero_spec.engine.scheduler import QueueFull, Scheduler
from hetero_spec.engine.slots import Request


def test_admission_is_fifo_into_free_slots_and_bounded():
    sch = Scheduler(n_slots=2, max_waiting=3, max_rows=32)
    reqs = [Request([1, 2, 3], 4, tag=i) for i in range(4)]
    for r in reqs[:3]:
        sch.submit(r)
    with pytest.raises(QueueFull):
        sch.submit(reqs[3])
    assert [a.slot.request for a in sch.admit()] == reqs[:2] and list(sch.waiting) == [reqs[2]]
    assert sch.withdraw(reqs[2]) and not sch.withdraw(reqs[2]) and not sch.withdraw(reqs[0])
    sch.submit(reqs[3])
    sch.release(sch.active[0])
    assert [a.slot.request for a in sch.admit()] == [reqs[3]]
    assert [s.request for s in sch.active] == [reqs[1], reqs[3]]  # oldest admission first


def test_a_prompt_goes_to_the_slot_holding_its_start():
    """A follow-up takes the slot whose cells hold its first turn; a stranger takes the empty slot, not the one
    whose cells it would throw away; a shared BOS alone is no reason to evict a cache."""
    sch = Scheduler(n_slots=3, max_waiting=4, max_rows=32)
    first = Request([1] + list(range(100, 140)), 4)
    sch.submit(first)
    (a,) = sch.admit()
    a.slot.fed = len(first.prompt)
    first.out += [7, 8, 9]
    sch.release(a.slot)  # its cells keep the prompt and the answer but the last token
    assert a.slot.cached == first.prompt + [7, 8]
    stranger = Request([1, 5, 6], 4)
    sch.submit(stranger)
    (b,) = sch.admit()
    assert b.slot is not a.slot and b.reuse == 0
    follow_up = Request(first.prompt + [7, 8, 9, 50, 51], 4)
    sch.submit(follow_up)
    (c,) = sch.admit()
    assert c.slot is a.slot and c.reuse == len(first.prompt) + 2 and c.slot.fed == c.reuse


def test_layout_sorts_rows_pads_gaps_and_chunks_one_prompt():
    sch = Scheduler(n_slots=4, max_waiting=4, max_rows=8)
    long_prompt = list(range(100, 120))
    reqs = [Request([5, 6], 9), Request(long_prompt, 9), Request([1, 2], 9), Request([7, 8, 9], 9)]
    for r in reqs:
        sch.submit(r)
    slots = [a.slot for a in sch.admit()]
    s0, s1, s2, s3 = slots
    for s, tok in ((s0, 42), (s3, 43)):  # slots 0 and 3 generate; 1 prefills; 2 waits behind it
        s.fed, s.pending = len(s.request.prompt), tok
        s.request.out.append(tok)
    s2.fed = 0
    s3.drafts = [70, 71]
    plan = sch.plan({s3: 2, s0: 0})
    seqs = [r.seq for _, r, _ in plan.rows]
    assert seqs == sorted(seqs) and set(seqs) == {0, 1, 2, 3}
    kinds = {seq: [k for _, r, k in plan.rows if r.seq == seq] for seq in range(4)}
    assert kinds[0] == ["plain"] and kinds[3] == ["plain", "draft", "draft"]
    assert kinds[1] == ["prompt"] * 9  # the oldest prefilling slot: the shared width (1) + a micro-batch (8)
    assert kinds[2] == ["pad"]  # waits: one pad row keeps the first micro-batch whole
    pad = next(r for _, r, k in plan.rows if k == "pad")
    assert pad.pos == s2.n_past and not pad.output
    assert sch.counts({s3: 2, s0: 0}) == [(seq, len(kinds[seq])) for seq in range(4)]
    assert plan.counts == sch.counts({s3: 2, s0: 0})  # the priced layout is the decoded one
    assert micro_batches(sch.counts({s3: 2, s0: 0}), 8) == [4, 8, 2]
    assert micro_batches(sch.counts({}), 8) == [4, 8]  # no drafts: the width-1 micro-batch and the chunk's rest


@pytest.mark.parametrize("chunk_len", [2, 3, 20])
def test_the_priced_layout_is_the_planned_one_for_every_draft_layout(chunk_len):
    """``counts`` (what the engine prices) and ``plan`` (what it decodes) follow one set of rules: for every
    mix of draft lengths, with a chunk shorter than, as long as, and longer than the width."""
    import itertools

    sch = Scheduler(n_slots=4, max_waiting=4, max_rows=8)
    reqs = [Request([5, 6], 9), Request([1, 2, 3], 9), Request(list(range(100, 100 + chunk_len)), 9),
            Request([7, 8, 9], 9)]
    for r in reqs:
        sch.submit(r)
    s0, s1, s2, s3 = (a.slot for a in sch.admit())
    for s, tok in ((s0, 42), (s1, 44), (s3, 43)):  # slot 2 prefills between generating slots
        s.fed, s.pending, s.drafts = len(s.request.prompt), tok, [60, 61, 62]
        s.request.out.append(tok)
    for k0, k1, k3 in itertools.product(range(4), repeat=3):
        ks = {s0: k0, s1: k1, s3: k3}
        plan = sch.plan(ks)
        assert plan.counts == sch.counts(ks), ks
        width = 1 + min(k0, k1, k3)
        assert dict(plan.counts)[2] == max(width, min(chunk_len, 8 + width)), ks


def test_chunk_rows_bound_by_the_micro_batch_and_the_prompt():
    sch = Scheduler(n_slots=1, max_waiting=1, max_rows=8)
    sch.submit(Request(list(range(100, 105)), 4))
    (a,) = sch.admit()
    rows = sch.plan({}).rows
    assert [(r.pos, r.output) for _, r, _ in rows] == [(p, p == 4) for p in range(5)]


class ClockSequences:
    """A stand-in multi-sequence target whose decodes advance a fake clock: n rows cost n ms, and the one-row
    decodes right after a wider one 2, 1 and 0.5 ms more (as on the 2-core Xeon VM, where a one-row step right
    after the calibration's 32-row decodes was priced at 8.6 ms against 5.0 settled)."""

    AFTER_WIDE_MS = (2.0, 1.0, 0.5)

    def __init__(self) -> None:
        from types import SimpleNamespace

        self.options = SimpleNamespace(n_seq=4, max_rows=32, batch_rows=64)
        self.seq_ctx, self.now, self.since_wide = 1024, 0.0, 99

    def decode(self, rows) -> None:
        n = len(rows)
        extra = self.AFTER_WIDE_MS[self.since_wide] if n == 1 and self.since_wide < len(self.AFTER_WIDE_MS) else 0.0
        self.now += 1e-3 * (n + extra)
        self.since_wide = 0 if n > 1 else self.since_wide + 1

    def keep(self, seq: int, n_keep: int) -> None:
        pass

    def clear(self, seq: int) -> None:
        pass


def test_engine_prices_one_row_settled_and_a_width_with_the_decodes_it_slows(monkeypatch):
    """The engine's start-up prices: one row from a settled stream of one-row decodes (not right after the
    context's 32-row decodes), and a wider step with what it adds to the one-row decodes after it."""
    from types import SimpleNamespace

    from hetero_spec.engine import step as engine_step
    from hetero_spec.engine.step import Engine

    target = ClockSequences()
    monkeypatch.setattr(engine_step, "time", SimpleNamespace(perf_counter=lambda: target.now))
    cost = Engine(target, max_waiting=4).calibrate(rows=(1, 2, 4, 8))
    assert cost.ms == pytest.approx({1: 1.0, 2: 5.5, 4: 7.5, 8: 11.5})


class NoisyClockSequences(ClockSequences):
    """... whose one-row decodes after a wider one run faster than settled ones, as a noisy VM's sometimes did."""

    AFTER_WIDE_MS = (-0.9,) * 8


def test_engine_prices_never_fall_below_one_row(monkeypatch):
    """A width's price is its decode plus the change in the decodes after it; where noise makes that change more
    negative than the decode costs (on the Xeon VM a calibration once gave t(3) -4.4 ms), the price is one row's."""
    from types import SimpleNamespace

    from hetero_spec.engine import step as engine_step
    from hetero_spec.engine.step import Engine

    target = NoisyClockSequences()
    monkeypatch.setattr(engine_step, "time", SimpleNamespace(perf_counter=lambda: target.now))
    cost = Engine(target, max_waiting=4).calibrate(rows=(1, 2, 8))
    assert cost.ms == pytest.approx({1: 1.0, 2: 1.0, 8: 1.0})  # 2 - 7.2 and 8 - 7.2 ms: clamped to t(1)


class JitteryClockSequences(ClockSequences):
    """... whose one-row decode right after a wider one is slowed by a different amount each time (0-8 ms), as
    a VM's spells make the difference of two sums of decodes swing."""

    def __init__(self) -> None:
        import random

        super().__init__()
        self.rng = random.Random(7)
        self.slowed: list[float] = []

    def decode(self, rows) -> None:
        if len(rows) == 1 and self.since_wide == 0:
            self.slowed.append(self.rng.uniform(0.0, 8.0))
            self.now += 1e-3 * self.slowed[-1]
        self.now += 1e-3 * len(rows)
        self.since_wide = 0 if len(rows) > 1 else self.since_wide + 1


def test_engine_prices_every_width_with_the_after_effect_of_all(monkeypatch):
    """What a wider decode adds to the decodes after it is pooled over every width: each width's price is its
    own decode plus the median of all widths' after-effects, so one width does not take a slow spell alone
    (on the 2-core EPYC VM a calibration priced 4 rows at 20.1 ms and 8 at 26.4, 16.2 and 28.0 back to back)."""
    import statistics
    from types import SimpleNamespace

    from hetero_spec.engine import step as engine_step
    from hetero_spec.engine.step import Engine

    target = JitteryClockSequences()
    monkeypatch.setattr(engine_step, "time", SimpleNamespace(perf_counter=lambda: target.now))
    cost = Engine(target, max_waiting=4).calibrate(rows=(1, 2, 4, 8), repeats=5)
    slowed = statistics.median(target.slowed)
    assert cost.ms == pytest.approx({1: 1.0, 2: 2.0 + slowed, 4: 4.0 + slowed, 8: 8.0 + slowed})


def test_steps_correct_every_width_alike():
    """Steps of one width scale every price by how they ran against theirs, so a width the engine no longer runs
    keeps its calibrated ratio to the ones it does; without a calibration the steps' own times are the prices."""
    cost = StepCost({1: 5.0, 4: 16.0, 8: 28.0})
    for _ in range(40):
        cost.observe(8, 21.0)  # 4 slots drafting a row each, faster than calibrated
    assert cost.at(8) == pytest.approx(21.0, rel=1e-3)
    assert cost.at(4) / cost.at(8) == pytest.approx(16.0 / 28.0)  # 4 plain rows: 12 ms now, not still 16
    assert cost.at(6) == pytest.approx(cost.scale * 22.0)  # between two points, scaled alike

    fresh = StepCost()
    fresh.observe(4, 12.0)
    assert not fresh.known
    fresh.observe(1, 5.0)
    assert fresh.ms == {4: 12.0, 1: 5.0} and fresh.scale == 1.0
    fresh.observe(4, 6.0)  # known: a correction of every width now
    assert fresh.ms == {4: 12.0, 1: 5.0} and fresh.at(1) == pytest.approx(5.0 * 0.9)
