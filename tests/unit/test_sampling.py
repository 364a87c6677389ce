"""Speculative sampling reproduces the target's processed distribution; a broken rule is caught."""
from __future__ import annotations

import numpy as np
import pytest

from hetero_spec.config import SamplingConfig
from hetero_spec.spec.sampling import draw_without_replacement, process_logits, top_k_ids
from hetero_spec.spec.tree import Tree
from hetero_spec.spec.verify import reject_siblings, residual, sample_accept_tree
from tests.stats import chi2_pvalue

V = 8
N_DRAWS = 20000


def dist(seed: int, sharp: float = 1.5) -> np.ndarray:
    x = np.random.default_rng(seed).normal(size=V) * sharp
    e = np.exp(x - x.max())
    return e / e.sum()


def broken(p, q):  # the classic mistake: resample from p itself after a rejection
    return p


@pytest.mark.parametrize("m", [1, 3])  # 1 = chain (Leviathan), 3 = siblings without replacement
def test_one_node_output_follows_p(m):
    p, q = dist(1), dist(2)
    rng = np.random.default_rng(0)
    counts = np.zeros(V)
    for _ in range(N_DRAWS):
        kids = draw_without_replacement(q, m, rng)
        _, tok = reject_siblings(p, q, list(kids), rng)
        counts[tok] += 1
    assert chi2_pvalue(counts, p) > 0.01


@pytest.mark.parametrize("m", [1, 3])
def test_broken_residual_fails_the_same_test(m):
    p, q = dist(1), dist(2)
    rng = np.random.default_rng(0)
    counts = np.zeros(V)
    for _ in range(N_DRAWS):
        kids = draw_without_replacement(q, m, rng)
        _, tok = reject_siblings(p, q, list(kids), rng, residual_fn=broken)
        counts[tok] += 1
    assert chi2_pvalue(counts, p) < 0.01


