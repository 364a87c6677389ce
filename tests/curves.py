"""Cost curves that make auto's choice independent of the machine, for tests of the copy and draft mechanisms.

Whether a copied or drafted round pays depends on this machine's t(n): where two verified rows cost two
decodes (a 2-core VM seen in CI), a 40-token answer may never reach a round worth drafting, and a test of
the mechanism would pass or fail with the calibration's noise.  These tests price rows nearly free instead.
"""
from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from hetero_spec.calibration import CostCurve, cache_path, save

CHEAP_ROWS = CostCurve({1: 10.0, 32: 10.5}, 0.1)


@contextmanager
def cheap_rows_in(hs) -> Iterator[None]:
    """For a ``HeteroSpec`` in this process: auto's policies are made afresh on CHEAP_ROWS while the block runs;
    the machine's curve and policies are put back afterwards."""
    curve, policies = hs._curve, hs._auto
    hs._curve, hs._auto = CHEAP_ROWS, {}
    try:
        yield
    finally:
        hs._curve, hs._auto = curve, policies


@contextmanager
def cheap_rows_cached(model: str | Path, threads: int, draft: str | Path | None = None) -> Iterator[None]:
    """For a subprocess (``run``, ``serve``) on ``model`` with ``threads``: the curve it reads from the cache is
    CHEAP_ROWS while the block runs; the machine's own calibration (or none) is put back afterwards."""
    path = cache_path(model, draft, threads)
    old = path.read_bytes() if path.is_file() else None
    save(CHEAP_ROWS, path)
    try:
        yield
    finally:
        if old is None:
            path.unlink(missing_ok=True)
        else:
            path.write_bytes(old)
