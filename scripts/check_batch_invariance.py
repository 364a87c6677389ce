"""Find the largest verification for which llama.cpp's rows are batch-invariant on a GGUF, on this CPU.

The check is the runtime's own (``hetero_spec.target.invariance.measure``, which ``HeteroSpec`` runs once
per file and machine and caches): n = 2..N rows decoded in one call against one-row decodes of the same
tokens, bit for bit, over several windows of tokens; then prefix reuse against a fresh prefill at the
chosen n_batch.  Speculative greedy output equals plain decoding only within the bound, which is why the
runtime caps every verification there.  Beyond 32 rows (``--max-n``) it measures what the runtime never
verifies; the kernel plan is this process's (``HETERO_SPEC_KERNELS=plain|no-amx|default`` picks others).

    python scripts/check_batch_invariance.py MODEL.gguf [--max-n 96] [--n-batch 32] [--threads 1]
"""
from __future__ import annotations

from pathlib import Path

import click
import numpy as np

from hetero_spec.bench.prompts import bench_prompts
from hetero_spec.target.invariance import measure
from hetero_spec.target.llama_target import LlamaTarget, TargetOptions


def prefix_reuse_matches(path: Path, n_batch: int, threads: int) -> bool:
    """A prompt that shares 40 characters with the cached one prefills to the same cells and logits."""
    a, b = bench_prompts("alpaca", 2)
    with LlamaTarget(path, TargetOptions(n_ctx=2048, n_batch=n_batch, n_threads=threads)) as t:
        t.prefill(t.tokenize(a))
        h_cached, l_cached = t.prefill(t.tokenize(a[:40] + b))
        t.reset()
        h_fresh, l_fresh = t.prefill(t.tokenize(a[:40] + b))
        return bool(np.array_equal(l_cached, l_fresh) and np.array_equal(h_cached, h_fresh[-len(h_cached):]))


@click.command(help=__doc__.splitlines()[0])
@click.argument("model", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--max-n", default=32, show_default=True, type=click.IntRange(2, 512), help="widest verification checked")
@click.option("--n-batch", default=32, show_default=True, type=click.IntRange(1), help="micro-batch of the prefix check")
@click.option("--threads", "-t", default=0, type=click.IntRange(0), help="threads (0 = physical cores, as the runtime)")
def main(model: Path, max_n: int, n_batch: int, threads: int) -> None:
    # below 32 rows a batch this llama.cpp aborts (n_outputs_max assertion); a larger batch changes nothing here
    with LlamaTarget(model, TargetOptions(n_ctx=max_n + 64, n_batch=max(max_n, 32), n_threads=threads)) as t:
        click.echo(f"{model.name}: kernels {t.kernels}")
        got = measure(t, max_n)
    first = got.first_failing
    click.echo(f"{model.name}: verify(n) == n single decodes bitwise for every n <= {got.exact_rows}"
               f" (first failing n: {first if first is not None else f'none up to {got.checked_rows}'};"
               f" {got.seconds:.1f} s)")
    click.echo(f"{model.name}: prefix reuse == fresh prefill at n_batch {n_batch}: "
               f"{prefix_reuse_matches(model, n_batch, threads)}")


if __name__ == "__main__":
    main()
