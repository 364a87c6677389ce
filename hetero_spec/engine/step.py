"""The engine: one step = the scheduler's rows -> one llama_decode -> each slot's next tokens.

Every slot is a sequence of one ``SequenceTarget`` context.  A step's decode holds every generating
slot's pending token and its drafts (the same number for all), pad rows that keep the sequences in
one micro-batch, and one prompt chunk (``scheduler.py`` says why this layout); llama.cpp cuts it
into micro-batches of at most 32 rows, the bound under which its rows are batch-invariant, so a
greedy answer is the same whoever else is served (tested against single-sequence decoding, logits
bit for bit), and so is a seeded sampled one, drafted or not (``Engine._accept``).  How many drafts a
step verifies is priced on the batch (``cost.py``).

Drafts come from two sources: copies of what followed a suffix match in the request's text or in past
answers (``spec/suffix.py``), and, with a draft model (``drafts.py``), the model's chains for slots with
no copy behind a long match.  A draft model's step is paid before the decode it feeds, so whether it
runs, and how deep, is priced first: every slot that would draft adds its expected accepted tokens,
and the step adds the draft's measured step time per depth to the decode's price.
"""
from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np

from ..calibration import SETTLE_ROUNDS
from ..spec.sampling import process_support, sample_support
from ..spec.suffix import SuffixCache, SuffixConfig
from ..target.sequences import Row, SequenceTarget
from .cost import PROBE_ROWS, Acceptance, StepCost, expected_accepted, micro_batches
from .drafts import SlotDrafts
from . import price_cache
from .prompt_cache import PromptCache
from .scheduler import Admitted, Scheduler
from .slots import Request, Slot


@dataclass(frozen=True)
class Drafting:
    """Which draft rows the engine may verify: copies of what followed the longest suffix match of a request's
    text, in its prompt, its answer so far and past answers (``spec/suffix.py``), up to ``lookup_depth``
    tokens a step (0: off), trusted behind a match of at least ``lookup_min_match`` tokens (the first
    proposed token was right 94% of the time after 8 or more on SmolLM2's answers, ``spec/lookup.py``),
    for greedy and sampled requests alike (``Engine._accept`` says why a sampled answer is the same with drafts
    as without); ``cache_tokens`` of past answers are kept.
    ``priced``: the draft length of a step is the one with the most expected tokens per millisecond
    (``cost.py``); off, every step verifies the longest trusted proposal (for tests)."""

    lookup_depth: int = 0
    lookup_min_match: int = 8
    priced: bool = True
    cache_tokens: int = SuffixConfig.cache_tokens
    draft_depth: int = 0  # a draft model's chain per step, at most (0: no draft model; needs Engine(draft=...))


@dataclass(frozen=True)
class StepRecord:
    """What one step did, for metrics: rows by kind, drafted tokens accepted, occupied slots, waiting
    requests, seconds."""

    rows: int
    prompt_rows: int
    plain_rows: int
    draft_rows: int
    accepted: int  # draft rows whose token the target agreed with
    active_slots: int
    waiting: int
    decode_s: float
    pad_rows: int = 0
    reused: int = 0  # prompt tokens found in a slot's cells by the requests admitted this step
    restored: int = 0  # ... of which the prompt cache put back (engine/prompt_cache.py)


MATCH_BUCKETS = (8, 16, 32)  # match lengths from which drafts are trusted, counted apart (the first: lookup_min_match)
NEURAL = 0  # the Engine.trusted key of the draft model's chains
NEURAL_PRIOR = 0.5  # its acceptance per token until measured
PROBE_EVERY = 32  # steps without the draft model after which it drafts once anyway, to keep its acceptance current;
PROBE_MAX = 1024  # ... doubled after each probe that did not make it pay, up to this


@dataclass
class Proposal:
    """A generating slot's drafts this step: ``tokens[:sure]`` behind a long match, the rest guesses."""

    tokens: list[int] = field(default_factory=list)
    sure: int = 0
    room: int = 0  # the most drafts this slot may verify (its answer budget and context)
    bucket: int = 0  # MATCH_BUCKETS entry of the match behind the trusted drafts


