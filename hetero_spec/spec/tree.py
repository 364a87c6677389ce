"""Draft trees: shape, ancestor mask, positions and sequence ids for one-decode verification.

Node 0 is the root: the last accepted token, which the target decodes with the tree.
Every other node i has ``parents[i] < i`` (nodes are stored parents first), so row i of
the verification batch is node i.  A chain of k drafts is the tree whose parents are
``[-1, 0, 1, ..., k-1]``.

The target verifies the whole tree in one ``llama_decode`` by giving every leaf its own
sequence id: a node carries the ids of all leaves below it, so each leaf's sequence is
exactly its root-to-leaf path, and llama.cpp's per-sequence causal mask becomes the tree's
ancestor mask.  Positions are the prefix length plus the depth.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np


@dataclass(frozen=True, eq=False)
class Tree:
    tokens: np.ndarray  # [n] int64; tokens[0] = root (last accepted token)
    parents: np.ndarray  # [n] int64; parents[0] = -1, parents[i] < i

    def __post_init__(self) -> None:
        t, p = np.asarray(self.tokens, dtype=np.int64), np.asarray(self.parents, dtype=np.int64)
        object.__setattr__(self, "tokens", t)
        object.__setattr__(self, "parents", p)
        if t.shape != p.shape or len(t) == 0 or p[0] != -1:
            raise ValueError("a tree needs a root (parent -1) and one parent per token")
        if np.any(p[1:] < 0) or np.any(p[1:] >= np.arange(1, len(p))):
            raise ValueError("parents must precede their children (parents[i] < i)")

    @classmethod
    def chain(cls, root: int, drafts: list[int]) -> "Tree":
        return cls(np.array([root, *drafts]), np.arange(-1, len(drafts)))

    @property
    def n(self) -> int:
        return len(self.tokens)

    @cached_property
    def depth(self) -> np.ndarray:
        """[n] int64: 0 for the root."""
        d = np.zeros(self.n, dtype=np.int64)
        for i in range(1, self.n):
            d[i] = d[self.parents[i]] + 1
        return d

    @cached_property
    def children(self) -> list[list[int]]:
        """Children of each node in order (the draw order, which recursive rejection follows)."""
        out: list[list[int]] = [[] for _ in range(self.n)]
        for i in range(1, self.n):
            out[self.parents[i]].append(i)
        return out

    @cached_property
    def leaves(self) -> list[int]:
        return [i for i in range(self.n) if not self.children[i]]

    @cached_property
    def ancestor_mask(self) -> np.ndarray:
        """[n, n] bool: mask[i, j] = j is i or an ancestor of i (what row i may attend to in the tree)."""
        m = np.eye(self.n, dtype=bool)
        for i in range(1, self.n):
            m[i] |= m[self.parents[i]]
        return m

    def positions(self, n_prefix: int) -> np.ndarray:
        """[n] int32: the root sits at ``n_prefix`` (it follows the cached prefix), node i at + depth."""
        return (n_prefix + self.depth).astype(np.int32)

    @cached_property
    def seq_ids(self) -> list[list[int]]:
        """Sequence ids per node: leaf j owns sequence j, and a node carries every leaf below it.

        The first id of a node is always the sequence of some leaf below it, which is the one
        llama.cpp's mask reads.
        """
        leaf_seq = {leaf: s for s, leaf in enumerate(self.leaves)}
        below = self.ancestor_mask  # below[leaf, node]: node is on leaf's path
        return [[leaf_seq[l] for l in self.leaves if below[l, i]] for i in range(self.n)]

    def seq_of(self, node: int) -> int:
        """A sequence whose path contains ``node`` (the first leaf below it)."""
        return self.seq_ids[node][0]

    def path_to(self, node: int) -> list[int]:
        """Nodes from the root to ``node`` inclusive."""
        out = [node]
        while out[-1] != 0:
            out.append(int(self.parents[out[-1]]))
        return out[::-1]
