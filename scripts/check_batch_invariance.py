"""Find the largest micro-batch for which llama.cpp's rows are batch-invariant on a GGUF.

For n = 1..N: decode n tokens in one call and compare the logits bitwise with n
single-token decodes of the same tokens; then check that prefix reuse equals a fresh
prefill at the chosen n_batch.  Speculative greedy output equals plain decoding only
where this holds, so run it on every file format you use as a target.

    python scripts/check_batch_invariance.py MODEL.gguf [--max-n 96] [--n-batch 32]
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from hetero_spec.bench.prompts import bench_prompts as first_turns
from hetero_spec.target.llama_target import LlamaTarget, TargetOptions

FILLER = (" and then the answer is forty two because the farmer sold sixteen eggs at the market on"
          " Tuesday, kept three for breakfast, baked muffins with four more and gave the rest away to"
          " neighbours who asked politely for them every single morning of the long and busy week ahead")


def verify_matches(path: Path, max_n: int) -> dict[int, bool]:
    # below 32 rows a batch this llama.cpp aborts (n_outputs_max assertion); a larger batch changes nothing here
    with LlamaTarget(path, TargetOptions(n_ctx=1024, n_batch=max(max_n, 32))) as t:
        # the answer holds for these kernels only (HETERO_SPEC_KERNELS=plain|no-amx|default picks others)
        print(f"{path.name}: kernels {t.kernels}")
        prompt = t.tokenize(first_turns("gsm8k", 1)[0])
        extra = t.tokenize(FILLER * 3, add_special=False)[:max_n]
        t.prefill(prompt)
        single = np.stack([t.verify([x])[0][-1].copy() for x in extra])  # [max_n, V]
        out = {}
        for n in range(1, len(extra) + 1):
            t.rollback(len(prompt))
            logits, _ = t.verify(extra[:n])
            out[n] = bool(np.array_equal(logits, single[:n]))
        return out


def prefix_reuse_matches(path: Path, n_batch: int) -> bool:
    a, b = first_turns("alpaca", 2)
    with LlamaTarget(path, TargetOptions(n_ctx=2048, n_batch=n_batch)) as t:
        t.prefill(t.tokenize(a))
        h_cached, l_cached = t.prefill(t.tokenize(a[:40] + b))
        t.reset()
        h_fresh, l_fresh = t.prefill(t.tokenize(a[:40] + b))
        return bool(np.array_equal(l_cached, l_fresh) and np.array_equal(h_cached, h_fresh[-len(h_cached):]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--max-n", type=int, default=96)
    ap.add_argument("--n-batch", type=int, default=32)
    args = ap.parse_args()
    res = verify_matches(args.model, args.max_n)
    bad = [n for n, ok in res.items() if not ok]
    largest = (min(bad) - 1) if bad else max(res)
    print(f"{args.model.name}: verify(n) == n single decodes bitwise for every n <= {largest}"
          f" (first failing n: {min(bad) if bad else 'none up to ' + str(args.max_n)};"
          f" failing n: {bad[:12]}{'...' if len(bad) > 12 else ''})")
    print(f"{args.model.name}: prefix reuse == fresh prefill at n_batch {args.n_batch}:"
          f" {prefix_reuse_matches(args.model, args.n_batch)}")


if __name__ == "__main__":
    main()
