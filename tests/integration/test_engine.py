"""The batched engine on the real GGUF: several sequences in one context decode exactly as one alone.

The reference is ``LlamaTarget`` (one sequence, the path ``hetero-spec run`` takes): a greedy
answer and the logits of every answer token must be the same, bit for bit, when the prompt is
served in a slot beside others (prompt chunks and plain rows of other sequences in the same
``llama_decode``, slots reused by later requests).
"""
from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest

from hetero_spec.config import SamplingConfig
from hetero_spec.engine import Drafting, Engine, QueueFull, Request, StepCost
from hetero_spec.engine.prompt_cache import PromptCache
from hetero_spec.spec.orchestrator import generate_tokens
from hetero_spec.target.llama_target import LlamaTarget, TargetOptions
from hetero_spec.target.sequences import SequenceOptions, SequenceTarget

SEQ_CTX = 256
TEXTS = [
    "The capital of France is",
    "1, 2, 3, 4, 5,",
    # longer than one 32-row chunk, so its prefill is cut and shares steps with others' plain rows
    "The old lighthouse keeper climbed the spiral stairs every evening to light the lamp. Ships passing the "
    "rocky coast relied on its beam to find the harbour safely. One stormy night the lamp",
    "def fibonacci(n):\n    if n < 2:",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many",
]
MAX_NEW = [12, 20, 16, 6, 18]  # different lengths: slots free up at different steps and are reused


@pytest.fixture(scope="module")
def single(model_path):
    with LlamaTarget(model_path, TargetOptions(n_ctx=SEQ_CTX, n_threads=1, embeddings=False)) as t:
        yield t


@pytest.fixture(scope="module")
def prompts(single) -> list[list[int]]:
    return [single.tokenize(text) for text in TEXTS]


def decode_alone(t: LlamaTarget, prompt: list[int], max_new: int) -> tuple[list[int], list[np.ndarray]]:
    """Greedy through the single-sequence target: answer ids and each answer token's logits."""
    t.reset()
    _, logits = t.prefill(prompt)
    out, kept = [], []
    while True:
        kept.append(logits.copy())
        out.append(int(np.argmax(logits)))
        if t.is_eog(out[-1]) or len(out) >= max_new:
            return out, kept
        logits = t.verify([out[-1]])[0][-1]


@pytest.fixture(scope="module")
def reference(single, prompts):
    return [decode_alone(single, p, n) for p, n in zip(prompts, MAX_NEW)]


# Measured: in one unified KV cache the answers stay exact while every request has its own slot, and drift
# (by 0.44-0.94 here) once a freed slot's cells are refilled: a sequence's newer tokens then sit in cells
# before its older ones, and attention sums over cells in slot order.  With a KV stream per sequence
# they are identical.  Strict: if a llama.cpp update makes the unified cache exact too, this says so.
UNIFIED_DRIFTS = pytest.mark.xfail(strict=True, reason="a unified KV cache is not batch-invariant across sequences")


@pytest.mark.parametrize("kv_unified", [False, pytest.param(True, marks=UNIFIED_DRIFTS)],
                         ids=["stream-per-sequence", "unified-kv"])
@pytest.mark.parametrize("lookup", [0, 4], ids=["plain", "lookup"])
def test_slots_equal_single_sequence_bit_for_bit(model_path, prompts, reference, kv_unified, lookup):
    """With prompt-lookup rows too (trusted behind matches of 2+ tokens, so they fire often, and not priced, so
    every generating slot verifies as many rows, guesses and pads included): a verified draft row's logits are
    those of decoding its token alone."""
    opts = SequenceOptions(n_seq=3, seq_ctx=SEQ_CTX, n_threads=1, kv_unified=kv_unified)
    with SequenceTarget(model_path, opts) as target:
        engine = Engine(target, max_waiting=8,
                        drafting=Drafting(lookup_depth=lookup, lookup_min_match=2, priced=False))
        requests = [Request(p, n, keep_logits=True) for p, n in zip(prompts, MAX_NEW)]
        engine.submit(requests[0])
        engine.submit(requests[1])
        records = [engine.step()[0] for _ in range(3)]  # two slots generating before the others arrive
        for r in requests[2:]:
            engine.submit(r)
        records += [rec for rec, _ in engine.run()]
    assert any(rec.prompt_rows and rec.plain_rows for rec in records if rec), "no step mixed prompt and plain rows"
    assert max(rec.active_slots for rec in records if rec) == 3
    if lookup:  # the counting prompt repeats itself: drafts are proposed, and some accepted
        assert sum(rec.draft_rows for rec in records if rec) > 0 and sum(r.accepted for r in requests) > 0
    for req, (out, logits) in zip(requests, reference):
        assert req.out == out
        assert len(req.logits) == len(logits)
        for step, (a, b) in enumerate(zip(req.logits, logits)):
            assert np.array_equal(a, b), f"logits differ at answer token {step} (max {np.abs(a - b).max()})"


