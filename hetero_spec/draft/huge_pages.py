"""Weights that the native draft step streams, kept in 2 MB pages where the kernel grants them.

WHY: right after a target decode the draft's 7 MB of int8/int4 weights come back from memory, and in 4 KB
pages they span about 1,800 pages whose translations the target's own 100 MB of weights have pushed out of
the TLB: each page then costs a page walk on top of its cache misses.  In 2 MB pages the same bytes are 4
translations.  Linux gives anonymous memory 2 MB pages (transparent huge pages) when the range is aligned
and, in the common ``madvise`` mode, advised with ``MADV_HUGEPAGE``; with THP off the arena is plain memory
and nothing else changes.
"""
from __future__ import annotations

import ctypes
import mmap
import re
from pathlib import Path

import torch

HUGE_PAGE = 2 << 20
ALIGN = 64  # a cache line: every tensor starts on one (the kernels' prefetch and vector loads assume nothing more)


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def thp_mode() -> str:
    """The kernel's transparent-huge-page mode (``always``, ``madvise`` or ``never``), or ``unavailable``."""
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return "unavailable"
    m = re.search(r"\[(\w+)\]", text)
    return m.group(1) if m else "unavailable"


class HugePageArena:
    """A bump allocator over one anonymous mapping, 2 MB aligned and advised ``MADV_HUGEPAGE``.

    ``place(t)`` copies a tensor in and returns the arena's copy (a tensor over the mapping, kept alive by the
    arena); once full, ``place`` returns its argument unchanged, so a wrong estimate costs speed, never
    correctness.  Only touched pages take memory, so ``capacity`` may be generous."""

    def __init__(self, capacity: int) -> None:
        self.capacity = _round_up(max(capacity, 1), HUGE_PAGE)
        self.advised = False
        self.used = 0
        try:
            # private: shared anonymous memory is shmem, whose huge pages follow another, usually "never",
            # setting; the slack lets the start move to a 2 MB boundary
            self._map = mmap.mmap(-1, self.capacity + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        except (AttributeError, OSError, ValueError):  # no such mapping here (not a POSIX system): hold nothing
            self._map, self.capacity, self._start, self.address = None, 0, 0, 0
            return
        base = ctypes.addressof(ctypes.c_char.from_buffer(self._map))
        self._start = (-base) % HUGE_PAGE
        self.address = base + self._start
        if thp_mode() in ("always", "madvise") and hasattr(mmap, "MADV_HUGEPAGE"):
            try:
                self._map.madvise(mmap.MADV_HUGEPAGE, self._start, self.capacity)
                self.advised = True
            except OSError:  # a kernel without THP support: plain pages
                pass

    def place(self, t: torch.Tensor) -> torch.Tensor:
        nbytes = t.numel() * t.element_size()
        offset = _round_up(self.used, ALIGN)
        if offset + nbytes > self.capacity or nbytes == 0:
            return t
        out = torch.frombuffer(self._map, dtype=t.dtype, count=t.numel(), offset=self._start + offset).view(t.shape)
        out.copy_(t.detach())
        self.used = offset + nbytes
        return out

    def huge_bytes(self) -> int:
        """Bytes of the arena that the kernel backs with 2 MB pages now (``AnonHugePages`` of its mapping in
        /proc/self/smaps; 0 where that file is missing)."""
        if self._map is None:
            return 0
        try:
            smaps = Path("/proc/self/smaps").read_text()
        except OSError:
            return 0
        lo, hi = self.address - self._start, self.address - self._start + self.capacity + HUGE_PAGE
        total, inside = 0, False
        for line in smaps.splitlines():
            head = line.split(" ", 1)[0]
            if "-" in head and ":" not in head:  # a mapping's first line: "start-end perms ..."
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start < hi and end > lo
            elif inside and line.startswith("AnonHugePages:"):
                total += int(line.split()[1]) * 1024
        return total
