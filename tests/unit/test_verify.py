import numpy as np
import pytest

from hetero_spec.spec.verify import greedy_accept

V = 10


def rows_spelling(tokens: list[int]) -> np.ndarray:
    """Hand-built logits whose row-wise argmax spells ``tokens``."""
    logits = np.random.default_rng(0).normal(size=(len(tokens), V)).astype(np.float32)
    for i, t in enumerate(tokens):
        logits[i, t] = logits[i].max() + 1.0
    return logits


@pytest.mark.parametrize(
    "draft, target, expected",
    [
        ([1, 2, 3], [1, 2, 3, 4], (3, 4)),  # all accepted, bonus token 4
        ([1, 2, 3], [1, 5, 3, 4], (1, 5)),  # mismatch at the second draft: recovered token 5
        ([7, 2, 3], [1, 2, 3, 4], (0, 1)),  # first draft rejected: the target's own token
        ([], [6], (0, 6)),  # nothing drafted: plain decoding
    ],
)
def test_greedy_accept_on_handbuilt_logits(draft, target, expected):
    argmax = rows_spelling(target).argmax(axis=1)
    assert greedy_accept(draft, argmax) == expected


def test_greedy_accept_never_accepts_past_a_mismatch():
    # the third draft matches again, but acceptance must stop at the first mismatch
    assert greedy_accept([1, 9, 3], np.array([1, 2, 3, 4])) == (1, 2)


def test_greedy_accept_rejects_wrong_row_count():
    with pytest.raises(ValueError):
        greedy_accept([1, 2], np.array([1, 2]))