def test_unified_kv_is_exact_while_no_slot_is_reused(model_path, prompts, reference):
    """The other half of the unified-KV finding: one slot per request, staggered arrivals, no refilled cells."""
    opts = SequenceOptions(n_seq=len(prompts), seq_ctx=SEQ_CTX, n_threads=1, kv_unified=True)
    with SequenceTarget(model_path, opts) as target:
        engine = Engine(target, max_waiting=8)
        requests = [Request(p, n, keep_logits=True) for p, n in zip(prompts, MAX_NEW)]
        engine.submit(requests[0])
        engine.step()
        for r in requests[1:]:
            engine.submit(r)
        for _ in engine.run():
            pass
    for req, (out, logits) in zip(requests, reference):
        assert req.out == out and all(np.array_equal(a, b) for a, b in zip(req.logits, logits))


def test_seeded_sampling_equals_itself_alone(model_path, prompts):
    sampling = SamplingConfig(temperature=0.9, seed=1234)
    opts = SequenceOptions(n_seq=3, seq_ctx=SEQ_CTX, n_threads=1)
    with SequenceTarget(model_path, opts) as target:
        engine = Engine(target)
        alone = engine.generate_many([prompts[4]], 16, sampling=sampling)[0]
        crowd = Request(prompts[4], 16, sampling=sampling)
        engine.submit(Request(prompts[2], 16))
        engine.submit(crowd)
        engine.submit(Request(prompts[1], 16, sampling=SamplingConfig(temperature=0.9, seed=1)))
        for _ in engine.run():
            pass
    assert crowd.out == alone and len(alone) > 1


def test_a_seeded_sampled_answer_copies_and_stays_the_same_as_undrafted(model_path, prompts):
    """Sampled requests draft too (``Engine._accept``): each picked token takes the slot's next uniform from the
    same logits, so a seeded answer that verifies copies in a crowd (every proposal verified, unpriced) equals the
    same request decoded with no drafts, token for token and logits bit for bit; and its repeat copies the first
    answer from its first step, every copied row accepted, counted apart from greedy copies."""
    sampling = SamplingConfig(temperature=0.9, seed=1234)
    opts = SequenceOptions(n_seq=2, seq_ctx=SEQ_CTX, n_threads=1)
    with SequenceTarget(model_path, opts) as target:
        undrafted = Request(prompts[2], MAX_NEW[2], sampling=sampling, keep_logits=True)
        for _ in Engine(target).run([undrafted]):  # no drafting
            pass
    with copying_engine(model_path) as engine:
        first = Request(prompts[2], MAX_NEW[2], sampling=sampling, keep_logits=True)
        crowd = [Request(prompts[1], 20), Request(prompts[1], 20, sampling=SamplingConfig(seed=5))]
        for _ in engine.run([first, *crowd]):
            pass
        repeat = Request(prompts[2], MAX_NEW[2], sampling=sampling, keep_logits=True)
        for _ in engine.run([repeat]):
            pass
        greedy_reached = engine.trusted[False, 32].reached
    for req in (first, repeat):
        assert req.out == undrafted.out
        assert all(np.array_equal(a, b) for a, b in zip(req.logits, undrafted.logits))
    assert repeat.accepted == repeat.drafted > 0 and len(set(undrafted.out)) > 1
    assert engine.trusted[True, 32].accepted >= repeat.accepted and greedy_reached == 0


def test_a_seeded_sampled_answer_is_the_same_with_the_draft_model_drafting(model_path, prompts):
    """The draft model's chains are one token per row as copies are: a sampled request with them verified every
    step (3 deep, unpriced) equals itself with no drafts, logits bit for bit, and keeps some of them."""
    from hetero_spec.api import draft_taps

    sampling = SamplingConfig(temperature=0.5, seed=7)
    opts = SequenceOptions(n_seq=2, seq_ctx=SEQ_CTX, n_threads=1, features=True, taps=draft_taps(DARTER))
    with SequenceTarget(model_path, opts) as target:
        undrafted = Request(prompts[4], 24, sampling=sampling, keep_logits=True)
        for _ in Engine(target).run([undrafted]):
            pass
        for seq in range(opts.n_seq):  # the next engine's slots start empty
            target.clear(seq)
        engine = Engine(target, drafting=Drafting(draft_depth=3, priced=False), draft=slot_drafts(target, 2))
        drafted = Request(prompts[4], 24, sampling=sampling, keep_logits=True)
        for _ in engine.run([drafted, Request(prompts[2], 24)]):
            pass
    assert drafted.out == undrafted.out
    assert all(np.array_equal(a, b) for a, b in zip(drafted.logits, undrafted.logits))
    assert drafted.drafted > 0 and drafted.accepted > 0
    assert engine.trusted[True, 0].reached > 0


