"""Benchmarks: baselines and hetero-spec side by side."""