def two_level_joint(residual_fn, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Joint law of the first two output tokens through a 2-level tree (2 children, each with 2)."""
    p1, q1 = dist(10), dist(11)
    p2 = {t: dist(100 + t) for t in range(V)}  # target given the first token
    q2 = {t: dist(200 + t) for t in range(V)}
    rng = np.random.default_rng(seed)
    counts = np.zeros((V, V))
    for _ in range(N_DRAWS):
        first = draw_without_replacement(q1, 2, rng)
        tokens, parents = [0, *first], [-1, 0, 0]
        for i, t in enumerate(first):
            for c in draw_without_replacement(q2[int(t)], 2, rng):
                tokens.append(int(c))
                parents.append(1 + i)
        tree = Tree(np.array(tokens), np.array(parents))
        p_at = lambda n: p1 if n == 0 else (p2[int(tree.tokens[n])] if tree.depth[n] == 1 else dist(999))
        q_at = lambda n: q1 if n == 0 else q2[int(tree.tokens[n])]
        path, nxt = sample_accept_tree(tree.children, tree.tokens, p_at, q_at, rng, residual_fn)
        out = [int(tree.tokens[n]) for n in path] + [nxt]
        if len(out) == 1:  # next round would start fresh from p2 given the first token
            out.append(int(rng.choice(V, p=p2[out[0]])))
        counts[out[0], out[1]] += 1
    expected = np.stack([p1[a] * p2[a] for a in range(V)])
    return counts.ravel(), expected.ravel()


def test_tree_joint_of_two_tokens_follows_p():
    counts, expected = two_level_joint(residual)
    assert chi2_pvalue(counts, expected) > 0.01


def test_tree_with_broken_residual_fails():
    counts, expected = two_level_joint(broken)
    assert chi2_pvalue(counts, expected) < 0.01


def test_draw_without_replacement_is_sequential_sampling():
    """The first draw follows q; the second follows q without the first."""
    q = dist(3)
    rng = np.random.default_rng(1)
    firsts, seconds_given_top = np.zeros(V), np.zeros(V)
    top = int(q.argmax())
    for _ in range(N_DRAWS):
        a, b = draw_without_replacement(q, 2, rng)
        firsts[a] += 1
        if a == top:
            seconds_given_top[b] += 1
    assert chi2_pvalue(firsts, q) > 0.01
    rest = q.copy()
    rest[top] = 0
    assert chi2_pvalue(seconds_given_top, rest / rest.sum()) > 0.01


def test_processing_matches_llama_cpp_definitions():
    logits = np.log(np.array([0.4, 0.3, 0.15, 0.1, 0.05]))
    cfg = SamplingConfig(temperature=1.0, top_k=0, top_p=0.7, min_p=0.0)
    np.testing.assert_allclose(process_logits(logits, cfg), [4 / 7, 3 / 7, 0, 0, 0])  # 0.4+0.3 reaches 0.7
    cfg = SamplingConfig(temperature=1.0, top_k=3, top_p=1.0, min_p=0.0)
    np.testing.assert_allclose(process_logits(logits, cfg), np.array([0.4, 0.3, 0.15, 0, 0]) / 0.85)
    cfg = SamplingConfig(temperature=1.0, top_k=0, top_p=1.0, min_p=0.3)  # keeps p >= 0.12
    np.testing.assert_allclose(process_logits(logits, cfg), np.array([0.4, 0.3, 0.15, 0, 0]) / 0.85)
    cfg = SamplingConfig(temperature=0.5, top_k=0, top_p=1.0, min_p=0.0)  # p^2 renormalised
    sq = np.array([0.4, 0.3, 0.15, 0.1, 0.05]) ** 2
    np.testing.assert_allclose(process_logits(logits, cfg), sq / sq.sum())
    assert process_logits(logits, SamplingConfig(temperature=0.0)).tolist() == [1, 0, 0, 0, 0]


@pytest.mark.parametrize("shape", ["normal", "spikes", "sorted", "flat"])
def test_top_k_ids_equals_a_full_partition(shape):
    """The sampled-threshold shortcut keeps exactly the k largest logits (values compared: ties may swap ids)."""
    rng = np.random.default_rng(1)
    for k in (1, 7, 40, 300, 1000):
        x = rng.standard_normal(49152).astype(np.float32) * 3
        if shape == "spikes":
            x[rng.integers(0, len(x), 50)] += 25  # more spikes than the strided sample can see
        elif shape == "sorted":
            x = np.sort(x)  # every large value in the last few strides
        elif shape == "flat":
            x = np.round(x)  # heavy ties at the threshold
        ids = top_k_ids(x, k)
        assert len(ids) == k == len(set(ids.tolist()))
        assert np.sort(x[ids]).tolist() == np.sort(np.partition(x, len(x) - k)[len(x) - k:]).tolist()


def test_deterministic_proposals_keep_p():
    """Prompt lookup proposes one fixed token (q one-hot): acceptance with p(token), else a draw
    from p without it, is a draw from p; the broken rule (no residual) is caught."""
    p = dist(5)
    for tok, rule, ok in ((int(p.argmax()), residual, True), (3, residual, True), (int(p.argmax()), broken, False)):
        q = np.zeros(V)
        q[tok] = 1.0
        rng = np.random.default_rng(2)
        counts = np.zeros(V)
        for _ in range(N_DRAWS):
            counts[reject_siblings(p, q, [tok], rng, residual_fn=rule)[1]] += 1
        assert (chi2_pvalue(counts, p) > 0.01) == ok


class _TableTarget:
    """A target whose row for a tree node is log p(. | the node's path), from hand-built tables: what
    ``spec.orchestrator`` needs of a target to verify one round, with no model."""

    n_ctx, n_embd = 1 << 20, 4
    n_vocab = V

    def __init__(self, p_at_path) -> None:
        self.p_at_path, self.tokens = p_at_path, [0]

    @property
    def n_past(self) -> int:
        return len(self.tokens)

    def set_embeddings(self, on: bool) -> None:
        pass

    def verify_tree(self, tokens, depths, seq_ids):
        tree_parents = self._parents
        rows = []
        for i in range(len(tokens)):
            path, node = [], i
            while node > 0:
                path.append(int(tokens[node]))
                node = tree_parents[node]
            rows.append(np.log(self.p_at_path(tuple(path[::-1]))))
        return np.array(rows, dtype=np.float32), np.zeros((len(tokens), self.n_embd), dtype=np.float32)

    def keep_branch(self, seq: int, path_tokens: list[int]) -> None:
        self.tokens.extend(path_tokens)

    def kv_pos_max(self) -> int:
        return len(self.tokens) - 1

    def is_eog(self, token: int) -> bool:
        return False


def suffix_chain_joint(sample_accept, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Joint law of the first two tokens a sampled round emits when the suffix structure proposes a
    two-token chain (its most probable path: a deterministic proposal), through the round loop's own
    suffix round; a round that emits one token is followed by a plain draw, as the next round would."""
    import hetero_spec.spec.orchestrator as orch
    from hetero_spec.spec.policy import FixedPolicy, Shape
    from hetero_spec.spec.suffix import SuffixRequest

    p1 = dist(20)
    p2 = {t: dist(300 + t) for t in range(V)}
    # "1 2" was followed by "3 6" twice and "5 7" once: the proposal is the chain [3, 6]
    prop = SuffixRequest([1, 2, 3, 6, 9, 1, 2, 3, 6, 4, 1, 2, 5, 7, 8, 1, 2]).propose(tree=False)
    assert prop.tokens[1:] == [3, 6]
    cfg = SamplingConfig(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
    p_at_path = lambda path: p1 if not path else (p2[path[0]] if len(path) == 1 else dist(999))
    rng = np.random.default_rng(seed)
    counts = np.zeros((V, V))
    saved = orch.sample_accept_tree
    orch.sample_accept_tree = sample_accept
    try:
        for _ in range(N_DRAWS // 2):
            target = _TableTarget(p_at_path)
            target._parents = [-1, 0, 1]
            pending = orch._Pending([np.zeros((0, 4), dtype=np.float32)], [])
            step, _, _ = orch._suffix_round(target, orch.NO_DRAFT, 0, prop, 2, 100, pending,
                                            FixedPolicy(Shape(0)), cfg, rng, 100, 0.0)
            out = step.tokens
            if len(out) == 1:
                out = out + [int(rng.choice(V, p=p2[out[0]]))]
            counts[out[0], out[1]] += 1
    finally:
        orch.sample_accept_tree = saved
    expected = np.stack([p1[a] * p2[a] for a in range(V)])
    return counts.ravel(), expected.ravel()


def test_suffix_proposals_keep_p():
    """The suffix structure's sampled rounds (a deterministic chain, q one-hot) reproduce the target's
    joint law of two tokens; the broken rule (no residual after a rejection) is caught."""
    counts, expected = suffix_chain_joint(sample_accept_tree)
    assert chi2_pvalue(counts, expected) > 0.01
    broken_rule = lambda *a, **k: sample_accept_tree(*a, **k, residual_fn=broken)
    counts, expected = suffix_chain_joint(broken_rule)
    assert chi2_pvalue(counts, expected) < 0.01
