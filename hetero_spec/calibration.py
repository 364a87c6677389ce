"""The machine's cost model: how long the target takes to verify n rows, and the draft one step.

Speculation pays only when ``accepted tokens / (verify time + draft time)`` beats one
token per single-row decode, and on a CPU target verification cost grows with the rows
(t(4) is about 2.2x t(1) for a 135M model, much flatter for a 7B one).  Automatic draft
sizing therefore needs the measured curve t(n) for this model on this machine; it is
cached as JSON per machine, model file, draft file and thread count.

Verification is timed exactly as the speculative loop verifies: embeddings on, every
row an output, one ``llama_decode`` of n rows after a realistic prefix, rolled back
after each timing.  This module imports neither llama.cpp nor torch itself: it drives a
``LlamaTarget`` and a ``DraftRunner`` handed in by the caller (like ``api.py``).

>>> curve = load_or_measure(hs.target, hs.draft, model_path, draft_path)
>>> curve.verify_ratio(4)          # t(4) / t(1)
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import random
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable

import numpy as np

from . import atomic_file
from .errors import HeteroSpecError

if TYPE_CHECKING:  # concrete types only for readers; the boundary stays clean at run time
    from .draft.runner import DraftRunner
    from .target.llama_target import LlamaTarget

CURVE_VERSION = 1
# Bumped when the draft runtime's step cost changes, so that a curve cached with a draft is measured again
# rather than pricing the draft at its old cost (v2: weight-only int8 fusion, the one-position forward and
# the target's threads for the draft; v3: the native greedy chain, draft/native.py; v4: its int4 head and
# prefetching; docs/bench.md).  Curves without a draft keep their key.
DRAFT_STEP_VERSION = 4
# Bumped when what t(n) means changes, so that every cached curve is measured again (v2: each width timed
# as a round among plain rounds, ``_round_among_plain_rounds``; v3: the first-use calibration times every
# width up to the deepest copy chain's, ``api.QUICK_ROWS``; v4: with the plain decodes that settle after it,
# ``SETTLE_ROUNDS``).
TIMING_VERSION = 4
# One-row decodes timed after each wider one, whose after-effect they carry (``_round_among_plain_rounds``);
# auto leaves as many plain rounds after a wider round out of its measured plain cost (``spec.policy``).
SETTLE_ROUNDS = 8
MAX_ROWS = 32  # the batch-invariant micro-batch: a verification never decodes more rows at once
PREFIX_TOKENS = 128  # verification is timed after a prefix of this length (attention cost is real)
_FILLER = (
    "The quick brown fox jumps over the lazy dog while the committee reviews the quarterly budget, "
    "and a student explains how photosynthesis turns light, water and carbon dioxide into sugar. "
)


@dataclass(frozen=True)
class CostCurve:
    """Median wall times on one machine for one target (and draft).

    ``verify_ms[n]``: one decode of n rows with embeddings on (the verification of n-1 drafts), as it costs
    inserted among one-row decodes (``_round_among_plain_rounds``; t(1) is a plain stream's);
    ``draft_step_ms``: one draft step (one row forward + head argmax) on the draft's device;
    ``draft_rows_ms[n]``: one draft forward over n rows (a tree depth), optional; ``draft_rows_ms[1]`` is
    a chain's later depth, which a CPU draft runs inside its native chain at ``draft_step_ms``;
    ``draft_switch_ms``: what the first draft forward of a round costs beyond ``draft_step_ms``
    because a target decode ran just before it, as one always has in the loop.  On a CPU draft
    the decode evicts the draft's weights from the shared cache: on SmolLM2 Q4_0 (2-core EPYC,
    32 MiB L3, int8 darter) a step right after a two-row verification took 3.3-3.6 ms against
    2.2-2.8 ms back to back (a verification right after a step was not measurably slower).
    """

    verify_ms: dict[int, float]
    draft_step_ms: float
    draft_rows_ms: dict[int, float] = field(default_factory=dict)
    draft_switch_ms: float = 0.0
    machine: str = ""  # host, CPU model, threads
    kernels: str = ""  # llama.cpp's weight buffers and kernel plan during the measurement (LlamaTarget.kernels)
    model: str = ""  # GGUF file name and size (+ draft file name)

    def __post_init__(self) -> None:
        if 1 not in self.verify_ms:
            raise HeteroSpecError("a cost curve needs t(1), the single-row decode time")
        if any(v <= 0 for v in self.verify_ms.values()):
            raise HeteroSpecError("cost curve times must be positive")

    def verify_time_ms(self, n: int) -> float:
        """t(n) in ms; linear interpolation between measured n, linear extrapolation beyond."""
        if n < 1:
            raise ValueError(f"rows must be at least 1, not {n}")
        return _interp(self.verify_ms, n)

    def verify_ratio(self, n: int) -> float:
        """t(n) / t(1): how many single-row decodes one n-row verification costs."""
        return self.verify_time_ms(n) / self.verify_ms[1]

    def envelope_ms(self) -> dict[int, float]:
        """Monotone-in-n upper envelope of t(n): max over m <= n (kernel steps smoothed, never optimistic)."""
        out, top = {}, 0.0
        for n in sorted(self.verify_ms):
            top = max(top, self.verify_ms[n])
            out[n] = top
        return out

    def draft_rows_time_ms(self, n: int) -> float:
        """One draft forward over n rows; falls back to n steps when rows were not measured."""
        if not self.draft_rows_ms:
            return n * self.draft_step_ms
        return _interp(self.draft_rows_ms, n)

    def to_json(self) -> str:
        d = asdict(self)
        d["version"] = CURVE_VERSION
        d["verify_ratio"] = {n: round(self.verify_ratio(n), 4) for n in sorted(self.verify_ms)}
        return json.dumps(d, indent=2)

    @classmethod
    def from_json(cls, text: str) -> "CostCurve":
        try:
            d = json.loads(text)
            if d.get("version", CURVE_VERSION) != CURVE_VERSION:
                raise HeteroSpecError(f"calibration file version {d.get('version')} is not {CURVE_VERSION}")
            return cls(
                verify_ms={int(k): float(v) for k, v in d["verify_ms"].items()},
                draft_step_ms=float(d["draft_step_ms"]),
                draft_rows_ms={int(k): float(v) for k, v in d.get("draft_rows_ms", {}).items()},
                draft_switch_ms=float(d.get("draft_switch_ms", 0.0)),
                machine=str(d.get("machine", "")),
                model=str(d.get("model", "")),
                kernels=str(d.get("kernels", "")),
            )
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise HeteroSpecError(f"not a calibration file ({exc})") from None


def _interp(table: dict[int, float], n: int) -> float:
    if n in table:
        return table[n]
    xs = sorted(table)
    if len(xs) == 1:
        return table[xs[0]] * n / xs[0]
    if n > xs[-1]:  # extend the last segment's slope
        a, b = xs[-2], xs[-1]
        return table[b] + (table[b] - table[a]) / (b - a) * (n - b)
    if n < xs[0]:
        return table[xs[0]]
    hi = next(x for x in xs if x > n)
    lo = max(x for x in xs if x < n)
    w = (n - lo) / (hi - lo)
    return table[lo] * (1 - w) + table[hi] * w


# ------------------------------------------------------------------- measuring
def machine_id(threads: int) -> str:
    """Host name, CPU model, thread count and kernel plan: what makes a curve belong to this machine.

    t(n) depends on the kernels (a plain-CPU curve must not price a repacked run), so the plan is part of
    the key, and it is put in force here when no model was loaded yet (as any load would): a key made
    before a load then equals the one made after it.  Without that, a curve saved under a key made before
    any load (``tests/curves.py`` writes one for a server subprocess to read) was never found."""
    from .cpu_features import cpu_info
    from .target.kernels import apply_kernel_plan

    cpu = cpu_info()[0] or platform.processor() or platform.machine()
    return f"{platform.node()} | {cpu} | {os.cpu_count()} cpus | {threads} threads | kernels {apply_kernel_plan().mode}"


def describe_files(target_path: str | Path, draft_path: str | Path | None) -> str:
    p = Path(target_path)
    s = f"{p.name} ({p.stat().st_size} bytes)" if p.exists() else p.name
    return s + (f" + {Path(draft_path).name}" if draft_path is not None else "")


def _median_ms(fn: Callable[[], None], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def _warm_up(fn: Callable[[], None], *, calls: int, seconds: float) -> None:
    """Call ``fn`` at least ``calls`` times and for at least ``seconds``."""
    t_end = time.perf_counter() + seconds
    for _ in range(calls):
        fn()
    while time.perf_counter() < t_end:
        fn()


def _round_among_plain_rounds(verify: Callable[[int], None], n: int) -> float:
    """Seconds of an n-row decode right after a one-row decode, plus the ``SETTLE_ROUNDS`` one-row decodes
    after it: less ``SETTLE_ROUNDS`` settled plain decodes (``_plain_stream``), what inserting the round
    into plain decoding costs.

    WHY: a one-row decode right after a wider one is dearer than one in a stream of them, and not only the
    first.  llama.cpp reuses a decode's graph only while the batch keeps its shape, and on the 2-core Xeon
    VM (SmolLM2 Q4_0, a settled decode 5.3 ms) the one-row decodes after a 16-row decode took 8.4, 7.9, 7.1,
    6.7, 6.4, 6.3, 6.0 and 5.8 ms, after a 2-row one 6.9, 6.2, 6.1 and 5.8 ms (after 30 ms asleep too:
    whatever the host does, its caches or clocks settle over several decodes).  Timed with only the next
    decode, t(1) came out at 6.1 ms against a plain stream's 4.4, and every width at less than it costs:
    with its 45%-accepted darter draft, auto drafted on mt_bench at 0.82x of plain decoding."""
    verify(1)  # the round before it: a plain one
    t0 = time.perf_counter()
    verify(n)
    for _ in range(SETTLE_ROUNDS):
        verify(1)
    return time.perf_counter() - t0


def _plain_stream(verify: Callable[[int], None]) -> float:
    """Seconds of ``SETTLE_ROUNDS`` one-row decodes in a stream that has settled for as many: t(1) is
    what plain decoding costs a token once nothing else ran."""
    for _ in range(SETTLE_ROUNDS):
        verify(1)
    t0 = time.perf_counter()
    for _ in range(SETTLE_ROUNDS):
        verify(1)
    return time.perf_counter() - t0


def measure(
    target: "LlamaTarget",
    runner: "DraftRunner | None",
    *,
    ns: Iterable[int] = range(1, MAX_ROWS + 1),
    repeats: int | None = None,
    quick: bool = False,
    progress: Callable[[int], None] | None = None,
    model: str = "",
    focus: Iterable[int] = (),
    focus_repeats: int = 9,
) -> CostCurve:
    """Time t(n) for each n (median over ``repeats``), the draft step and draft row forwards.

    ``focus``: rows timed ``focus_repeats`` times however few ``repeats`` are.  Auto's choice between
    plain rounds and short chains rests on t(2)..t(5) against t(1), which a median of three timings on
    a VM leaves noisy: three calibrations of the scale-10 target on one machine gave t(2)/t(1) 1.34,
    1.47 and 1.50, enough to move a k=1 chain from 1.20x to 1.08x of plain decoding in auto's model.

    The order of n is shuffled on every pass, so machine drift spreads over all n instead
    of biasing the large ones.  Both caches are left empty afterwards.  ``progress`` is
    called with the number of timings done since the last call.
    """
    ns = sorted(set(int(n) for n in ns))
    if not ns or ns[0] < 1 or ns[-1] > MAX_ROWS:
        raise HeteroSpecError(f"calibration rows must lie in 1..{MAX_ROWS}")
    if 1 not in ns:
        ns = [1] + ns
    repeats = repeats or (3 if quick else 9)
    tokens = _prefix_tokens(target, ns[-1])
    was_on = target.embeddings
    target.reset()
    target.set_embeddings(True)  # all rows out, logits and hidden states: as the speculative loop verifies
    try:
        hidden, _ = target.prefill(tokens)
        n0 = target.n_past
        cand = tokens[1 : ns[-1] + 1]  # any ids do: the cost does not depend on which tokens

        def verify(n: int) -> None:
            target.verify(cand[:n])
            target.rollback(n0)

        for n in (1, ns[-1], 1):  # warm the caches and thread pool
            verify(n)
        samples: dict[int, list[float]] = {n: [] for n in ns}
        rng = random.Random(0)
        wanted = set(focus)
        focus = [n for n in ns if n in wanted]
        for i in range(max(repeats, focus_repeats if focus else 0)):
            order = ns[:] if i < repeats else focus[:]
            rng.shuffle(order)
            for n in order:
                samples[n].append(_plain_stream(verify) if n == 1 else _round_among_plain_rounds(verify, n))
                if progress:
                    progress(1)
        t1 = statistics.median(samples[1]) / SETTLE_ROUNDS
        # never below t(1): on a noisy VM the settled decodes after a round can run faster than the ones t(1) was
        # timed on, and a short run's difference went negative (t(3) -4.4 ms against t(1) 16.4 ms, one repeat)
        verify_ms = {n: 1e3 * (t1 if n == 1 else max(t1, statistics.median(samples[n]) - SETTLE_ROUNDS * t1))
                     for n in ns}
        step_ms, rows_ms, switch_ms = 0.0, {}, 0.0
        if runner is not None:
            step_ms, rows_ms, switch_ms = _measure_draft(runner, hidden, tokens, ns, repeats, progress,
                                                         after=lambda: verify(2))
    finally:
        target.reset()
        target.set_embeddings(was_on)
    return CostCurve(verify_ms, step_ms, rows_ms, switch_ms, machine=machine_id(target.n_threads), model=model,
                     kernels=target.kernels)


def merge(curves: list[CostCurve]) -> CostCurve:
    """Per-n medians of several curves of one machine and model: passes timed at intervals through a
    bench (``bench --project this-run``) so that the curve sees the machine as the prompts did.  On
    the 2-core VM, t(1) and t(2) of SmolLM2 Q4_0 moved 25-30% within one minute; a curve calibrated
    once, in another minute, projected a k=1 chain 25% off what the bench measured."""
    if not curves:
        raise HeteroSpecError("no calibration passes to merge")

    def med(tables: list[dict[int, float]]) -> dict[int, float]:
        keys = set().union(*tables)
        return {n: statistics.median(t[n] for t in tables if n in t) for n in sorted(keys)}

    return CostCurve(med([c.verify_ms for c in curves]), statistics.median(c.draft_step_ms for c in curves),
                     med([c.draft_rows_ms for c in curves]), statistics.median(c.draft_switch_ms for c in curves),
                     machine=curves[0].machine, model=curves[0].model, kernels=curves[0].kernels)


def _prefix_tokens(target: "LlamaTarget", rows: int) -> list[int]:
    want = max(8, min(PREFIX_TOKENS, target.n_ctx - rows - 2))
    ids: list[int] = []
    while len(ids) < want + rows + 1:
        ids += target.tokenize(_FILLER, add_special=False, parse_special=False)
    return ids[:want]


def _measure_draft(runner, hidden: np.ndarray, tokens: list[int], ns: list[int], repeats: int,
                   progress, after: Callable[[], None]) -> tuple[float, dict[int, float], float]:
    """(step ms, rows ms per n, switch ms); hidden [len(tokens), n_embd] float32: the target's real
    features for the prefix; ``after``: a target decode (rolled back), run before each step timed for
    the switch, as the loop runs the previous round's verification before the draft."""
    runner.reset()
    try:
        m = len(tokens) - 1
        runner.prefill(hidden[:m], tokens[1 : m + 1])  # cell i from (f_i, x_{i+1})
        n0 = runner.n
        feat, tok = hidden[m - 1 : m], [tokens[m - 1]]

        def step() -> None:
            runner.propose(feat, tok, 1)  # one forward of one row plus the head's argmax
            runner.rollback(n0)

        # A fresh process runs its first few dozen int8 draft steps at about twice the steady
        # cost (measured: 2.1-2.5 ms against 1.1 ms after 3 warm-up steps), and auto would then
        # price drafting at double; warm up by time as well as by count.
        _warm_up(step, calls=30, seconds=0.1)
        n_steps = max(repeats, 15)
        step_ms = _median_ms(step, n_steps)
        cold = []
        for _ in range(n_steps):
            after()
            cold.append(_median_ms(step, 1))
        switch_ms = max(0.0, statistics.median(cold) - step_ms)
        rows_ms = {}
        reps = np.resize(np.arange(m), ns[-1])  # row indices, tiled if the prefix is short

        for n in ns:
            f, t = hidden[reps[:n]], [tokens[i + 1] for i in reps[:n]]

            def rows(f=f, t=t) -> None:
                runner.prefill(f, t)
                runner.rollback(n0)

            rows_ms[n] = _median_ms(rows, repeats)
            if n == 1 and getattr(runner, "_native", None) is not None:
                # a chain's later depths run inside the native chain (draft/native.py), not as torch forwards
                # of one row (three times dearer): price them as the step measured above
                rows_ms[n] = min(rows_ms[n], step_ms)
            if progress:
                progress(repeats)
    finally:
        runner.reset()
    return step_ms, rows_ms, switch_ms


