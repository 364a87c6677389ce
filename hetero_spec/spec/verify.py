"""Acceptance rules, defined once.  p is the target, q the draft (Leviathan et al.).

Terms: the target verifies [x_last, d_1..d_k] in one decode and its row j predicts the
token after position j.  *Accepted* drafts are the longest prefix d_1..d_a that the
target agrees with; the target then contributes one token of its own: the *bonus* token
when all k were accepted, the *recovered* token at the first mismatch otherwise.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np


def greedy_accept(draft: Sequence[int], target_argmax: np.ndarray) -> tuple[int, int]:
    """draft [k] ids; target_argmax [k+1] ids (argmax of p per verified row).

    Returns (a, token): a accepted drafts, then the target's own next token.  The output
    is exactly what greedy decoding of the target alone produces, whatever the draft.
    """
    k = len(draft)
    if len(target_argmax) != k + 1:
        raise ValueError(f"need k+1={k + 1} target rows, got {len(target_argmax)}")
    a = 0
    while a < k and int(target_argmax[a]) == int(draft[a]):
        a += 1
    return a, int(target_argmax[a])
