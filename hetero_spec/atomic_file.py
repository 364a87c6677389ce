"""Files written whole or not at all.

Caches, manifests, shards and drafts are read while other processes may be writing them: two servers
starting at once on one machine both measure step prices and both save them, a resumed export reads
the manifest a killed one left. Each is written to a hidden temporary file beside its destination and
renamed over it, so a reader sees the old file or the new one, never half of one. The temporary name
holds the process and thread ids, so two writers of the same file never share a temporary; whichever
renames last wins, and both files were whole.

A writer killed outright (SIGKILL, the OOM killer, a session that ends) leaves its temporary behind, and
no later run reuses the name; the next write of the same file removes such leftovers (``_remove_stale``),
so a training run killed every few hours does not pile up checkpoints.
"""

from __future__ import annotations

import glob
import os
import re
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["replacing", "save_figure", "temporary_for", "write_bytes", "write_text"]


def temporary_for(path: str | Path) -> Path:
    """The hidden temporary beside ``path`` that this process and thread write it through.

    It ends in ``.tmpPID-TID``, never in the destination's suffix, so a reader that globs for ``*.json``
    or ``*.safetensors`` cannot pick up a file that is still being written."""
    path = Path(path)
    return path.with_name(f".{path.name}.tmp{os.getpid()}-{threading.get_native_id()}")


STALE_S = 600.0  # a leftover untouched this long, of a process not running here, is removed
_PID = re.compile(r"\.tmp(\d+)-\d+$")


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _remove_stale(path: Path) -> None:
    """Remove ``path``'s temporaries whose writer is gone: its process is not running on this machine and the
    file has not changed for ``STALE_S`` (the age guards a writer on another machine sharing the folder)."""
    now = time.time()
    for tmp in path.parent.glob(glob.escape(f".{path.name}.tmp") + "*"):
        m = _PID.search(tmp.name)
        try:
            if m and int(m.group(1)) != os.getpid() and not _running(int(m.group(1))) \
                    and now - tmp.stat().st_mtime > STALE_S:
                tmp.unlink()
        except OSError:  # gone already, or not ours to remove
            pass


@contextmanager
def replacing(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path to write ``path``'s new content to; on a clean exit it is renamed over
    ``path`` (atomic on one file system), and on any error, Ctrl-C included, it is removed and ``path``
    is left as it was. The parent folder is created if missing.

    For writers that take a path (safetensors, ``torch.save``, llama.cpp's quantizer, a copy).

    A destination that exists but is not a regular file (``/dev/stdout``, a pipe, ``>(jq .)``) is yielded
    itself, to be written in place: a rename would replace the device. A symbolic link's target is
    replaced, and the link kept."""
    path = Path(path)
    if path.exists() and not path.is_file():
        yield path
        return
    path = Path(os.path.realpath(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale(path)
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


def save_figure(fig, path: str | Path, **savefig_kwargs) -> Path:
    """A matplotlib figure written whole, its folder made if missing (a plot is the last thing a long command
    writes: a missing folder must not fail it after the work); the format from ``path``'s suffix."""
    path = Path(path)
    if not path.suffix:  # as matplotlib names it
        path = path.with_suffix(".png")
    with replacing(path) as tmp:
        fig.savefig(tmp, format=path.suffix.lstrip(".").lower(), **savefig_kwargs)
    return path
