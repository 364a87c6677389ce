"""Loop trimming of self-distilled answers (train/loops.py)."""
import numpy as np

from hetero_spec.features import FeatureSequence
from hetero_spec.train.loops import NGRAM, copied, loop_tail_mask, trim_loops


def test_a_token_copies_only_once_its_ngram_repeats():
    ids = np.array(list(range(10)) * 3)
    c = copied(ids)
    assert not c[:10 + NGRAM - 1].any()  # the second pass copies from its NGRAM-th token on
    assert c[10 + NGRAM - 1:].all()
    assert not copied(np.arange(40)).any()


def test_each_loop_keeps_its_first_tokens_and_a_new_token_restarts_the_count():
    loop = list(range(100, 110))
    ids = np.array([1, 2, 3] + loop * 4 + [7, 8, 9, 10, 11, 12, 13, 14, 15] + loop * 2)
    learn = np.r_[np.zeros(3, bool), np.ones(len(ids) - 3, bool)]
    keep = 5
    mask = loop_tail_mask(ids, learn, keep)
    c = copied(ids)
    runs, run = [], 0
    for t in range(len(ids)):  # the reference: a run of copied answer tokens, cut at every new token
        run = run + 1 if c[t] else 0
        if run == 1:
            runs.append(t)
    assert len(runs) == 2  # the first loop, and the loop again after the new text
    for start in runs:
        assert mask[start:start + keep].all() and not mask[start + keep]
    assert mask[~c & learn].all() and not mask[:3].any()  # new answer tokens always score; the prompt never


def test_a_run_does_not_carry_across_a_turn_boundary():
    ids = np.array(list(range(20)) * 2)
    learn = np.ones(len(ids), bool)
    learn[30] = False  # a non-answer token inside the copied run (from 27 on), as at the next user turn
    mask = loop_tail_mask(ids, learn, 3)
    assert mask[27:30].all() and not mask[30]
    assert mask[31:34].all() and not mask[34:].any()  # the count restarts after the boundary


def test_trim_cuts_after_the_last_scored_token_and_keeps_rows_aligned():
    ids = np.array(list(range(12)) * 5, dtype=np.int32)
    n = len(ids)
    hidden = np.arange(n * 2, dtype=np.float16).reshape(n, 2)
    seq = FeatureSequence(ids, hidden, np.r_[np.zeros(4), np.ones(n - 4)].astype(np.uint8),
                          {"tap_2": hidden * 2})
    out = trim_loops(seq, 4)
    end = 12 + NGRAM - 1 + 4  # the loop's first copied token, plus the 4 it keeps
    assert len(out) == end and int(out.loss_mask.sum()) == end - 4
    assert (out.input_ids == ids[:end]).all() and (out.hidden == hidden[:end]).all()
    assert (out.extras["tap_2"] == hidden[:end] * 2).all() and out.loss_mask.dtype == np.uint8
    assert trim_loops(seq, 0) is seq
