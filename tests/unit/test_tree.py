"""Tree shape, ancestor mask, positions and sequence ids on hand-built trees; greedy tree acceptance."""
from __future__ import annotations

import numpy as np
import pytest

from hetero_spec.spec.tree import Tree
from hetero_spec.spec.verify import greedy_accept, greedy_accept_tree

#        0 (root, token 50)
#       / \
#      1   2          tokens 11, 12
#     / \   \
#    3   4   5        tokens 13, 14, 15
#    |
#    6                token 16
TREE = Tree(np.array([50, 11, 12, 13, 14, 15, 16]), np.array([-1, 0, 0, 1, 1, 2, 3]))


def test_depths_children_leaves():
    assert TREE.depth.tolist() == [0, 1, 1, 2, 2, 2, 3]
    assert TREE.children == [[1, 2], [3, 4], [5], [6], [], [], []]
    assert TREE.leaves == [4, 5, 6]


def test_ancestor_mask():
    m = TREE.ancestor_mask
    assert m[6].nonzero()[0].tolist() == [0, 1, 3, 6]
    assert m[5].nonzero()[0].tolist() == [0, 2, 5]
    assert not m[1, 2] and not m[2, 1]  # siblings never see each other
    assert np.all(np.tril(m) == m)  # parents precede children: lower triangular


def test_positions_follow_depth():
    assert TREE.positions(100).tolist() == [100, 101, 101, 102, 102, 102, 103]


def test_seq_ids_make_each_sequence_one_path():
    """Each leaf's sequence is its root-to-leaf path; the root carries every sequence."""
    ids = TREE.seq_ids
    assert ids[0] == [0, 1, 2]
    for s, leaf in enumerate(TREE.leaves):
        members = [i for i in range(TREE.n) if s in ids[i]]
        assert members == TREE.path_to(leaf)
        pos = TREE.positions(7)[members]
        assert pos.tolist() == list(range(7, 7 + len(members)))  # contiguous, as llama.cpp requires
    for i in range(TREE.n):  # the first id (the one llama.cpp's mask reads) sees exactly i's ancestors
        path = TREE.path_to(TREE.leaves[ids[i][0]])
        assert set(path[: TREE.depth[i] + 1]) == set(TREE.ancestor_mask[i].nonzero()[0])


def test_chain_is_a_tree():
    t = Tree.chain(5, [1, 2, 3])
    assert t.parents.tolist() == [-1, 0, 1, 2] and t.leaves == [3] and t.seq_ids == [[0]] * 4


def test_invalid_trees_are_refused():
    with pytest.raises(ValueError):
        Tree(np.array([1, 2]), np.array([0, 0]))
    with pytest.raises(ValueError):
        Tree(np.array([1, 2, 3]), np.array([-1, 2, 0]))


@pytest.mark.parametrize(
    "argmax, path, nxt",
    [
        ([11, 14, 0, 0, 99, 0, 0], [1, 4], 99),  # root->1->4, then the bonus at leaf 4
        ([12, 0, 15, 0, 0, 77, 0], [2, 5], 77),  # second branch
        ([11, 13, 0, 16, 0, 0, 88], [1, 3, 6], 88),  # deepest path, bonus after 6
        ([11, 42, 0, 0, 0, 0, 0], [1], 42),  # recovered token at node 1
        ([9, 0, 0, 0, 0, 0, 0], [], 9),  # nothing accepted
    ],
)
def test_greedy_accept_tree(argmax, path, nxt):
    assert greedy_accept_tree(TREE.children, TREE.tokens, np.array(argmax)) == (path, nxt)


def test_greedy_tree_on_a_chain_equals_chain_rule():
    rng = np.random.default_rng(0)
    for _ in range(200):
        drafts = rng.integers(0, 4, size=4).tolist()
        argmax = rng.integers(0, 4, size=5)
        t = Tree.chain(0, drafts)
        path, nxt = greedy_accept_tree(t.children, t.tokens, argmax)
        assert (len(path), nxt) == greedy_accept(drafts, argmax)