class Engine:
    """Slots over one multi-sequence context; ``step`` advances every active request by one decode.

    >>> engine = Engine(SequenceTarget(path, SequenceOptions(n_seq=4)), max_waiting=16)
    >>> answers = engine.generate_many([ids_a, ids_b], max_new_tokens=64)   # list of id lists
    """

    def __init__(self, target: SequenceTarget, *, max_waiting: int = 16, drafting: Drafting = Drafting(),
                 draft: SlotDrafts | None = None, prompt_cache: PromptCache | None = None) -> None:
        """``draft``: a draft model for the slots (``drafting.draft_depth`` > 0), on a target opened with
        features (``SequenceOptions(features=True, taps=<the draft's>)``).  ``prompt_cache``: free slots' cells
        saved in host memory before a request takes the slot, restored for a later prompt that starts alike
        (``prompt_cache.py``)."""
        self.target = target
        self.prompt_cache = prompt_cache
        self.drafting = drafting
        self.draft = draft if drafting.draft_depth > 0 else None
        if self.draft is not None:
            if not target.options.features or target.feature_size != self.draft.feature_size:
                raise ValueError(f"the draft reads {self.draft.feature_size} values per row; open the target with "
                                 f"features=True and the draft's taps (it gives {target.feature_size})")
            if len(self.draft.slots) < target.options.n_seq:
                raise ValueError(f"the draft has {len(self.draft.slots)} slots for {target.options.n_seq} sequences")
        # only the rows whose logits pick a token are outputs: the target's features cover every row
        self.scheduler = Scheduler(target.options.n_seq, max_waiting, target.options.max_rows, target.seq_ctx)
        self.cost = StepCost()
        self.prices_file: Path | None = None  # where ``calibrate(cached=True)`` read or wrote the prices
        self.prices_measured_s = 0.0
        # acceptance of trusted drafts by the length of the match behind them (an exact repeat of a past answer
        # matches far back and is copied almost whole), of the draft model's chains, and of guesses that only
        # fill the batch's width; for greedy and sampled requests apart (keyed (sampled, bucket)), since a sampled
        # answer takes a draft token only as often as it draws it (the same priors: each is measured within steps)
        priors = {**dict(zip(MATCH_BUCKETS, (0.8, 0.9, 0.95))), NEURAL: NEURAL_PRIOR}
        self.trusted = {(sampled, b): Acceptance(prior=p) for sampled in (False, True) for b, p in priors.items()}
        self._probe_every = PROBE_EVERY  # steps without drafting before a probe (doubles while probes do not pay)
        self._since_draft = PROBE_EVERY  # the first chance to draft probes
        self._after_probe = False
        self.guess = {sampled: Acceptance(prior=0.1) for sampled in (False, True)}
        self._last_rows = 0  # rows of the last step's decode
        self.suffix_cache = SuffixCache(SuffixConfig(max_depth=max(1, drafting.lookup_depth),
                                                     cache_tokens=drafting.cache_tokens))

    def submit(self, request: Request) -> None:
        """Queue ``request`` (FIFO); ``QueueFull`` when ``max_waiting`` already wait."""
        if request.keep_features and not self.target.options.features:
            raise ValueError("keep_features needs a target opened with features=True")
        if not request.prompt or len(request.prompt) >= self.target.seq_ctx:
            raise ValueError(f"a prompt of {len(request.prompt)} tokens does not fit a slot of "
                             f"{self.target.seq_ctx} cells")
        self.scheduler.submit(request)

    @property
    def idle(self) -> bool:
        return not self.scheduler.active and not self.scheduler.waiting

    def abandon(self) -> list[Request]:
        """Drop every request, waiting or in a slot, and empty every slot; returns the dropped requests.

        WHY: after a step that failed or was interrupted (a Ctrl-C lands anywhere in it), the slots' cells,
        their drafts' state and their requests no longer agree, and stepping on would fail again every time.
        What was learnt stays: prices, acceptance, the prompt cache and the suffix cache of past answers."""
        sch = self.scheduler
        dropped = [*sch.waiting, *(slot.request for slot in sch.active)]
        self.scheduler = Scheduler(len(sch.slots), sch.max_waiting, sch.max_rows, sch.seq_ctx)  # first: whatever
        for slot in sch.slots:  # happens below, no request is left to step
            self.target.clear(slot.seq)
            if self.draft is not None:
                self.draft.stop(slot.seq)
        for request in dropped:
            request.stop_reason = request.stop_reason or "cancelled"
        return dropped

    def calibrate(self, rows: tuple[int, ...] = PROBE_ROWS, repeats: int = 5, context: int = 256, *,
                  cached: bool = False) -> StepCost:
        """Measure one micro-batch at several fills on this machine, before any request: the prices ``_choose``
        starts from (steps that keep a shape scale them all, ``StepCost``).  Laid out as steps are (the rows spread
        evenly over consecutive sequences, each holding ``context`` cells already, as a request in flight
        does); every sequence is left empty.

        As ``calibration.py`` times a round: one row from a stream of one-row decodes that has settled, and
        a wider micro-batch plus what it adds to the ``SETTLE_ROUNDS`` one-row decodes after it (the median of
        that over every width's), since on some hosts the decodes after a wider one stay slow for several
        steps (measured on the 2-core Xeon VM: a one-row step priced right after the context's 32-row decodes
        at 8.6 ms against 5.0 settled, so a single slot drafted the darter's chains every step at 0.87-0.90
        times ``run``).
        Each pass times every width once, in a shuffled order, so that a slow spell of the host raises all
        prices alike instead of the few widths timed during it.

        ``cached``: the prices come from the file kept for this machine, model and layout when there is one
        (``price_cache.py``), else they are measured and the file written; ``prices_file`` names it and
        ``prices_measured_s`` says how long measuring took (0 when read)."""
        if not self.idle:
            raise RuntimeError("calibrate an engine before it serves")
        started = time.perf_counter()
        t = self.target
        context = max(0, min(context, t.seq_ctx - t.options.max_rows - 1))  # room for the widest probe after it
        path = price_cache.prices_path(t, rows, repeats, context) if cached else None
        if path is not None and (cost := price_cache.load(path)) is not None:
            self.cost, self.prices_file, self.prices_measured_s = cost, path, 0.0
            return cost
        self._measure(rows, repeats, context)
        self.prices_measured_s = time.perf_counter() - started
        if path is not None:
            self.prices_file = price_cache.save(self.cost, path, f"{t.path.name}, measured by "
                                                f"Engine.calibrate in {self.prices_measured_s:.1f} s")
        return self.cost

    def _measure(self, rows: tuple[int, ...], repeats: int, context: int) -> None:
        t = self.target
        self.cost = StepCost()  # new points, and no correction learnt against the old ones
        n_seq, ub = t.options.n_seq, t.options.max_rows
        for seq in range(n_seq):
            for start in range(0, context, ub):
                t.decode([Row(seq, 0, p, False) for p in range(start, min(context, start + ub))])

        def plain_rows(count: int) -> None:  # one-row decodes in sequence 0, each rolled back
            for _ in range(count):
                t.decode([Row(0, 0, context, True)])
                t.keep(0, context)

        def wide(n: int) -> tuple[float, float]:  # ms of an n-row micro-batch, and of the one-row decodes after it
            seqs = next(k for k in range(min(n, n_seq), 0, -1) if n % k == 0)  # n = seqs x rows each
            t0 = time.perf_counter()
            t.decode([Row(seq, 0, context + i, True) for seq in range(seqs) for i in range(n // seqs)])
            decoded = time.perf_counter()
            for seq in range(seqs):
                t.keep(seq, context)
            plain_rows(SETTLE_ROUNDS)
            return 1e3 * (decoded - t0), 1e3 * (time.perf_counter() - decoded)

        def settled() -> float:  # ms of one-row decodes after as many
            plain_rows(SETTLE_ROUNDS)
            t0 = time.perf_counter()
            plain_rows(SETTLE_ROUNDS)
            return 1e3 * (time.perf_counter() - t0)

        widths = [1] + [n for n in rows if 1 < n <= min(ub, t.options.batch_rows)]
        settled_ms: list[float] = []
        decode_ms: dict[int, list[float]] = {n: [] for n in widths[1:]}
        after_ms: list[float] = []
        order, rng = widths[:], random.Random(0)
        for _ in range(repeats):  # every width once a pass, in a new order: the host's drift spreads over all
            rng.shuffle(order)
            for n in order:
                if n == 1:
                    settled_ms.append(settled())
                else:
                    ms, after = wide(n)
                    decode_ms[n].append(ms)
                    after_ms.append(after)
        self.cost.set_median(1, [s / SETTLE_ROUNDS for s in settled_ms])
        t1 = self.cost.at(1)
        # what a wider decode adds to the one-row decodes after it, pooled over every width: each sample is the
        # difference of two sums of SETTLE_ROUNDS decodes, too noisy to price a width alone (on the 2-core EPYC VM a
        # cached calibration priced 4 rows at 20.1 ms and 8 at 26.4, where back-to-back they ran at 16.2 and 28.0)
        slowed = statistics.median(a - SETTLE_ROUNDS * t1 for a in after_ms) if after_ms else 0.0
        for n in widths[1:]:  # noise can push the after-effect below -t(n)
            self.cost.set_median(n, [max(t1, ms + slowed) for ms in decode_ms[n]])
        for slot in self.scheduler.slots:
            t.clear(slot.seq)
            slot.cached = []

    def step(self) -> tuple[StepRecord | None, list[Request]]:
        """Admit, decode one batch, pick tokens; returns the step's record (None if nothing ran) and
        the requests that finished in it (their slots are free again)."""
        sch = self.scheduler
        finished = []
        for slot in sch.active:  # a cancelled request leaves before the decode: its slot is free this step
            if slot.request.cancelled:
                _end(slot.request, "cancelled")
                finished.append(self._release(slot))
        reused = restored = 0
        for a in sch.admit(self.suffix_cache if self.drafting.lookup_depth > 0 else None):
            reuse = self._restore(a) if self.prompt_cache is not None else a.reuse
            self.target.keep(a.slot.seq, reuse)  # the cells of the prompt's start stay, the rest leave
            reused += reuse
            restored += reuse - a.reuse
            if self.draft is not None:
                self.draft.start(a.slot.seq, a.slot.request.prompt, reuse)
        proposals = self._propose()
        probed: set[Slot] = set()
        if self.draft is not None:
            chains = self._draft_chains(proposals)
            proposals |= chains
            if self._after_probe:
                probed = set(chains)
        ks = self._choose(proposals)
        if probed:  # a probe's chain is verified whatever the layouts' prices say: it is there to measure them
            forced = ks | {slot: len(proposals[slot].tokens) for slot in probed}
            if sum(n for _, n in self.scheduler.counts(forced)) <= self.target.options.batch_rows:
                ks = forced
        for slot, prop in proposals.items():
            k = ks.get(slot, 0)
            slot.drafts, slot.sure, slot.bucket = prop.tokens[:k], min(prop.sure, k), prop.bucket
            if k == 0 and prop.sure and prop.bucket != NEURAL and not slot.shadow.guesses:
                slot.shadow.open(prop.tokens[:prop.sure], partial(self._shadowed, (slot.sampled, prop.bucket)))
        plan = sch.plan(ks)
        if not plan.rows:
            return None, finished
        n_active = len(sch.active)
        t0 = time.perf_counter()
        logits = self.target.decode([r for _, r, _ in plan.rows])
        decode_s = time.perf_counter() - t0
        # how one micro-batch runs against its price, from steps that keep the shape of the step before: a step after
        # a different one carries its after-effect (``calibrate``), which the calibrated prices already hold
        if len(plan.rows) == self._last_rows and len(micro_batches(plan.counts, self.target.options.max_rows)) == 1:
            self.cost.observe(len(plan.rows), 1e3 * decode_s)
        self._last_rows = len(plan.rows)
        feats = None  # [rows of the decode, feature_size], read once a slot keeps rows
        accepted = 0
        trim = {slot for slot, _, kind in plan.rows if kind in ("pad", "draft")}
        for slot, mine in _slot_rows(plan.rows).items():
            if slot.free:
                continue
            req = slot.request
            before = len(req.out)
            prompt = [(i, row) for i, _, row, kind in mine if kind == "prompt"]
            if slot.prefilling:
                slot.fed += len(prompt)
            picking = [(i, j) for i, j, row, kind in mine
                       if j is not None and (kind != "prompt" or row.pos == len(req.prompt) - 1)]
            if picking:
                accepted += self._accept(slot, [logits[j] for _, j in picking])
                if slot.shadow.guesses:
                    slot.shadow.check(req.out[before:])
            drafting = self.draft is not None and self.draft.slots[slot.seq].active and not req.done
            if req.keep_features or drafting:
                picked = req.out[before:]
                real = [(i, req.prompt[row.pos + 1]) for i, row in prompt if row.pos + 1 < len(req.prompt)]
                real += [(i, t) for (i, _), t in zip(picking, picked)]  # each kept row with the token picked after it
                if real:
                    feats = self.target.features() if feats is None else feats
                    rows = feats[[i for i, _ in real]]
                    if req.keep_features:
                        req.features.append(rows)
                    if drafting:
                        self.draft.feed(slot.seq, rows, [t for _, t in real])
            if req.done:
                finished.append(self._release(slot))
                trim.discard(slot)
        for slot in trim:  # rejected drafts and pad rows leave, newest first
            self.target.keep(slot.seq, slot.n_past)
        kinds = [kind for _, _, kind in plan.rows]
        record = StepRecord(len(plan.rows), kinds.count("prompt"), kinds.count("plain"), kinds.count("draft"),
                            accepted, n_active, len(sch.waiting), decode_s, kinds.count("pad"), reused, restored)
        return record, finished

    def _restore(self, a: Admitted) -> int:
        """Before ``a``'s prompt is fed: save the cells its slot is about to drop, and put back the saved cells
        that hold a longer start of the prompt than the slot's own, if any; returns the prompt tokens whose cells
        the slot now holds."""
        cache, slot, request = self.prompt_cache, a.slot, a.slot.request
        if len(a.previous) - a.reuse >= cache.min_tokens:  # a few dropped tokens (a turn's end) are not worth it
            cache.save(a.previous, lambda: self.target.save_cells(slot.seq))
        if request.keep_features:  # restored cells have no features
            return a.reuse
        n, entry = cache.best(request.prompt)
        if entry is None or n <= a.reuse:
            return a.reuse
        self.target.restore_cells(slot.seq, entry.state)
        slot.fed = n
        return n

    def _release(self, slot: Slot) -> Request:
        """Free ``slot``; its cells keep the request's text for a later prompt that starts alike."""
        request = self.scheduler.release(slot)
        self.target.keep(slot.seq, slot.n_past)
        if self.draft is not None:
            self.draft.stop(slot.seq)  # its queued rows go
        return request

    def _propose(self) -> dict[Slot, Proposal]:
        """Each generating slot's prompt-lookup drafts, up to ``lookup_depth``: trusted behind a match
        of ``lookup_min_match`` tokens, else guesses (a shorter match's continuation, else the pending token
        repeated) that fill the batch's width when other slots draft."""
        d = self.drafting
        out: dict[Slot, Proposal] = {}
        if d.lookup_depth <= 0:
            return out
        peers = [s.suffix for s in self.scheduler.active if s.suffix is not None]  # the texts of the requests in flight
        for slot in self.scheduler.generating:
            if slot.suffix is None:
                continue
            room = min(d.lookup_depth, self._room(slot))
            if room <= 0:
                continue
            prop = slot.suffix.propose(tree=False, max_depth=room, peers=peers)
            tokens = prop.chain[:room] if prop is not None else []
            match = prop.match if prop is not None else 0
            sure = len(tokens) if match >= d.lookup_min_match else 0
            bucket = max((b for b in MATCH_BUCKETS if match >= b), default=MATCH_BUCKETS[0])
            fill = tokens[-1] if tokens else slot.pending
            out[slot] = Proposal(tokens + [fill] * (room - len(tokens)), sure, room, bucket)
        return out

    def _room(self, slot: Slot) -> int:
        """Drafts the slot may verify this step: no more than its request still takes, and none past its
        last cell (its pending token takes cell ``n_past``, as ``x`` does in ``HeteroSpec``'s rounds)."""
        req = slot.request
        return max(0, min(req.max_new_tokens - len(req.out) - 1, self.target.seq_ctx - 1 - slot.n_past))

    def _draft_chains(self, copies: dict[Slot, Proposal]) -> dict[Slot, Proposal]:
        """The draft model's chains for generating slots without a copy behind a long match, as deep as
        pays on this step (``_draft_depth``); trusted as drafts of their own kind (``NEURAL``)."""
        slots = [s for s in self.scheduler.generating if self.draft.slots[s.seq].active
                 and not (s in copies and copies[s].sure)]
        if not slots:
            return {}
        k, probe = self._draft_depth(slots)
        if k == 0:  # after a probe that did not make drafting pay, the next probe waits twice as long
            self._since_draft += 1
            if self._after_probe:
                self._probe_every, self._after_probe = min(2 * self._probe_every, PROBE_MAX), False
            return {}
        if not probe:  # priced and paying: probes are frequent again once it stops paying
            self._probe_every = PROBE_EVERY
        elif self.drafting.priced and self.draft.step_ms is not None:
            # a probe samples acceptance in one slot, the one with the fewest rows queued (they are all read)
            slots = [min(slots, key=lambda s: self.draft.slots[s.seq].queued)]
        self._after_probe = probe
        self._since_draft = 0
        chains = self.draft.propose([s.seq for s in slots], k)
        out = {}
        for slot in slots:
            tokens = chains.get(slot.seq, [])[:min(k, self._room(slot))]
            if tokens:
                out[slot] = Proposal(tokens, len(tokens), len(tokens), NEURAL)
        return out

    def _draft_depth(self, slots: list[Slot]) -> tuple[int, bool]:
        """How deep the draft model drafts for ``slots`` this step, and whether it is a probe: of
        0..``draft_depth``, the depth whose step (reading the kept rows and the draft's depths, then the decode
        with every such slot that deep) gives the most expected tokens per millisecond; the full depth when
        unpriced, and, as a probe that keeps the acceptance current, after ``PROBE_EVERY`` steps without
        drafting (twice as many after each probe that did not make it pay, up to ``PROBE_MAX``: a probe reads
        every row queued since)."""
        depth = self.drafting.draft_depth
        if not self.drafting.priced:
            return depth, False
        if self.draft.step_ms is None or self._since_draft >= self._probe_every:
            return depth, True
        if not self.cost.known:
            return 0, False
        rates, n_gen = [self.trusted[s.sampled, NEURAL].rate for s in slots], len(self.scheduler.generating)
        read = self.draft.read_ms if self.draft.read_ms is not None else self.draft.step_ms  # a step's kept rows
        best_k, best_value = 0, -1.0
        shape, ub = self.scheduler.shape(), self.target.options.max_rows
        for k in range(depth + 1):
            ms = self.cost.step_ms(shape.counts({s: k for s in slots}), ub)
            draft_ms = read + k * self.draft.step_ms if k else 0.0
            value = (n_gen + sum(expected_accepted([rate] * k) for rate in rates)) / (ms + draft_ms)
            if value > best_value:
                best_k, best_value = k, value
        return best_k, False

    def _choose(self, proposals: dict[Slot, Proposal]) -> dict[Slot, int]:
        """Drafts per generating slot this step: of a few layouts (none; every proposing slot as deep, guesses
        filling; each slot its trusted drafts only, and that less one slot at a time), the one with the most
        expected tokens per millisecond of the whole step, its micro-batches priced as llama.cpp will cut them
        (``cost.micro_batches``).  Unpriced: every proposing slot as deep as the longest trusted proposal."""
        sure = {slot: p.sure for slot, p in proposals.items() if p.sure}
        if not sure:
            return {}
        deepest = max(sure.values())
        cap = self.target.options.batch_rows

        def fits(ks: dict[Slot, int]) -> bool:
            return sum(n for _, n in self.scheduler.counts(ks)) <= cap

        if not self.drafting.priced:
            for k in range(deepest, 0, -1):
                ks = {slot: min(k, p.room) for slot, p in proposals.items()}
                if fits(ks):
                    return ks
            return {}
        if not self.cost.known:  # no probe ran (``calibrate``): steps price the rows once two fills are seen
            return {}
        shape, ub = self.scheduler.shape(), self.target.options.max_rows
        # expected accepted drafts of each slot's first k proposals, for every k (trusted, then guesses)
        gains = {}
        for slot, p in proposals.items():
            trusted, guess = self.trusted[slot.sampled, p.bucket].rate, self.guess[slot.sampled].rate
            run, reach = [0.0], 1.0
            for i in range(len(p.tokens)):
                reach *= trusted if i < p.sure else guess
                run.append(run[-1] + reach)
            gains[slot] = run
        candidates = [{}, dict(sure)]
        candidates += [{slot: min(k, p.room) for slot, p in proposals.items()} for k in range(1, deepest + 1)]
        candidates += [{s: k for s, k in sure.items() if s is not drop} for drop in sure] if len(sure) > 1 else []
        n_gen = len(shape.generating)
        best, best_value, seen = {}, -1.0, set()
        for ks in candidates:
            counts = shape.counts(ks)
            if counts in seen or sum(n for _, n in counts) > cap:
                continue
            seen.add(counts)
            gain = sum(gains[s][k] for s, k in ks.items())
            value = (n_gen + gain) / self.cost.step_ms(counts, ub)
            if value > best_value:
                best, best_value = ks, value
        return best

    def _accept(self, slot: Slot, logits: list[np.ndarray]) -> int:
        """The slot's tokens from its rows: row i's token is picked (``_pick``) and kept, and row i+1 counts only
        if row i's token is the draft decoded there; returns the drafts accepted.  ``slot.pending`` is the last
        kept token (its cell is not in the cache yet).

        WHY a sampled request may draft: every draft here is one token per row, not a distribution, and for such a
        draft d speculative sampling's rule (accept with probability p(d), else draw from p without d) keeps the
        same tokens as drawing x from p and keeping d only if x == d.  Each picked token takes the slot's next
        uniform, and the rows after a miss are dropped unread, so the i-th answer token always takes the i-th
        uniform from the same logits (bit-identical by batch invariance): a seeded answer is the same drafted or
        not, whoever shares the steps.  llama.cpp's server verifies its drafts for sampled requests the same way."""
        drafts, sure = slot.drafts, slot.sure
        slot.drafts, slot.sure = [], 0
        slot.pending = None
        accepted = 0
        for i, row in enumerate(logits):
            token = self._pick(slot, row)
            if slot.request.done:
                break
            if i < len(drafts) and token == drafts[i]:
                accepted += 1
                continue
            slot.pending = token
            break
        if drafts:
            reached = min(accepted + 1, len(drafts))
            self._count_trusted((slot.sampled, slot.bucket), sure, min(accepted, sure))
            self.guess[slot.sampled].count(max(0, reached - sure), max(0, accepted - sure))
        if slot.suffix is not None:
            slot.suffix.extend(slot.request.out[len(slot.suffix.output):])
        slot.request.drafted += len(drafts)
        slot.request.accepted += accepted
        return accepted

    def _shadowed(self, key: tuple[bool, int], depth: int, matched: int) -> None:
        """A trusted copy of ``depth`` tokens that no step verified, settled against the tokens the target picked
        next: counted as a verified one is (``_count_trusted``, as ``_accept`` counts).

        WHY: acceptance is otherwise learnt only from copies that were drafted, so a match class priced out (by its
        prior, or by a spell of rejected copies) stays out for good, whatever the requests now copy.  On the 2-core
        EPYC at one thread, where 17 rows cost 10-14 one-row decodes, an exact repeat of a past answer (accepted
        whole) was priced at the longest class's prior of 0.95 and drafted nothing in some calibrations.  Greedy
        answers check a copy for free, as ``auto`` does (``spec/shadow.py``); so do sampled ones, whose picked tokens
        are those a verified copy would have kept (``_accept``)."""
        self._count_trusted(key, depth, matched)

    def _count_trusted(self, key: tuple[bool, int], depth: int, matched: int) -> None:
        """A trusted chain of ``depth`` tokens whose first ``matched`` were the target's: the rows up to its first
        miss were reached (the miss included), those ``matched`` accepted; ``key``: (sampled, match bucket)."""
        self.trusted[key].count(min(matched + 1, depth), matched)

    def _pick(self, slot: Slot, logits: np.ndarray) -> int:
        """The slot's next token from one row's logits; ends the request at EOG, max tokens or a full slot."""
        req = slot.request
        if req.keep_logits:
            req.logits.append(logits.copy())
        if slot.rng is None:
            token = int(np.argmax(logits))
        else:
            ids, probs = process_support(logits, req.sampling)
            token = sample_support(ids, probs, slot.rng)
        req.out.append(token)
        if self.target.is_eog(token):
            _end(req, "eog")
        elif len(req.out) >= req.max_new_tokens:
            _end(req, "max_tokens")
        elif len(req.prompt) + len(req.out) > self.target.seq_ctx:  # its cell would lie past the last
            _end(req, "context_full")
        return token

    def run(self, requests: Iterable[Request | None] = ()) -> Iterator[tuple[StepRecord | None, list[Request]]]:
        """Steps until ``requests`` is spent and every request submitted has finished; yields each step that
        decoded or finished something, as (its record, the requests it finished).

        WHY one loop for every batch job (``generate_many``, ``BatchGenerator``, corpus answers, make-prompts):
        requests are taken from ``requests`` only while the queue has room (``max_waiting``), so a job of any
        length keeps at most that many waiting, each behind the ones before (FIFO).  ``None`` from it means
        "none now" (the caller's own bound on requests in flight): it is asked again after the next step, so
        it may say so only while a request is in flight.  Leaving early (a step or the caller raising, the
        iterator closed) drops whatever still waits or decodes (``abandon``), so the engine is ready for the
        next job; a job that ends keeps its slots' cells for the next prompts that start alike."""
        source = iter(requests)
        spent = ended = False
        try:
            while True:
                while not spent and len(self.scheduler.waiting) < self.scheduler.max_waiting:
                    request = next(source, _SPENT)
                    if request is None:
                        if self.idle:
                            raise RuntimeError("the requests said 'none now' with none in flight: nothing would "
                                               "ever change their mind")
                        break
                    if request is _SPENT:
                        spent = True
                    else:
                        self.submit(request)
                if spent and self.idle:
                    ended = True
                    return
                record, finished = self.step()
                if record is not None or finished:
                    yield record, finished
        finally:
            if not ended:
                self.abandon()

    def generate_many(self, prompts: list[list[int]], max_new_tokens: int, **fields) -> list[list[int]]:
        """The batch entry for offline jobs: every prompt's answer ids, in prompt order, through the slots
        (more prompts than ``max_waiting`` are fed in as slots free up)."""
        requests = [Request(list(p), max_new_tokens, tag=i, **fields) for i, p in enumerate(prompts)]
        for _ in self.run(requests):
            pass
        return [r.out for r in requests]


_SPENT = object()  # ``Engine.run``'s marker for a request source with nothing left


def _slot_rows(rows) -> dict:
    """{slot: [(index in the decode, index into its logits or None, row, kind)] in row order} (slots in row
    order); only output rows have logits."""
    out: dict = {}
    j = 0
    for i, (slot, row, kind) in enumerate(rows):
        out.setdefault(slot, []).append((i, j if row.output else None, row, kind))
        j += row.output
    return out


def _end(request: Request, reason: str) -> None:
    request.stop_reason = request.stop_reason or reason