@pytest.mark.parametrize("lookup", [0, 4], ids=["plain", "lookup"])
def test_an_answer_that_fills_its_slot_ends_where_plain_decoding_does(model_path, prompts, lookup):
    """Its last token is picked with every cell of the slot held, as ``run``'s is at a full context; the
    engine ended one token earlier.  With copies (the counting prompt repeats itself up to the end), no
    draft row is placed past the slot's last cell."""
    seq_ctx, prompts = 64, prompts[:4]  # the last prompt's answer ends (EOG) within 64 cells
    with LlamaTarget(model_path, TargetOptions(n_ctx=seq_ctx, n_threads=1)) as alone:
        plain = []
        for p in prompts:
            alone.reset()
            steps = list(generate_tokens(alone, None, p, max_new_tokens=200, draft_len=0))
            assert steps[-1].stop_reason == "context_full"
            plain.append([t for s in steps for t in s.tokens])
    with SequenceTarget(model_path, SequenceOptions(n_seq=2, seq_ctx=seq_ctx, n_threads=1)) as target:
        engine = Engine(target, max_waiting=len(prompts),
                        drafting=Drafting(lookup_depth=lookup, lookup_min_match=2, priced=False))
        requests = [Request(p, 200) for p in prompts]
        for r in requests:
            engine.submit(r)
        records = [rec for rec, _ in engine.run()]
        assert_cells_hold_only_text(engine)
    if lookup:
        assert sum(rec.draft_rows for rec in records if rec) > 0
    for req, out in zip(requests, plain):
        assert (req.out, req.stop_reason) == (out, "context_full")
        assert len(req.prompt) + len(req.out) == seq_ctx + 1


def test_generate_many_fifo_queue_and_cancel(model_path, prompts, reference):
    opts = SequenceOptions(n_seq=2, seq_ctx=SEQ_CTX, n_threads=1)
    with SequenceTarget(model_path, opts) as target:
        engine = Engine(target, max_waiting=2)
        # more prompts than slots + queue: the batch entry feeds them in as room appears
        answers = engine.generate_many(prompts, max(MAX_NEW))
        assert [a[:n] for a, n in zip(answers, MAX_NEW)] == [out for out, _ in reference]
        first, second, third, fourth = (Request(p, 50) for p in prompts[:4])
        engine.submit(first)
        engine.submit(second)
        engine.step()  # both take a slot
        engine.submit(third)
        engine.submit(fourth)
        with pytest.raises(QueueFull):  # two wait already
            engine.submit(Request(prompts[4], 4))
        first.cancelled = True
        _, finished = engine.step()  # one step later its slot is free, and the oldest waiting request has it
        assert finished == [first] and first.stop_reason == "cancelled"
        assert third in [s.request for s in engine.scheduler.active] and list(engine.scheduler.waiting) == [fourth]
        for _ in engine.run():
            pass
    assert second.stop_reason in ("eog", "max_tokens") and third.done and fourth.done


def test_run_takes_requests_as_the_queue_has_room_and_a_run_left_early_drops_the_rest(model_path, prompts, reference):
    """Engine.run, the loop under every batch job: it asks its source for a request only while the queue has room,
    asks again after a step when told "none now", and closed early it leaves the engine empty and ready."""
    opts = SequenceOptions(n_seq=2, seq_ctx=SEQ_CTX, n_threads=1)
    with SequenceTarget(model_path, opts) as target:
        engine = Engine(target, max_waiting=1)
        requests = [Request(p, n) for p, n in zip(prompts, MAX_NEW)]
        asked: list[int] = []  # requests handed over, each time the source is asked

        def source():
            for i, r in enumerate(requests):
                while i == 3 and not requests[2].done:  # the fourth waits until the third has finished
                    asked.append(-1)
                    yield None
                asked.append(i)
                yield r

        waiting = [len(engine.scheduler.waiting) for _ in engine.run(source())]
        assert [r.out for r in requests] == [out for out, _ in reference]
        assert max(waiting) <= 1 and asked.count(-1) >= 1 and [i for i in asked if i >= 0] == [0, 1, 2, 3, 4]
        assert engine.idle

        with pytest.raises(RuntimeError, match="none now"):  # nothing in flight would ever change its mind
            for _ in engine.run(iter([None])):
                pass

        again = [Request(p, 50) for p in prompts[:4]]
        steps = engine.run(again)
        next(steps)
        steps.close()
        assert engine.idle
        assert again[0].stop_reason == "cancelled" and len(again[0].out) < 50  # in a slot when the run was closed
        assert again[3].stop_reason is None and not again[3].out  # never taken from the source
        assert engine.generate_many([prompts[0]], MAX_NEW[0]) == [reference[0][0]]  # the next job runs as usual


def assert_cells_hold_only_text(engine: Engine) -> None:
    """Every sequence holds exactly its slot's text: no pad row or rejected draft left behind."""
    for slot in engine.scheduler.slots:
        assert engine.target.pos_max(slot.seq) == slot.n_past - 1, (slot.seq, slot.n_past)


def test_layout_sorted_equal_width_and_pads_removed(model_path, prompts, reference):
    """The middle slot finishes first and nobody waits: the next steps pad it so that the other two stay in one
    micro-batch, every step's rows are sorted by sequence with the same width each, and the pads leave."""
    opts = SequenceOptions(n_seq=3, seq_ctx=SEQ_CTX, n_threads=1)
    order = [0, 3, 4]  # 12, 6 and 18 new tokens: the one in slot 1 ends first
    with SequenceTarget(model_path, opts) as target:
        engine = Engine(target, max_waiting=8, drafting=Drafting(lookup_depth=3, lookup_min_match=2, priced=False))
        requests = [Request(prompts[i], MAX_NEW[i], keep_logits=True) for i in order]
        for r in requests:
            engine.submit(r)
        pads = 0
        while not engine.idle:
            record, _ = engine.step()
            assert_cells_hold_only_text(engine)
            pads += record.pad_rows if record else 0
            gen = engine.scheduler.generating
            if len(gen) >= 2:
                plan_rows = engine.scheduler.plan({}).rows
                seqs = [row.seq for _, row, _ in plan_rows]
                assert seqs == sorted(seqs) and sorted(set(seqs)) == list(range(seqs[0], seqs[-1] + 1))
    assert pads > 0, "no step padded the free middle slot"
    for req, i in zip(requests, order):
        out, logits = reference[i]
        assert req.out == out and all(np.array_equal(a, b) for a, b in zip(req.logits, logits))


