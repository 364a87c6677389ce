"""Acceptance rules, defined once.  p is the target, q the draft (Leviathan et al.).

Terms: the target verifies [x_last, d_1..d_k] in one decode and its row j predicts the
token after position j.  *Accepted* drafts are the longest prefix d_1..d_a that the
target agrees with; the target then contributes one token of its own: the *bonus* token
when all k were accepted, the *recovered* token at the first mismatch otherwise.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from .sampling import sample


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


# ------------------------------------------------------------------------ trees
def greedy_accept_tree(children: list[list[int]], tokens: np.ndarray, target_argmax: np.ndarray) -> tuple[list[int], int]:
    """Greedy over a tree: follow the child whose token equals the target's argmax.

    children[i]: child nodes of node i; tokens [n] node tokens; target_argmax [n] argmax of
    p at each node's row.  Returns (accepted nodes root-first, without the root; the
    target's own next token).  A chain tree gives exactly ``greedy_accept``.
    """
    node, path = 0, []
    while True:
        want = int(target_argmax[node])
        nxt = next((c for c in children[node] if int(tokens[c]) == want), None)
        if nxt is None:
            return path, want
        path.append(nxt)
        node = nxt


def residual(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """norm(max(0, p - q)): what is left of p once q's proposal has been rejected."""
    r = np.maximum(p - q, 0.0)
    s = r.sum()
    return r / s if s > 0 else p  # s == 0 only when p == q, where rejection cannot happen


def without(q: np.ndarray, token: int) -> np.ndarray:
    """q with one token removed and renormalised: the law of the next draw without replacement."""
    q = q.copy()
    q[token] = 0.0
    s = q.sum()
    return q / s if s > 0 else q


def reject_siblings(
    p: np.ndarray,
    q: np.ndarray,
    candidates: list[int],
    rng: np.random.Generator,
    residual_fn=residual,
) -> tuple[int | None, int]:
    """Recursive rejection over one node's children (SpecInfer; Jeon et al.'s RSD without replacement).

    p [V] float64: the target's processed distribution at this node; q [V] float64: the
    draft's processed distribution the children were drawn from, one after another
    without replacement, in ``candidates`` order.  Child i is accepted with probability
    min(1, p_i(c) / q_i(c)); after a rejection p_{i+1} = norm(max(0, p_i - q_i)) and q_{i+1}
    is q_i without c.  Returns (index of the accepted candidate or None, token), where on
    None the token is drawn from the final residual.  With one candidate this is standard
    speculative sampling (Leviathan et al.).  ``residual_fn`` exists for the test that a
    broken rule is caught.
    """
    for i, c in enumerate(candidates):
        qc = q[c]
        if qc > 0 and rng.random() * qc < p[c]:
            return i, int(c)
        p = residual_fn(p, q)
        q = without(q, c)
    return None, sample(p, rng)


def sample_accept_tree(
    children: list[list[int]],
    tokens: np.ndarray,
    p_at,
    q_at,
    rng: np.random.Generator,
    residual_fn=residual,
) -> tuple[list[int], int]:
    """Walk the tree from the root, rejection-sampling among each node's children.

    ``p_at(node)`` -> processed target distribution [V] at that node's row (called only on
    the visited path, so rows nobody reaches are never processed); ``q_at(node)`` -> the
    draft distribution its children were drawn from.  Returns (accepted nodes, next token):
    the recovered token after a rejection, or the bonus token drawn from p at a leaf.
    """
    node, path = 0, []
    while True:
        kids = children[node]
        p = p_at(node)
        if not kids:
            return path, sample(p, rng)
        idx, tok = reject_siblings(p, q_at(node), [int(tokens[c]) for c in kids], rng, residual_fn)
        if idx is None:
            return path, tok
        node = kids[idx]
        path.append(node)

