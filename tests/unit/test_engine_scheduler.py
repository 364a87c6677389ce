"""The engine's scheduler without a model: FIFO admission, the bound, and which rows a step holds."""
from __future__ import annotations

import pytest

from hetero_spec.engine.scheduler import QueueFull, Scheduler
from hetero_spec.engine.slots import Request


def test_admission_is_fifo_into_free_slots_and_bounded():
    sch = Scheduler(n_slots=2, max_waiting=3, max_rows=32)
    reqs = [Request([1, 2, 3], 4, tag=i) for i in range(4)]
    for r in reqs[:3]:
        sch.submit(r)
    with pytest.raises(QueueFull):
        sch.submit(reqs[3])
    assert [s.request for s in sch.admit()] == reqs[:2] and list(sch.waiting) == [reqs[2]]
    assert sch.withdraw(reqs[2]) and not sch.withdraw(reqs[2]) and not sch.withdraw(reqs[0])
    sch.submit(reqs[3])
    sch.release(sch.active[0])
    assert [s.request for s in sch.admit()] == [reqs[3]]
    assert [s.request for s in sch.active] == [reqs[1], reqs[3]]  # oldest admission first


def test_rows_give_every_generating_slot_a_token_then_prompt_chunks():
    sch = Scheduler(n_slots=3, max_waiting=4, max_rows=8)
    long_prompt = list(range(100, 120))  # 20 tokens: cut into chunks
    for r in (Request([5, 6], 9), Request(long_prompt, 9), Request([7, 8, 9], 9)):
        sch.submit(r)
    a, b, c = sch.admit()
    a.fed, a.pending = 2, 42  # a generates: its token sits at position 2
    a.request.out.append(42)
    rows = sch.rows()
    assert [(s.seq, r.token, r.pos, r.output, kind) for s, r, kind in rows[:1]] == [(a.seq, 42, 2, True, "plain")]
    assert [(s, r.pos) for s, r, _ in rows[1:]] == [(b, k) for k in range(7)]  # 8 rows: 1 plain + 7 prompt
    assert not any(r.output for _, r, _ in rows[1:])  # no logits before a prompt's last row
    b.fed = 19  # one prompt row left: the rest of the step goes to the next prefilling slot
    rows = sch.rows()
    assert [(s.seq, r.pos, r.output) for s, r, _ in rows[1:]] == [(b.seq, 19, True), (c.seq, 0, False),
                                                                  (c.seq, 1, False), (c.seq, 2, True)]


def test_draft_rows_follow_their_plain_row_and_take_only_the_room_left():
    sch = Scheduler(n_slots=2, max_waiting=2, max_rows=6)
    for r in (Request([5, 6], 9), Request(list(range(100, 104)), 9)):
        sch.submit(r)
    a, b = sch.admit()
    a.fed, a.pending, a.drafts = 2, 42, [7, 8, 9, 10]
    a.request.out.append(42)
    rows = sch.rows()  # 1 plain + 4 prompt rows of b: room for one draft row
    assert [kind for _, _, kind in rows] == ["plain", "prompt", "prompt", "prompt", "prompt", "draft"]
    assert (rows[-1][1].token, rows[-1][1].pos, rows[-1][1].output) == (7, 3, True) and a.drafts == [7]
