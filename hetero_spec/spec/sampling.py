"""Logits processing shared by the target's rows, the draft's nodes and the bonus token.

Definitions and order follow llama.cpp's default sampler chain
(``top_k -> top_p -> min_p -> temperature -> dist``):

* top-k keeps the k largest logits (k <= 0: off);
* top-p keeps the smallest prefix, by descending probability at temperature 1, whose
  mass reaches p (at least one token; p >= 1: off);
* min-p keeps tokens whose probability is at least min_p times the largest (min_p <= 0: off);
* temperature divides the surviving logits; the result is renormalised.

The same function processes p (target) and q (draft).  Losslessness means the output
follows *this* processed p, exactly as llama.cpp's sampler would draw from it.
"""
from __future__ import annotations

import numpy as np

from ..config import SamplingConfig


def process_logits(logits: np.ndarray, cfg: SamplingConfig) -> np.ndarray:
    """logits [V] float32 -> probabilities [V] float64 (zeros outside the kept set).

    Greedy configs (temperature 0) give a one-hot on the argmax, so callers may treat
    greedy as the degenerate case of sampling.
    """
    x = np.asarray(logits, dtype=np.float64)
    V = x.shape[0]
    out = np.zeros(V, dtype=np.float64)
    if cfg.greedy:
        out[int(np.argmax(x))] = 1.0
        return out
    if 0 < cfg.top_k < V:
        ids = np.argpartition(-x, cfg.top_k - 1)[: cfg.top_k]
    else:
        ids = np.arange(V)
    vals = x[ids]
    if cfg.top_p < 1.0:
        order = np.argsort(-vals, kind="stable")
        ids, vals = ids[order], vals[order]
        pr = np.exp(vals - vals[0])
        cum = np.cumsum(pr / pr.sum())
        n_keep = int(np.searchsorted(cum, cfg.top_p)) + 1  # first index where cum >= p, inclusive
        ids, vals = ids[:n_keep], vals[:n_keep]
    if cfg.min_p > 0.0:
        keep = vals >= vals.max() + np.log(cfg.min_p)
        ids, vals = ids[keep], vals[keep]
    z = (vals - vals.max()) / cfg.temperature
    pr = np.exp(z)
    out[ids] = pr / pr.sum()
    return out


def sample(probs: np.ndarray, rng: np.random.Generator) -> int:
    """One draw from a probability vector [V] float64 (inverse CDF: one uniform per draw)."""
    cum = np.cumsum(probs)
    u = rng.random() * cum[-1]
    return int(min(np.searchsorted(cum, u, side="right"), len(probs) - 1))


def draw_without_replacement(probs: np.ndarray, m: int, rng: np.random.Generator) -> np.ndarray:
    """m distinct ids drawn one after another without replacement, in draw order (Gumbel-top-m).

    argsort of log q + Gumbel noise is exactly sequential sampling without replacement,
    which recursive rejection over siblings requires of a node's children.
    """
    support = np.flatnonzero(probs > 0)
    m = min(m, len(support))
    keys = np.log(probs[support]) + rng.gumbel(size=len(support))
    top = np.argpartition(-keys, m - 1)[:m] if m < len(support) else np.arange(len(support))
    top = top[np.argsort(-keys[top], kind="stable")]
    return support[top]
