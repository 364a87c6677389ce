"""Exactness checks shared by the target and quantize tests: greedy losslessness rests on them."""
from __future__ import annotations

import numpy as np

from hetero_spec.bench.prompts import bench_prompts


def assert_verify_equals_single_decodes(t, prompt: list[int], extra: list[int]) -> None:
    """Verifying ``extra`` in one decode gives bit-identical logits to decoding it token by token."""
    t.reset()
    t.prefill(prompt)
    single = np.stack([t.verify([x])[0][-1].copy() for x in extra])  # views: copy each
    t.rollback(len(prompt))
    logits, _ = t.verify(extra)
    np.testing.assert_array_equal(logits, single)


def assert_prefix_reuse_equals_fresh_prefill(t) -> None:
    a, b = bench_prompts("alpaca", 2)
    t.reset()
    t.prefill(t.tokenize(a))
    hidden_cached, logits_cached = t.prefill(t.tokenize(a[:40] + b))
    t.reset()
    hidden_fresh, logits_fresh = t.prefill(t.tokenize(a[:40] + b))
    np.testing.assert_array_equal(logits_cached, logits_fresh)
    np.testing.assert_array_equal(hidden_cached, hidden_fresh[-len(hidden_cached):])
