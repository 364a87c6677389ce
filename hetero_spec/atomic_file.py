"""Files written whole or not at all.

Caches, manifests, shards and drafts are read while other processes may be writing them: two servers
starting at once on one machine both measure step prices and both save them, a resumed export reads
the manifest a killed one left. Each is written to a hidden temporary file beside its destination and
renamed over it, so a reader sees the old file or the new one, never half of one. The temporary name
holds the process and thread ids, so two writers of the same file never share a temporary; whichever
renames last wins, and both files were whole.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["replacing", "temporary_for", "write_bytes", "write_text"]


def temporary_for(path: str | Path) -> Path:
    """The hidden temporary beside ``path`` that this process and thread write it through.

    It ends in ``.tmpPID-TID``, never in the destination's suffix, so a reader that globs for ``*.json``
    or ``*.safetensors`` cannot pick up a file that is still being written."""
    path = Path(path)
    return path.with_name(f".{path.name}.tmp{os.getpid()}-{threading.get_native_id()}")


@contextmanager
def replacing(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path to write ``path``'s new content to; on a clean exit it is renamed over
    ``path`` (atomic on one file system), and on any error, Ctrl-C included, it is removed and ``path``
    is left as it was. The parent folder is created if missing.

    For writers that take a path (safetensors, ``torch.save``, llama.cpp's quantizer, a copy)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_for(path)
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_text(path: str | Path, text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` whole or not at all; returns ``path``."""
    with replacing(path) as tmp:
        tmp.write_text(text, encoding="utf-8")
    return Path(path)


def write_bytes(path: str | Path, data: bytes) -> Path:
    """Write ``data`` to ``path`` whole or not at all; returns ``path``."""
    with replacing(path) as tmp:
        tmp.write_bytes(data)
    return Path(path)
