"""What a step costs and what a draft row is worth, measured on this engine: the price of speculation in a batch.

A draft row is a bet that rides in the same decode as other users' rows.  Alone, a few extra rows
cost little (a decode reads the weights once); in a full batch every row adds compute, so the
same bet can lose.  vLLM turns speculation down as the batch fills for this reason.  Here the
engine measures instead of assuming:

- ``StepCost``: milliseconds of one micro-batch by its rows, probed at several fills when the engine
  starts (``Engine.calibrate``), all scaled by how the steps it runs compare with them;
- ``Acceptance``: how often a verified draft row was right, for drafts from a long lookup match
  and for guesses that only fill the batch, counted over the rows the target actually reached.

A step's price is the sum of its micro-batches' prices, and ``micro_batches`` says which
micro-batches llama.cpp will make of a layout (its ``split_equal``: the same number of rows from
each of a run of consecutive sequences).  So one slot drafting alone costs a micro-batch of its own
drafts, while every slot drafting as deep costs one wider micro-batch; the engine compares such
choices (``Engine._choose``) by expected tokens per millisecond of the whole step, and drafts
nothing when nothing pays.
"""
from __future__ import annotations

import bisect
import functools
import statistics
from dataclasses import dataclass, field

PROBE_ROWS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)  # one micro-batch each: a step's price is the sum of its micro-batches'
SMOOTHING = 0.2  # weight of a new step's time in the running correction (or, uncalibrated, its width's price)


@dataclass
class StepCost:
    """Decode milliseconds by rows: measured points, linear in between and beyond, times one running correction
    (``scale``) that the steps the engine runs keep current.

    WHY one correction for every width: the points come from one calibration that timed every width alike, so
    their ratios are what a choice between layouts needs; the steps then say how decodes run now (the host's
    drift, the slots' context lengths) for all widths at once.  Corrected width by width from its own steps,
    a width the engine keeps choosing drifts and the ones it no longer runs do not.  On the 2-core EPYC VM, four
    slots drafting a row each ran 8-row steps at 24 ms against 26.4 calibrated, while 4 plain rows kept their
    calibrated 18.3 ms (13-14 ms when they ran): the draft model looked as if it paid, and a server with it
    drafted a row per slot in 40-50% of its steps, where such rows cost more than they gave.  Without a
    calibration the first widths the steps show become the points."""

    ms: dict[int, float] = field(default_factory=dict)
    scale: float = 1.0

    def observe(self, rows: int, ms: float) -> None:
        if not self.known:
            old = self.ms.get(rows)
            self.ms[rows] = ms if old is None else (1 - SMOOTHING) * old + SMOOTHING * ms
            return
        self.scale = (1 - SMOOTHING) * self.scale + SMOOTHING * ms / self._points(rows)

    def set_median(self, rows: int, samples: list[float]) -> None:
        self.ms[rows] = statistics.median(samples)

    def step_ms(self, counts: tuple[tuple[int, int], ...], n_ubatch: int) -> float:
        """The price of a decode laid out as ``counts``: the sum of its micro-batches' (``micro_batches``)."""
        return sum(self.at(n) for n in _micro_batches(counts, n_ubatch))

    @property
    def known(self) -> bool:
        return len(self.ms) >= 2

    def at(self, rows: int) -> float:
        return self.scale * self._points(rows)

    def _points(self, rows: int) -> float:
        """The measured points' price of ``rows``, before the correction."""
        ms = self.ms.get(rows)
        if ms is not None:
            return ms
        xs = sorted(self.ms)
        if not xs:
            raise ValueError("no step has been measured")
        if len(xs) == 1:
            return self.ms[xs[0]] * rows / xs[0]
        i = min(max(bisect.bisect_left(xs, rows), 1), len(xs) - 1)
        x0, x1 = xs[i - 1], xs[i]
        y0, y1 = self.ms[x0], self.ms[x1]
        return max(1e-3, y0 + (y1 - y0) * (rows - x0) / (x1 - x0))


@dataclass
class Acceptance:
    """P(the target accepts a draft token | it accepted the ones before it), for one kind of draft,
    with a prior worth ``weight`` rows so that a few early rows do not swing it."""

    prior: float
    weight: float = 10.0
    reached: int = 0
    accepted: int = 0

    @property
    def rate(self) -> float:
        return (self.accepted + self.prior * self.weight) / (self.reached + self.weight)

    def count(self, reached: int, accepted: int) -> None:
        self.reached += reached
        self.accepted += accepted


def expected_accepted(rates: list[float]) -> float:
    """Expected accepted tokens of a chain whose i-th token is accepted with ``rates[i]`` given the ones
    before it: the sum of the running products."""
    total, p = 0.0, 1.0
    for r in rates:
        p *= r
        total += p
    return total


def micro_batches(counts: list[tuple[int, int]], n_ubatch: int) -> list[int]:
    """Rows of each micro-batch llama.cpp's ``split_equal`` makes of a decode whose rows are ``counts``
    ((sequence, rows) in batch order, sequences sorted, one KV stream each): take the run of consecutive
    sequence ids that still have rows, starting at the first, and from each the same number of rows,
    as many as the shortest has left and ``n_ubatch`` allows; repeat."""
    return list(_micro_batches(tuple(counts), n_ubatch))


@functools.lru_cache(maxsize=4096)
def _micro_batches(counts: tuple[tuple[int, int], ...], n_ubatch: int) -> tuple[int, ...]:
    """``micro_batches``, kept per layout: a step prices a dozen layouts, and the same few recur every step."""
    left = [[seq, n] for seq, n in counts if n > 0]
    sizes = []
    while left:
        run = [left[0]]
        for entry in left[1:]:
            if entry[0] != run[-1][0] + 1 or len(run) >= n_ubatch:
                break
            run.append(entry)
        take = max(1, min(min(n for _, n in run), n_ubatch // len(run)))
        for entry in run:
            entry[1] -= take
        sizes.append(take * len(run))
        left = [e for e in left if e[1] > 0]
    return tuple(sizes)
