"""Context rows: a reduced head gains the target's rows of the tokens in the text (pure torch, no target)."""
from dataclasses import replace

import numpy as np
import pytest
import torch

from hetero_spec.draft.context_head import ContextHead
from hetero_spec.draft.int8 import int8_available
from hetero_spec.draft.runner import DraftRunner
from tests.unit.test_draft_model import CFG, D, V, make_model

REDUCED = replace(CFG, reduced_vocab=40)


def reduced_model(d2t: np.ndarray, head: torch.Tensor, seed: int = 0):
    m = make_model(REDUCED, seed)
    m.d2t = torch.as_tensor(d2t, dtype=torch.int64)
    m.attach_target_weights(m.embed, head)
    return m


def test_added_rows_are_the_target_rows_and_score_after_the_draft_rows():
    head, d2t = torch.randn(V, D), np.arange(0, 80, 2)
    ch = ContextHead(lambda f: f @ head[d2t].t(), d2t, head, dtype=torch.float32, device=torch.device("cpu"))
    assert ch.add([4, 5, 5, 7, 299, -1, V]) == 3  # 4 is a draft row; 5 once; -1 and V are not ids
    assert ch.add([5, 7]) == 0 and list(ch.d2t[-3:]) == [5, 7, 299]
    # one token at a time, as every round adds its own: covered, a draft row, not an id, then a new one
    assert [ch.add([t]) for t in (5, 4, -1, V, 9, 9)] == [0, 0, 0, 0, 1, 0] and ch.d2t[-1] == 9
    feat = torch.randn(3, D)
    torch.testing.assert_close(ch(feat), feat @ head[torch.as_tensor(ch.d2t)].t())
    ch.clear()
    assert ch.n_added == 0 and len(ch.d2t) == len(d2t) and ch.add([5]) == 1  # cleared rows come back on demand


@pytest.mark.skipif(not int8_available(), reason="torch build without fbgemm")
def test_greedy_is_the_argmax_over_draft_and_context_rows():
    """``greedy`` (a chain step's proposal, through the int8 head's ``best``) picks what the argmax of the
    full logits picks, whether a draft row or an added context row wins."""
    from hetero_spec.draft.int8 import RescoredInt8Head

    torch.manual_seed(3)
    head, d2t = torch.randn(V, D), np.arange(0, 80, 2)
    base = RescoredInt8Head(head[torch.as_tensor(d2t)], reduce_range=False, smooth=None)
    ch = ContextHead(base, d2t, head, dtype=torch.float32, device=torch.device("cpu"))
    ch.add(list(range(1, V, 2)))  # every odd id: context rows win about half the time
    feats = torch.randn(200, D)
    got = [int(ch.greedy(f)) for f in feats.split(1)]
    want = [int(ch.d2t[i]) for i in ch(feats).argmax(-1)]
    assert got == want
    assert 0.2 < np.mean([t % 2 for t in got]) < 0.8, "one part always won, so the test shows nothing"
    plain = ContextHead(lambda f: f @ head[d2t].t(), d2t, head, dtype=torch.float32, device=torch.device("cpu"))
    plain.add([1, 3, 5])
    f = torch.randn(1, D)
    assert int(plain.greedy(f)) == int(plain.d2t[plain(f).argmax()])  # a base without ``best``


def test_no_rows_without_a_source_and_none_past_the_limit():
    head, d2t = torch.randn(V, D), np.arange(40)
    assert ContextHead(lambda f: f, d2t, None, dtype=torch.float32, device=torch.device("cpu")).add([100]) == 0
    ch = ContextHead(lambda f: f, d2t, head, dtype=torch.float32, device=torch.device("cpu"), limit=2)
    assert ch.add([100, 101, 102]) == 2 and ch.add([103]) == 0 and ch.n_added == 2


def test_a_reduced_draft_with_context_rows_proposes_what_the_draft_with_those_rows_built_in_does():
    """The same weights (same seed) with d2t = draft rows + context ids: the greedy chains agree, so an
    added row is exactly the row a draft with it in its head would score."""
    torch.manual_seed(1)
    head = torch.randn(V, D) * 3
    d2t = np.sort(np.random.default_rng(0).choice(V, 40, replace=False))
    context = [t for t in range(V) if t not in set(d2t)][:60]
    a = DraftRunner(reduced_model(d2t, head), device="cpu", dtype="float32")
    union = np.concatenate([d2t, context])
    b = DraftRunner(reduced_model(union, head), device="cpu", dtype="float32", context_rows=False)
    feats, toks = np.random.default_rng(2).standard_normal((6, D)).astype(np.float32), [3, 9, 4, 1, 7, 2]
    before = a.propose(feats, toks, k=4)
    a.rollback(0)
    assert a.add_context(context) == 60
    got, want = a.propose(feats, toks, k=4), b.propose(feats, toks, k=4)
    assert got == want and set(want) & set(context), "the context rows never won, so the test shows nothing"
    assert got != before
    a.rollback(0)  # a new text: the rows go
    assert a.propose(feats, toks, k=4) == before
