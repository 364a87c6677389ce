"""Microbenchmark of one draft step on this machine: dtype x head size x blocks.

    python scripts/bench_draft_step.py MODEL.gguf [--steps 200]

Prints the median time of a one-token draft step (fusion, blocks, head, argmax) for each
setting, measured with the real runner and the target's real embedding/head; a reduced head is
also timed with ``--context-rows`` context rows added (the target's rows of tokens in the text).
"""
from __future__ import annotations

import statistics
import time

import click
import numpy as np
import torch


@click.command()
@click.argument("model", type=click.Path(exists=True, dir_okay=False))
@click.option("--steps", default=200, show_default=True)
@click.option("--context", default=300, show_default=True, help="cached positions before timing")
@click.option("--context-rows", default=300, show_default=True,
              help="also time a reduced head with this many context rows added (0: skip)")
def main(model: str, steps: int, context: int, context_rows: int) -> None:
    from hetero_spec.draft.model import DraftModel, init_weights
    from hetero_spec.draft.runner import DraftRunner
    from hetero_spec.draft_factory import draft_config_for
    from hetero_spec.target.gguf_weights import load_target_weights
    from hetero_spec.target.llama_target import LlamaTarget, TargetOptions

    with LlamaTarget(model, TargetOptions(n_ctx=64, embeddings=False)) as t:
        base = {blocks: draft_config_for(t, "darter", n_blocks=blocks) for blocks in (1, 2)}
    w = load_target_weights(model)
    emb, head = torch.from_numpy(np.array(w.embedding)), torch.from_numpy(np.array(w.head))
    rng = np.random.default_rng(0)
    for blocks, cfg0 in base.items():
        heads = [(8192, 0)] + ([(8192, context_rows)] if context_rows else []) + [(0, 0)]  # (rows, context rows)
        for reduced, added in heads:
            for dtype in ("float32", "bfloat16", "int8"):
                from dataclasses import replace
                cfg = replace(cfg0, reduced_vocab=reduced)
                m = init_weights(DraftModel(cfg))
                m.attach_target_weights(emb, head)
                r = DraftRunner(m, device="cpu", dtype=dtype)
                feats = rng.standard_normal((context, cfg.n_embd)).astype(np.float32)
                r.propose(feats, rng.integers(0, 1000, context), 1)
                r.add_context(np.setdiff1d(np.arange(cfg.n_vocab), r._d2t)[:added])  # context rows (reduced heads)
                times = []
                for _ in range(steps):
                    n = r.n
                    t0 = time.perf_counter()
                    r.propose(feats[:1], [5], 1)
                    times.append(time.perf_counter() - t0)
                    r.rollback(n)
                med = statistics.median(times) * 1e3
                rows = "full" if not reduced else f"{reduced}+{added}"
                click.echo(f"blocks={blocks} head={rows:>9} {dtype:9s} {med:.3f} ms/step")


if __name__ == "__main__":
    main()
