"""Seconds per training step (forward, backward, AdamW) of several draft configurations, on real batches.

Same batches (the first few of a feature folder, bucketed as ``train`` buckets them), same threads, one
configuration after another; medians over the batches after the first (warm-up).  What to read is the
ratio between configurations: on a shared machine the absolute seconds move with the load.

    python scripts/bench_train_step.py "$(python scripts/default_model.py)" corpus-0/features -t 1
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from hetero_spec.draft.model import DraftModel, init_weights
from hetero_spec.train.data import choose_vocab, collate, load_split, make_batches
from hetero_spec.train.loop import TrainConfig, _batch_loss, _draft_config, _feature_rms, _Unrolled, tap_scale_for
from hetero_spec.train.losses import LossWeights
from hetero_spec.train_cli import _target_parts

TAPS = (2, 15, 27)
CONFIGS = {
    "eagle": TrainConfig(variant="eagle", unroll_steps=1, loss=LossWeights(recipe="eagle")),
    "darter-taps-u1": TrainConfig(variant="darter", n_blocks=1, unroll_steps=1, taps=TAPS),
    "darter-taps-u3": TrainConfig(variant="darter", n_blocks=1, unroll_steps=3, taps=TAPS),
    "darter-taps-u3-s0.33": TrainConfig(variant="darter", n_blocks=1, unroll_steps=3, taps=TAPS, chain_sample=0.33),
    "eagle3-u3-s0.33": TrainConfig(variant="eagle3", n_blocks=1, unroll_steps=3, taps=TAPS, chain_sample=0.33),
    "darter-notaps-u3": TrainConfig(variant="darter", n_blocks=1, unroll_steps=3),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("features")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--batches", type=int, default=6)
    ap.add_argument("-t", "--threads", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    fp, emb, head = _target_parts(a.model)
    split = load_split([a.features], max_len=2048, held_out=0.03, seed=0, taps=TAPS)
    d2t, _ = choose_vocab(split.train, 8192, fp.n_vocab)
    batches = make_batches(split.train, 4096, 0, 0)[: a.batches]
    rng = np.random.default_rng(0)
    holes = [rng.random(len(idx)) < 0.3 for idx in batches]
    base = None
    for name in a.configs.split(","):
        cfg = CONFIGS[name]
        m = init_weights(DraftModel(_draft_config(cfg, fp, d2t)), 0)
        m.d2t = d2t
        m.attach_target_weights(emb, head)
        opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-4)
        rms, run = _feature_rms(split.train, cfg.taps), _Unrolled(m, cfg.unroll_steps)
        if cfg.taps:
            m.tap_scale.copy_(tap_scale_for(rms))
        times = []
        for idx, h in zip(batches, holes):
            b = collate([split.train[i] for i in idx], cfg.taps, h)
            t0 = time.perf_counter()
            opt.zero_grad()
            loss, *_ = _batch_loss(run, m, b, cfg, rms)
            loss.backward()
            opt.step()
            times.append(time.perf_counter() - t0)
        med = statistics.median(times[1:])
        base = base or med
        print(f"{name:22s} {med:6.2f} s/step  {med / base:5.2f}x the first", flush=True)


if __name__ == "__main__":
    main()
