"""Trim the repetition loops of self-distilled answers before training.

A small target decoding greedily falls into loops: in the SmolLM2-135M corpus, 87% of the answers
run to the 256-token cap, and 58% of all answer tokens continue an 8-gram that already occurred in
the same sequence.  Those tokens are trivial for a draft (copy the loop) and they dominate both the
training compute and the held-out score, which then overstates the acceptance on fresh text.  The
draft still has to follow a loop when the target falls into one, so each loop keeps its first
``keep`` tokens; the rest lose their loss, and a sequence ends after its last token that keeps one.
"""
from __future__ import annotations

import numpy as np

from ..features import FeatureSequence

NGRAM = 8  # a token "copies" when it ends an n-gram of this length seen earlier in the sequence


def copied(ids: np.ndarray, n: int = NGRAM) -> np.ndarray:
    """[T] bool: token t ends an n-gram (ids[t-n+1..t]) that also ends at some earlier position."""
    ids = np.asarray(ids, dtype=np.int64)
    out = np.zeros(len(ids), dtype=bool)
    if len(ids) < n + 1:
        return out
    windows = np.lib.stride_tricks.sliding_window_view(ids, n)  # row j = ids[j..j+n-1], ends at j+n-1
    _, first, inverse = np.unique(windows, axis=0, return_index=True, return_inverse=True)
    out[n - 1:] = first[inverse.reshape(-1)] < np.arange(len(windows))
    return out


def loop_tail_mask(ids: np.ndarray, loss_mask: np.ndarray, keep: int) -> np.ndarray:
    """``loss_mask`` without the answer tokens past the first ``keep`` of each run of copied tokens
    (a run ends at a token that is new, or at a token without loss, such as the next user turn)."""
    learn = np.asarray(loss_mask).astype(bool)
    copy = copied(ids) & learn
    out = learn.copy()
    run = 0
    for t in np.flatnonzero(learn):
        if not copy[t]:
            run = 0
        else:
            run = run + 1 if t > 0 and learn[t - 1] else 1
        if run > keep:
            out[t] = False
    return out


def trim_loops(seq: FeatureSequence, keep: int) -> FeatureSequence:
    """``seq`` with its loop tails unscored and cut after its last scored token (the rows after it
    would cost compute and teach nothing).  ``keep`` <= 0 leaves it as it is."""
    if keep <= 0:
        return seq
    mask = loop_tail_mask(seq.input_ids, seq.loss_mask, keep)
    scored = np.flatnonzero(mask)
    end = int(scored[-1]) + 1 if len(scored) else len(seq)
    return FeatureSequence(seq.input_ids[:end], seq.hidden[:end], mask[:end].astype(seq.loss_mask.dtype),
                           {k: v[:end] for k, v in seq.extras.items()})