def test_second_turn_reuses_its_slot_cells_exactly(model_path, single, prompts):
    """Turn 2 of a conversation takes the slot that holds turn 1 (another request took the empty slot in
    between), starts from the cells it finds there, and answers as if decoded alone, logits bit for bit."""
    opts = SequenceOptions(n_seq=2, seq_ctx=SEQ_CTX, n_threads=1)
    with SequenceTarget(model_path, opts) as target:
        engine = Engine(target, max_waiting=4)
        first = Request(prompts[2], 10)
        engine.submit(first)
        for _ in engine.run():
            pass
        other = Request(prompts[0], 4)
        engine.submit(other)
        engine.step()
        assert engine.scheduler.slots[1].request is other  # the empty slot, not the one holding turn 1
        follow_up = first.prompt + first.out + single.tokenize(" Then the keeper", add_special=False)
        second = Request(follow_up, 12, keep_logits=True)
        engine.submit(second)
        record, _ = engine.step()
        assert engine.scheduler.slots[0].request is second
        assert record.reused == len(first.prompt) + len(first.out) - 1
        for _ in engine.run():
            pass
        assert_cells_hold_only_text(engine)
    out, logits = decode_alone(single, follow_up, 12)
    assert second.out == out and all(np.array_equal(a, b) for a, b in zip(second.logits, logits))


def test_a_turn_whose_slot_was_taken_gets_its_cells_back_from_the_prompt_cache(model_path, single, prompts):
    """Turn 1 is served, then two other requests take both slots (turn 1's cells are saved to host memory as
    the second one takes its slot); turn 2 then finds no slot holding turn 1, gets its cells put back from the
    prompt cache, and answers as if decoded alone, logits bit for bit.  Without the cache it starts cold."""
    follow = single.tokenize(" Then the keeper", add_special=False)
    opts = SequenceOptions(n_seq=2, seq_ctx=SEQ_CTX, n_threads=1)
    reused, restored = {}, {}
    for cache_on in (True, False):
        with SequenceTarget(model_path, opts) as target:
            cache = PromptCache(64 << 20) if cache_on else None
            engine = Engine(target, max_waiting=4, prompt_cache=cache)
            first = Request(prompts[2], 10)
            engine.submit(first)
            for _ in engine.run():
                pass
            for i in (0, 4):  # the empty slot first, then turn 1's
                engine.submit(Request(prompts[i], 4))
            for _ in engine.run():
                pass
            assert not any(s.cached[:len(first.prompt)] == first.prompt for s in engine.scheduler.slots)
            held = len(first.prompt) + len(first.out) - 1  # the cells turn 1 left: its newest token was never decoded
            if cache_on:
                assert len(cache) == 1 and cache.best(first.prompt + first.out + follow)[0] == held
            second = Request(first.prompt + first.out + follow, 12, keep_logits=True)
            engine.submit(second)
            records = [rec for rec, _ in engine.run() if rec]
            reused[cache_on] = sum(rec.reused for rec in records)
            restored[cache_on] = sum(rec.restored for rec in records)
            assert_cells_hold_only_text(engine)
        out, logits = decode_alone(single, second.prompt, 12)
        assert second.out == out and all(np.array_equal(a, b) for a, b in zip(second.logits, logits))
    # the slot turn 2 took shared a few first tokens with it (the template's start): those were there already
    assert reused[True] == held and reused[False] < 16
    assert restored == {True: held - reused[False], False: 0}


@contextmanager
def copying_engine(model_path) -> Iterator[Engine]:
    """Two slots that verify every copy draft (4 deep, unpriced): the copy tests' engine."""
    with SequenceTarget(model_path, SequenceOptions(n_seq=2, seq_ctx=SEQ_CTX, n_threads=1)) as target:
        yield Engine(target, max_waiting=2, drafting=Drafting(lookup_depth=4, priced=False))