# ---------------------------------------------------------------------- caching
def cache_dir() -> Path:
    """``calibration/`` under hetero-spec's cache (``$HETERO_SPEC_CACHE`` moves all of it)."""
    from .target.gguf_weights import cache_dir as root

    return root() / "calibration"


def file_ident(p: str | Path | None) -> str:
    """A file's path, size and modification time: a cache keyed on it is measured again when the file changes."""
    if p is None:
        return "none"
    p = Path(p).resolve()
    st = p.stat() if p.exists() else None
    return f"{p}:{st.st_size if st else 0}:{int(st.st_mtime) if st else 0}"


def cache_path(target_path: str | Path, draft_path: str | Path | None, threads: int) -> Path:
    """One JSON per machine, target file (name, size, mtime), draft file and thread count."""

    key = "|".join([machine_id(threads), file_ident(target_path), file_ident(draft_path)]
                   + ([f"draft-step-v{DRAFT_STEP_VERSION}"] if draft_path is not None and DRAFT_STEP_VERSION > 1 else [])
                   + [f"timing-v{TIMING_VERSION}"])
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return cache_dir() / f"{Path(target_path).stem}-t{threads}-{digest}.json"


def load_or_measure(
    target: "LlamaTarget",
    runner: "DraftRunner | None",
    target_path: str | Path,
    draft_path: str | Path | None,
    *,
    quick: bool = True,
) -> CostCurve:
    """The cached curve for this machine and model, measuring (quickly by default) on first use."""
    path = cache_path(target_path, draft_path, target.n_threads)
    if path.is_file():
        try:
            text = path.read_text()
            curve = CostCurve.from_json(text)
            # a draft's curve from before draft_switch_ms was measured would price drafting too cheaply
            if runner is None or (curve.draft_step_ms > 0 and "draft_switch_ms" in json.loads(text)):
                return curve
        except HeteroSpecError:
            pass  # unreadable or old: measure again
    curve = measure(target, runner, quick=quick, model=describe_files(target_path, draft_path))
    save(curve, path)
    return curve


def timings_count(quick: bool, repeats: int | None, with_draft: bool) -> int:
    """How many timed calls ``measure`` makes (for a progress bar)."""
    r = repeats or (3 if quick else 9)
    return MAX_ROWS * r * (2 if with_draft else 1)


def save(curve: CostCurve, path: str | Path) -> Path:
    return atomic_file.write_text(path, curve.to_json())  # a concurrent reader never sees half a file


__all__ = ["CostCurve", "measure", "merge", "cache_dir", "cache_path", "file_ident", "load_or_measure", "save", "machine_id", "timings_count"]
