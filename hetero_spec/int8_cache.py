"""The int8 check of a CPU draft, cached per machine, draft file and target file.

WHY: the check prefills a calibration text on the target and runs the draft three times
over it (float, 8- and 7-bit activations), about a second; its answer only changes with
the CPU, the torch build or either file, so it is measured once and read afterwards.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict
from pathlib import Path

import torch

from . import atomic_file
from .calibration import machine_id
from .draft.int8 import Int8Calibration, Int8Check
from .target.gguf_weights import cache_dir


# Bumped whenever what the check measures changes (v2: the int8 head rescores its top rows in float;
# v3: the fusion and tap_fc get weight-only int8).
CHECK_VERSION = "v3"


def _ident(path: str | Path) -> str:
    p = Path(path).resolve()
    st = p.stat()
    return f"{p}:{st.st_size}:{st.st_mtime_ns}"


def cache_path(target_path: str | Path, draft_path: str | Path) -> Path:
    key = "|".join([CHECK_VERSION, machine_id(0), torch.__version__, os.environ.get("FBGEMM_ENABLE_INSTRUCTIONS", ""),
                    _ident(target_path), _ident(draft_path)])
    return cache_dir() / "int8" / f"{hashlib.sha256(key.encode()).hexdigest()[:20]}.safetensors"


def load(target_path: str | Path, draft_path: str | Path) -> Int8Calibration | None:
    from safetensors import safe_open

    path = cache_path(target_path, draft_path)
    if not path.is_file():
        return None
    try:
        with safe_open(str(path), framework="pt") as fh:
            smooth = {k: fh.get_tensor(k) for k in fh.keys()}
            check = Int8Check(**json.loads(fh.metadata()["check"]))
    except Exception:  # noqa: BLE001  (a damaged cache entry is measured again)
        return None
    return Int8Calibration(smooth, check)


def save(target_path: str | Path, draft_path: str | Path, cal: Int8Calibration) -> None:
    from safetensors.torch import save_file

    if cal.check is None:
        return
    path = cache_path(target_path, draft_path)
    with atomic_file.replacing(path) as tmp:
        save_file({k: v.contiguous() for k, v in cal.smooth.items()}, str(tmp),
                  metadata={"check": json.dumps(asdict(cal.check))})
