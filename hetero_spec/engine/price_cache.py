"""Step prices kept on disk per machine, model and slot layout: a server or batch job that starts again
on the same machine starts in a second or two instead of re-measuring.

``Engine.calibrate`` times a few hundred decodes (7.8 s of a 13.3 s ``serve`` start on the 2-core Xeon VM
when it ran slow; 2.7 s with the prices read), and the prices depend only on what the key holds: the machine and its kernels, the
thread count, the model file, and the context's layout (sequences, micro-batch and decode sizes, KV cell
type, per-row features), plus how they were probed.  As ``calibration.py`` does for ``auto``'s curve; the
engine still corrects the prices from the steps it runs.  Delete the file to measure again."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from .. import atomic_file
from ..calibration import cache_dir, file_ident, machine_id
from .cost import StepCost

PRICES_VERSION = 2  # bumped when what a price means changes, so that every cached file is measured again


def prices_path(target, rows: tuple[int, ...], repeats: int, context: int) -> Path:
    """The cache file for ``target`` (a ``SequenceTarget``) probed at ``rows``, ``repeats`` and ``context``
    (the cells each sequence holds while probed, as ``Engine.calibrate`` fits them to the context)."""
    o = target.options
    layout = (f"{o.n_seq} seqs, {o.max_rows}-row micro-batches, {o.batch_rows}-row decodes, kv {o.kv_type}, "
              f"features {o.features} taps {list(o.taps)}, unified {o.kv_unified}")
    probe = f"rows {list(rows)} x{repeats} at {context} cells"
    key = "|".join([machine_id(target.n_threads), file_ident(target.path), layout, probe,
                    f"prices-v{PRICES_VERSION}"])
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return cache_dir() / f"{target.path.stem}-t{target.n_threads}-{o.n_seq}seq-steps-{digest}.json"


def load(path: Path) -> StepCost | None:
    """The prices in ``path``; None when it is missing, unreadable or from another version."""
    try:
        d = json.loads(path.read_text())
        if d.get("version") != PRICES_VERSION:
            return None
        cost = StepCost({int(n): float(ms) for n, ms in d["ms"].items()})
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return cost if cost.known and all(ms > 0 for ms in cost.ms.values()) else None


def save(cost: StepCost, path: Path, about: str) -> Path:
    """Written whole or not at all: a concurrent reader never sees half a file."""
    return atomic_file.write_text(path, json.dumps({"version": PRICES_VERSION, "about": about,
                                                    "ms": {str(n): round(ms, 4) for n, ms in sorted(cost.ms.items())}},
                                                   indent=2))