def test_a_repeated_prompt_copies_the_past_answer_from_its_first_step(model_path, prompts, reference):
    """The past answer is cached after its prompt's end (``SuffixConfig.prompt_context``), so the same prompt
    again matches at once: every step of the repeat verifies copied rows and accepts them all, where a cache of
    answers alone would give nothing to copy until the repeat's own answer had matched 8 tokens of it."""
    out, _ = reference[2]
    with copying_engine(model_path) as engine:
        first = Request(prompts[2], MAX_NEW[2])
        engine.submit(first)
        for _ in engine.run():
            pass
        repeat = Request(prompts[2], MAX_NEW[2])
        engine.submit(repeat)
        records = [rec for rec, _ in engine.run() if rec]
    assert first.out == repeat.out == out
    generating = [rec for rec in records if not rec.prompt_rows]  # after the step that read the prompt
    assert generating and all(rec.draft_rows for rec in generating)
    assert repeat.accepted == repeat.drafted > 0 and len(generating) <= -(-(len(out) - 1) // 5)


@pytest.mark.parametrize("shadowed", [True, False], ids=["checked-unverified", "verified-only"])
def test_a_copy_priced_out_by_its_prior_is_checked_unverified_until_it_pays(model_path, prompts, shadowed, monkeypatch):
    """Rows priced so that a copy pays only if nearly every copied token is right (t(k+1) = 1 + 0.97 k one-row
    decodes): at the longest match class's prior (0.95) the repeat of a past answer drafts nothing at first, its
    copies are checked against the tokens it picks instead, and once they have shown its class right often enough
    it copies, every copied row accepted.  Learning only from verified copies, it would never start."""
    if not shadowed:
        monkeypatch.setattr(Engine, "_shadowed", lambda self, bucket, depth, matched: None)
    opts = SequenceOptions(n_seq=2, seq_ctx=SEQ_CTX, n_threads=1)
    with SequenceTarget(model_path, opts) as target:
        engine = Engine(target, max_waiting=2, drafting=Drafting(lookup_depth=4))
        engine.cost = StepCost({1: 10.0, 5: 48.8})
        engine.cost.observe = lambda rows, ms: None  # the prices stay what the test says
        first = Request(prompts[2], 40)
        engine.submit(first)
        for _ in engine.run():
            pass
        prior = engine.trusted[False, 32].rate
        repeat = Request(prompts[2], 40)
        engine.submit(repeat)
        drafted = [rec.draft_rows for rec, _ in engine.run() if rec and not rec.prompt_rows]
    assert repeat.out == first.out and len(repeat.out) == 40
    assert prior == pytest.approx(0.95) and drafted[0] == 0  # priced out at the prior
    if shadowed:
        assert repeat.accepted == repeat.drafted > 0, drafted
        assert engine.trusted[False, 32].reached > repeat.drafted  # the unverified copies' evidence came first
    else:
        assert repeat.drafted == 0 and engine.trusted[False, 32].reached == 0


def test_a_request_in_flight_lends_its_answer_to_a_repeat_behind_it(model_path, prompts, reference):
    """Two slots, the same prompt: the repeat arrives while the first is 10 tokens ahead, and copies from the
    first's answer so far (``SuffixRequest.propose(peers=...)``) before that answer is finished or cached."""
    out, _ = reference[2]
    with copying_engine(model_path) as engine:
        first = Request(prompts[2], MAX_NEW[2])
        engine.submit(first)
        while len(first.out) < 10:
            engine.step()
        repeat = Request(prompts[2], 6)
        engine.submit(repeat)
        while not repeat.out:  # its prompt read: the first answer token
            engine.step()
        assert len(engine.suffix_cache) == 0 and repeat.drafted == 0  # nothing to copy from but the peer
        engine.step()
        assert not first.done and repeat.accepted == repeat.drafted == 4
        for _ in engine.run():
            pass
    assert first.out == out and repeat.out == out[:6]


def test_draft_rows_priced_on_the_batch(model_path, prompts):
    """The probe measures a decode at several fills; with rows priced nearly free the repeating prompts draft,
    and with every extra row as dear as a decode of its own nothing drafts."""
    opts = SequenceOptions(n_seq=2, seq_ctx=SEQ_CTX, n_threads=1)
    with SequenceTarget(model_path, opts) as target:
        engine = Engine(target, max_waiting=4, drafting=Drafting(lookup_depth=4, lookup_min_match=2))
        cost = engine.calibrate(rows=(1, 8, 32), repeats=2, context=64)
        assert set(cost.ms) == {1, 8, 32} and cost.ms[32] > cost.ms[1]
        assert all(target.pos_max(s.seq) == -1 for s in engine.scheduler.slots)

        def drafted(step_cost: StepCost) -> int:
            step_cost.observe = lambda rows, ms: None  # the prices stay what the test says
            engine.cost = step_cost
            for p in (prompts[1], prompts[1]):
                engine.submit(Request(p, 24))
            return sum(rec.draft_rows for rec, _ in engine.run() if rec)

        assert drafted(StepCost({1: 10.0, 64: 10.5})) > 0
        assert drafted(StepCost({1: 10.0, 2: 20.0, 64: 640.0})) == 0


def test_micro_batches_follow_split_equal():
    """The pricing's model of llama.cpp's split (``split_equal``, sequential): one micro-batch for the same rows
    from consecutive sequences, more for a gap or unequal rows, at most 32 rows each."""
    from hetero_spec.engine.cost import micro_batches

    assert micro_batches([(0, 1), (1, 1), (2, 1), (3, 1)], 32) == [4]
    assert micro_batches([(0, 1), (2, 1), (3, 1)], 32) == [1, 2]
    assert micro_batches([(0, 5), (1, 1), (2, 5), (3, 1)], 32) == [4, 4, 4]
    assert micro_batches([(s, 5) for s in range(8)], 32) == [32, 8]
    assert micro_batches([(0, 1), (1, 33)], 32) == [2, 32]


# ------------------------------------------------------------------------------ a draft model in the slots
DARTER = Path(__file__).resolve().parents[2] / "drafts" / "smollm2-135m-darter.safetensors"


def slot_drafts(target: SequenceTarget, n_slots: int, dtype: str = "auto"):
    from hetero_spec.api import load_runner
    from hetero_spec.config import DenoiseConfig
    from hetero_spec.engine.drafts import SlotDrafts

    return SlotDrafts(load_runner(target, DARTER, device="cpu", dtype=dtype, denoise=DenoiseConfig()), n_slots)


def test_draft_model_chains_in_every_slot_keep_answers_and_logits_exact(model_path, prompts, reference):
    """The shipped draft drafts 3 tokens for every generating slot each step (unpriced): every verified row's
    logits are still those of decoding alone, and every chain a slot proposed is the one a draft alone proposes
    from the same text's features, so each slot's cache read the right rows (prompt rows, kept rows and the
    token picked after each) in the right order."""
    from hetero_spec.api import draft_taps
    from hetero_spec.target.sequences import Row

    opts = SequenceOptions(n_seq=3, seq_ctx=SEQ_CTX, n_threads=1, features=True, taps=draft_taps(DARTER))
    with SequenceTarget(model_path, opts) as target:
        drafts = slot_drafts(target, 3)
        engine = Engine(target, max_waiting=8, drafting=Drafting(draft_depth=3, priced=False), draft=drafts)
        calls = []  # (request, position of its pending token, the chain proposed)
        propose = drafts.propose

        together = []

        def spy(seqs, k):
            out = propose(seqs, k)
            calls.extend((engine.scheduler.slots[s].request, engine.scheduler.slots[s].n_past, c) for s, c in out.items())
            together.append(len(out))
            return out

        drafts.propose = spy
        requests = [Request(p, n, keep_logits=True) for p, n in zip(prompts, MAX_NEW)]
        for r in requests:
            engine.submit(r)
        records = [rec for rec, _ in engine.run() if rec]
        assert max(rec.active_slots for rec in records) == 3
        assert sum(r.drafted for r in requests) > 0 and sum(r.accepted for r in requests) > 0
        for req, (out, logits) in zip(requests, reference):
            assert req.out == out
            assert all(np.array_equal(a, b) for a, b in zip(req.logits, logits))
        assert max(together) >= 2, "the slots never drafted together"
        alone = slot_drafts(target, 1)
        same = differ = 0
        for req in requests:  # the text's features, decoded whole in sequence 0 (bit-identical to the steps')
            text = req.prompt + req.out
            target.clear(0)
            target.decode([Row(0, t, p, True) for p, t in enumerate(text[:-1])])
            feats = target.features()
            mine = [(pos, chain) for r, pos, chain in calls if r is req]
            assert mine or len(req.out) < 2
            for pos, chain in mine:
                alone.start(0, req.prompt, reused=0)
                alone.feed(0, feats[:pos], text[1:pos + 1])
                if alone.propose([0], k=3)[0] == chain:
                    same += 1
                else:
                    differ += 1
    # chains drafted together go through the int8 layers as one batch, whose activations are quantized together:
    # a near-tie may go the other way (drafts.py); a slot reading wrong rows would differ nearly always
    assert differ <= 0.05 * (same + differ), (same, differ)


@pytest.mark.parametrize("batched,dtype", [(True, "float32"), (False, "float32"), (True, "int8-full")],
                         ids=["one-forward-per-depth", "slot-after-slot", "native-chains"])
def test_slot_drafts_propose_what_a_draft_alone_proposes(model_path, prompts, batched, dtype):
    """Two texts fed to two slots in turns, a reused prefix skipped in one: each slot's chains equal those of a
    draft that read only its own text (float32 weights: a batch of rows gives each row's own result), so no slot
    sees another's cells or context rows, whether the slots draft in one forward per depth or one by one.  With
    int8 weights on the CPU two slots draft slot by slot through the native chain (``NATIVE_MAX_SLOTS``),
    pointed at each slot's cache in turn."""
    from hetero_spec.api import draft_taps
    from hetero_spec.target.sequences import Row

    opts = SequenceOptions(n_seq=2, seq_ctx=SEQ_CTX, n_threads=1, features=True, taps=draft_taps(DARTER))
    with SequenceTarget(model_path, opts) as target:
        texts = [prompts[2], prompts[4]]
        both = slot_drafts(target, 2, dtype=dtype)  # first: int8 weights are calibrated on the target's sequence 0
        both.batched = batched
        alone = [slot_drafts(target, 1, dtype=dtype) for _ in texts]
        feats = []
        for seq, ids in enumerate(texts):
            target.decode([Row(seq, t, p, True) for p, t in enumerate(ids)])
            feats.append(target.features())
    assert (both.runner._native is not None) == (dtype == "int8-full")
    skip = 3  # slot 1's first cells were reused from an earlier request: no features, skipped
    for seq in (0, 1):  # an earlier request in each slot leaves its cells behind: the other text, read whole
        other = 1 - seq
        both.start(seq, texts[other], reused=0)
        both.feed(seq, feats[other][:-1], texts[other][1:])
        both.propose([seq], k=1)
    for seq, ids in enumerate(texts):
        both.start(seq, ids, reused=skip * seq)
        alone[seq].start(0, ids, reused=skip * seq)
    fed = [0, skip]  # rows each slot has been given
    got, want = {0: [], 1: []}, {0: [], 1: []}
    ahead = 8  # slot 1 is 8 positions ahead of slot 0: a row must not see cells past its own position
    for cut in range(skip + 2, min(len(t) for t in texts) - 1 - ahead, 3):
        for seq, ids in enumerate(texts):  # each slot's rows up to its cut, the slots in turns
            end = cut + ahead * seq
            rows, nexts = feats[seq][fed[seq]:end], ids[fed[seq] + 1:end + 1]
            both.feed(seq, rows, nexts)
            alone[seq].feed(0, rows, nexts)
            fed[seq] = end
        out = both.propose([0, 1], k=3)
        for seq in (0, 1):
            got[seq].append(out[seq])
            want[seq].append(alone[seq].propose([0], k=3)[0])
    assert got == want and len(got[0]) >= 3
    assert got[0] != got[1]


def test_draft_model_is_priced_off_when_rows_are_dear_and_probes_back_off(model_path, prompts):
    """With every extra row as dear as a decode of its own the draft model only probes: at the first chance, then
    after 64 steps without drafting, then 128 (each probe that does not make it pay doubles the wait from 32)."""
    from hetero_spec.api import draft_taps

    opts = SequenceOptions(n_seq=1, seq_ctx=SEQ_CTX, n_threads=1, features=True, taps=draft_taps(DARTER))
    with SequenceTarget(model_path, opts) as target:
        drafts = slot_drafts(target, 1)
        engine = Engine(target, max_waiting=2, drafting=Drafting(draft_depth=3), draft=drafts)
        engine.cost = StepCost({1: 10.0, 2: 20.0, 64: 640.0})
        engine.cost.observe = lambda rows, ms: None  # the prices stay what the test says
        steps_at = []
        propose = drafts.propose
        step = 0

        def spy(seqs, k):
            steps_at.append(step)
            return propose(seqs, k)

        drafts.propose = spy
        engine.submit(Request(prompts[1], 240))  # "1, 2, 3, 4, 5," counts on for all of them
        for rec, _ in engine.run():
            step += 1
    gaps = [b - a for a, b in zip(steps_at, steps_at[1:])]
    assert gaps[:2] == [65, 129], steps_at  # the 64 (128) steps that did not draft, then the probe


@pytest.mark.parametrize("tapped", [False, True], ids=["final-norm", "taps"])
def test_features_cover_every_row_whatever_its_outputs(model_path, prompts, tapped):
    """``features()`` gives every row of the last decode, in row order, whether a row asked for logits or not:
    a prompt decoded with only its last row an output gives the features (and last logits) of the same prompt
    with every row an output.  With taps the other rows skip the LM head (the engine asks for logits only
    where it picks a token); with the final-norm state llama.cpp computes every row's anyway."""
    from hetero_spec.api import draft_taps
    from hetero_spec.target.sequences import Row

    opts = SequenceOptions(n_seq=1, seq_ctx=SEQ_CTX, n_threads=1, features=True,
                           taps=draft_taps(DARTER) if tapped else ())
    ids = prompts[2][:24]
    with SequenceTarget(model_path, opts) as target:
        every_logits = target.decode([Row(0, t, p, True) for p, t in enumerate(ids)]).copy()
        every = target.features()
        target.clear(0)
        last_logits = target.decode([Row(0, t, p, p == len(ids) - 1) for p, t in enumerate(ids)]).copy()  # a view
        feats = target.features()
        size = target.feature_size
    assert len(every_logits) == len(ids) and len(last_logits) == 1
    assert feats.shape == (len(ids), size)
    np.testing.assert_array_equal(feats, every)
    np.testing.assert_array_equal(last_logits[0], every_logits[-1])


def test_tapped_features_of_two_sequences_in_one_decode_equal_each_alone(model_path, prompts):
    """One decode of more rows than a micro-batch holds, two sequences in reverse order (llama.cpp regroups the
    rows by sequence into micro-batches, one of them without any output row): every row's tapped features, in
    the decode's row order, equal those of its sequence decoded alone."""
    from hetero_spec.api import draft_taps
    from hetero_spec.target.sequences import Row

    opts = SequenceOptions(n_seq=2, seq_ctx=SEQ_CTX, n_threads=1, features=True, taps=draft_taps(DARTER))
    a, b = prompts[2], prompts[4][:12]
    assert len(a) > opts.max_rows and len(b) == 12
    with SequenceTarget(model_path, opts) as target:
        target.decode([Row(1, t, p, p == len(b) - 1) for p, t in enumerate(b)]
                      + [Row(0, t, p, False) for p, t in enumerate(a)])
        both = target.features()
        alone = {}
        for seq, ids in ((0, a), (1, b)):
            target.clear(0)
            target.clear(1)
            target.decode([Row(seq, t, p, True) for p, t in enumerate(ids)])
            alone[seq] = target.features()
    assert both.shape == (len(a) + len(b), target.feature_size)
    np.testing.assert_array_equal(both[:len(b)], alone[1])
    np.testing.assert_array_equal(both[len(b):], alone[0])


@pytest.mark.parametrize("rows", [(1, 1), (3, 5), (4, 1)], ids=["a-depth", "reads-3-and-5", "reads-4-and-1"])
def test_one_forward_computes_each_slot_as_alone(model_path, prompts, rows):
    """``_forward_together`` against ``DraftRunner._forward`` slot by slot, on float32 weights: a drafted depth
    (one row per slot) and reads of real rows (a different number per slot, the shorter slot padded), with the
    slots at different positions and stale cells of an earlier, longer text past the nearer one's position,
    give the same last-row states to float rounding and write the same cells."""
    import torch

    from hetero_spec.api import draft_taps
    from hetero_spec.target.sequences import Row

    opts = SequenceOptions(n_seq=2, seq_ctx=SEQ_CTX, n_threads=1, features=True, taps=draft_taps(DARTER))
    with SequenceTarget(model_path, opts) as target:
        feats = {}
        for seq, ids in enumerate((prompts[2], prompts[4])):
            target.decode([Row(seq, t, p, True) for p, t in enumerate(ids)])
            feats[seq] = (target.features(), ids)
        drafts = slot_drafts(target, 2, dtype="float32")
    long_f, long_ids = feats[0]
    drafts.start(0, long_ids, reused=0)  # slot 0's earlier request: the long text, read whole
    drafts.feed(0, long_f[:-1], long_ids[1:])
    drafts.propose([0], k=1)
    ends = {0: 6, 1: 20}  # slot 0 now far behind slot 1, its cells 6.. still the long text's
    for seq, n in ends.items():
        f, ids = feats[seq]
        drafts.start(seq, ids, reused=0)
        drafts.feed(seq, f[:n], ids[1:n + 1])
        drafts.propose([seq], k=1)  # reads the rows
    r = drafts.runner
    M = max(rows)
    g = torch.randn(2, M, r.cfg.feature_size, generator=torch.Generator().manual_seed(0))
    tokens = torch.randint(0, 8000, (2, M), generator=torch.Generator().manual_seed(1))
    x, feat = drafts._forward_together([0, 1], g, tokens, list(rows))
    assert [drafts.slots[seq].cache.n for seq in (0, 1)] == [ends[0] + rows[0], ends[1] + rows[1]]
    cells = [drafts._k[0][seq, :, ends[seq]:ends[seq] + rows[seq]].clone() for seq in (0, 1)]
    for b, (seq, m) in enumerate(zip((0, 1), rows)):
        drafts.slots[seq].cache.n -= m  # the same cells again, alone
        drafts._use(drafts.slots[seq])
        xa, fa = r._forward(g[b:b + 1, :m], tokens[b:b + 1, :m])
        torch.testing.assert_close(x[b:b + 1], xa[:, -1:], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(feat[b:b + 1], fa[:, -1:], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(cells[b], drafts._k[0][seq, :, ends[seq]:ends[seq] + m], rtol=1e-4, atol=1e-4)


def test_answer_generator_hidden_states_even_for_one_token_answers(model_path, single, prompts):
    """``AnswerGenerator`` (export-features --regenerate): a short prompt admitted, prefilled and answered in one
    step still gets its hidden states, every row equal to ``LlamaTarget``'s prefill of prompt + answer."""
    from hetero_spec.engine.answers import AnswerGenerator, GenerateOptions

    texts = {i: prompts[i] for i in (0, 1, 3)}  # short prompts: each fits one step's chunk
    with AnswerGenerator(model_path, GenerateOptions(n_seq=2, max_new_tokens=1, seq_ctx=SEQ_CTX, n_threads=1,
                                                     hidden=True)) as gen:
        got = {key: (answer, hidden) for key, answer, hidden in gen.generate(list(texts.items()))}
    assert set(got) == set(texts)
    single.set_embeddings(True)
    try:
        for key, (answer, hidden) in got.items():
            assert len(answer) == 1 and hidden.shape[0] == len(texts[key]) + 1
            single.reset()
            want, _ = single.prefill(texts[key] + answer)
            np.testing.assert_array_equal(hidden, want)
    finally:
        single.reset()
        single.set_embeddings(False)


def test_the_engine_bench_interleaves_its_passes_and_reports_their_medians(model_path, tmp_path):
    """``scripts/bench_engine.py --passes 2`` (docs/server.md's engine table): every configuration runs once a pass,
    each figure is the median of its passes, and the command that reproduces the file is in it."""
    import json
    import statistics
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "engine.json"
    res = subprocess.run([sys.executable, str(root / "scripts" / "bench_engine.py"), str(model_path), "--slots", "2",
                          "--prompts", "2", "--max-tokens", "8", "-t", "1", "--passes", "2", "--json", str(out)],
                         capture_output=True, text=True, cwd=root)
    assert res.returncode == 0, res.stderr[-2000:]
    data = json.loads(out.read_text())
    assert "--passes 2" in data["command"]
    assert [(r["slots"], r["label"]) for r in data["rows"]] == [(1, "plain rows"), (2, "plain rows"),
                                                               (2, "copy drafts priced on the batch")]
    for row in data["rows"]:
        assert len(row["passes"]) == 2
        for key in ("generated_tps", "wall_s", "decode_s"):
            assert row[key] == statistics.median(p[key] for p in row["passes"]) > 0
    assert len(res.stdout.strip().splitlines()) == 3  # one line a configuration: the medians
