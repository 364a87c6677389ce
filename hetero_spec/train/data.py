"""Training batches from an exported feature dataset (hetero_spec/features.py).

Sequences are bucketed by length into batches of about ``batch_tokens`` rows, so padding
stays small without a custom sampler; the held-out split is a deterministic function of
the seed, so resuming or evaluating later sees the same split.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..errors import HeteroSpecError
from ..features import FeatureSequence, iter_sequences, read_manifest
from .loops import trim_loops


@dataclass
class Split:
    train: list[FeatureSequence]
    held_out: list[FeatureSequence]


def tap_keys(taps: tuple[int, ...]) -> list[str]:
    return [f"tap_{i}" for i in taps]


def load_split(folders: str | Path | list, *, max_len: int, held_out: float, seed: int,
               taps: tuple[int, ...] = (), loop_keep: int = 0) -> Split:
    """Map every sequence of every folder (memory maps: a corpus with taps is tens of GB), cut to
    ``max_len`` rows, drop those with fewer than 3 rows or no loss tokens.  A sequence is held out
    when the seeded hash of its token ids falls below ``held_out``: the split depends on nothing but
    the sequence itself, so a corpus that grows between resumed runs, or a second folder beside it,
    never moves a held-out sequence into training.  ``taps``: the block inputs the draft reads, which
    every folder must hold.  ``loop_keep`` > 0: repetition loops keep this many scored tokens
    (``loops.trim_loops``); the split is drawn before trimming, so it does not depend on the setting."""
    folders = [folders] if isinstance(folders, (str, Path)) else list(folders)
    keys = tap_keys(taps)
    for folder in folders:
        read_manifest(folder)  # validates every folder before the (long) read
        first = next(iter_sequences(folder, mmap=True, keys=set(keys)), None)
        missing = [k for k in keys if first is not None and k not in first.extras]
        if missing:
            t = ",".join(map(str, taps))
            raise HeteroSpecError(f"{folder} holds no {', '.join(missing)} (make it with generate-corpus --taps {t}, "
                                  f"or add them to a generate-corpus folder with export-features --corpus FOLDER "
                                  f"--taps {t}; or train a draft without taps)")
    split = Split([], [])
    for folder in folders:
        seqs = []
        for s in iter_sequences(folder, mmap=True, keys=set(keys)):
            s = FeatureSequence(s.input_ids[:max_len], s.hidden[:max_len], s.loss_mask[:max_len],
                                {k: s.extras[k][:max_len] for k in keys})
            if len(s) >= 3 and s.loss_mask[2:].any():
                seqs.append(s)
        u = np.array([_unit_hash(s.input_ids, seed) for s in seqs])
        out = u < held_out
        if len(seqs) > 1 and held_out > 0 and not out.any():  # a tiny folder still gets one
            out[int(u.argmin())] = True
        seqs = [trim_loops(s, loop_keep) for s in seqs]
        split.train.extend(s for s, o in zip(seqs, out) if not o)
        split.held_out.extend(s for s, o in zip(seqs, out) if o)
    return split


def _unit_hash(ids: np.ndarray, seed: int) -> float:
    """A number in [0, 1) fixed by the token ids and the seed."""
    h = hashlib.blake2b(np.ascontiguousarray(ids, dtype=np.int32).tobytes(), digest_size=8,
                        salt=seed.to_bytes(8, "little", signed=True))
    return int.from_bytes(h.digest(), "little") / 2**64


def choose_vocab(seqs: list[FeatureSequence], size: int, n_vocab: int) -> tuple[torch.Tensor, float]:
    """The ``size`` most frequent assistant tokens (ties by id) and the share of assistant tokens they cover."""
    counts = np.zeros(n_vocab, dtype=np.int64)
    for s in seqs:
        np.add.at(counts, s.input_ids[s.loss_mask.astype(bool)], 1)
    size = min(size, n_vocab)
    ids = np.lexsort((np.arange(n_vocab), -counts))[:size]
    coverage = counts[ids].sum() / max(1, counts.sum())
    return torch.from_numpy(np.sort(ids)).long(), float(coverage)


@dataclass
class Batch:
    features: torch.Tensor  # [B, T, n_embd] float32, f_t: the targets (p = head(f_{t+1}), feature loss)
    ids: torch.Tensor  # [B, T] int64, x_t
    loss_mask: torch.Tensor  # [B, T] bool, x_t is a token to learn
    valid: torch.Tensor  # [B, T] bool, False on padding
    inputs: torch.Tensor  # [B, T, n_in] float32, what the draft reads: f_t, or the concatenated taps
    holes: torch.Tensor  # [B] int64: positions before this one are holes (no key, no loss); 0 = none

    def to(self, device: torch.device) -> "Batch":
        return Batch(*(t.to(device, non_blocking=True) for t in
                       (self.features, self.ids, self.loss_mask, self.valid, self.inputs, self.holes)))

    @property
    def next_tokens(self) -> torch.Tensor:
        """x_{t+1} at row t (the draft's token input), the last row padded."""
        return torch.cat((self.ids[:, 1:], self.ids[:, -1:]), dim=1)


def make_batches(seqs: list[FeatureSequence], batch_tokens: int, seed: int, epoch: int) -> list[list[int]]:
    """Indices of sequences per batch: sorted by length, cut at the token budget, then shuffled."""
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    batches: list[list[int]] = []
    cur: list[int] = []
    for i in order:  # ascending, so the newcomer is the longest of its batch
        if cur and len(seqs[i]) * (len(cur) + 1) > batch_tokens:
            batches.append(cur)
            cur = []
        cur.append(i)
    if cur:
        batches.append(cur)
    rng = np.random.default_rng([seed, epoch])
    return [batches[i] for i in rng.permutation(len(batches))]


def collate(seqs: list[FeatureSequence], taps: tuple[int, ...] = (), holes: np.ndarray | None = None) -> Batch:
    """Pad a batch; ``holes`` [B] bool marks sequences whose prompt the draft must not see (as after
    the runtime's lazy prefill: its first row is the first answer token's)."""
    T = max(len(s) for s in seqs)
    d = seqs[0].hidden.shape[1]
    keys = tap_keys(taps)
    feats = np.zeros((len(seqs), T, d), dtype=np.float32)
    inputs = np.zeros((len(seqs), T, d * len(keys)), dtype=np.float32) if keys else None
    ids = np.zeros((len(seqs), T), dtype=np.int64)
    mask = np.zeros((len(seqs), T), dtype=bool)
    valid = np.zeros((len(seqs), T), dtype=bool)
    hole_before = np.zeros(len(seqs), dtype=np.int64)
    for b, s in enumerate(seqs):
        n = len(s)
        feats[b, :n] = s.hidden
        for i, k in enumerate(keys):
            inputs[b, :n, i * d : (i + 1) * d] = s.extras[k]
        ids[b, :n] = s.input_ids
        mask[b, :n] = s.loss_mask.astype(bool)
        valid[b, :n] = True
        if holes is not None and holes[b] and mask[b].any():
            hole_before[b] = int(mask[b].argmax())  # the first answer token
    f = torch.from_numpy(feats)
    return Batch(f, torch.from_numpy(ids), torch.from_numpy(mask), torch.from_numpy(valid),
                 torch.from_numpy(inputs) if keys else f, torch.from_numpy(hole_before))
