"""``serve --parallel N``: one thread drives the batched engine, N requests decoding in the same steps.

Like ``worker.Worker`` (same interface: start, wait_ready, stop, retry_after, alive), but instead of
one request at a time through ``HeteroSpec`` it keeps up to N requests in the slots of one
``hetero_spec.engine.Engine``: each step is one ``llama_decode`` holding every active slot's rows.
The model is loaded, used and closed on this thread (``worker.py`` says why).

Plain rows and draft rows, as many per step as pay on the whole batch (``engine/cost.py``): copies from
suffix matches, and with a draft model its chains, every slot's in the same decode.  Greedy answers equal the
same request served alone, bit for bit, and a seeded sampled answer is the same drafted or not
(tests/integration/test_engine.py checks the logits; tests/integration/test_server.py the texts through the
server).
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field, replace
from typing import Callable

from ..chat_template import render_chat
from ..engine import Drafting, Engine, Request, StepRecord
from ..engine.drafts import SlotDrafts
from ..engine.prompt_cache import PromptCache
from ..errors import HeteroSpecError
from ..records import Round, RunStats
from ..target.sequences import SequenceTarget
from ..text_stream import TextAssembler
from .errors import APIError, internal_error
from .events import Delta, Failed, Finished, Started
from .metrics import Metrics
from .queue import Job, RequestQueue
from .worker import FINISH_REASONS, STREAM_FLUSH_S, ModelThread, Work, warn_if_no_chat_fits

log = logging.getLogger("hetero_spec.server")
LOOKUP_DEPTH = 16  # longest copy-draft chain a slot verifies in a step (long ones only behind long matches)
DRAFT_DEPTH = 4  # longest draft-model chain a slot verifies in a step with --draft-len auto


@dataclass
class SlotModel:
    """What the slot worker's thread loads: the multi-sequence target and, with a draft file, the slots' drafts."""

    target: SequenceTarget
    drafts: SlotDrafts | None = None
    prompt_cache: PromptCache | None = None  # free slots' cells in host memory (--cache-ram)

    def close(self) -> None:
        self.target.close()


@dataclass(eq=False)
class Live:
    """A request in a slot: its job, the engine request, and what the handler has been sent."""

    job: Job
    request: Request
    text: TextAssembler
    stats: RunStats
    opened_at: float
    pieces: list[str] = field(default_factory=list)
    unsent: int = 0  # pieces[-unsent:] not streamed yet
    last_post: float = 0.0
    seen: int = 0  # request.out[:seen] already turned into text
    drafted: int = 0  # request.drafted / accepted when last seen: a Round per step from the difference
    accepted: int = 0
    ttft: float | None = None
    stop_reason: str | None = None  # set here when a stop string ends it (the engine says "cancelled")


class SlotWorker(ModelThread):
    """Decodes up to ``n_slots`` queued jobs together on a daemon thread through one ``Engine``."""

    def __init__(self, load: Callable[[], SequenceTarget], queue: RequestQueue, metrics: Metrics,
                 n_slots: int, drafting: Drafting = Drafting()) -> None:
        super().__init__(load, queue, metrics)
        self.drafting = drafting
        self.n_slots = n_slots
        self.engine: Engine | None = None
        self._live: dict[int, Live] = {}  # by id(request)

    def _opened(self, model: SlotModel | SequenceTarget) -> None:
        if isinstance(model, SequenceTarget):  # a loader of the target alone: no draft model
            model = SlotModel(model)
        drafting = self.drafting if model.drafts is not None else replace(self.drafting, draft_depth=0)
        self.engine = Engine(model.target, max_waiting=self.n_slots, drafting=drafting, draft=model.drafts,
                             prompt_cache=model.prompt_cache)
        warn_if_no_chat_fits(model.target)
        if drafting.lookup_depth > 0 or drafting.draft_depth > 0:  # prices a step's draft rows before the first request
            engine = self.engine
            engine.calibrate(cached=True)
            if engine.prices_measured_s:
                log.info("step prices measured in %.1f s, kept in %s", engine.prices_measured_s, engine.prices_file)
            else:
                log.info("step prices from %s (delete it to measure again)", engine.prices_file)
        if self.engine.draft is not None:
            log.info("draft model (%s weights) drafts up to %d tokens for each of %d slots, priced on the batch",
                     self.engine.draft.runner.weights, drafting.draft_depth, self.n_slots)

    def retry_after(self) -> int:
        waves = (self.queue.depth + 1) / self.n_slots
        return min(60, max(1, math.ceil(self._service_s * waves)))

    def slots(self) -> list[dict]:
        """Each slot's state for /health: idle, prefill or generating, with its request's token counts."""
        out = []
        engine = self.engine
        for slot in (engine.scheduler.slots if engine is not None else []):
            req = slot.request
            state = "idle" if req is None else "prefill" if slot.prefilling else "generating"
            entry = {"id": slot.seq, "state": state}
            if req is not None:
                entry.update(prompt_tokens=len(req.prompt), generated_tokens=len(req.out))
            out.append(entry)
        return out

    # ---------------------------------------------------------------- the step loop
    def _loop(self) -> None:
        engine = self.engine
        while True:
            self._admit(block=engine.idle)
            if engine.idle:
                if self.queue.closed:
                    return
                continue
            for live in self._live.values():
                if live.job.cancelled.is_set():
                    live.request.cancelled = True
            try:
                record, finished = engine.step()
            except Exception:
                log.exception("engine step failed")
                self._fail_all()
                continue
            if record is not None:
                self._observe(record)
            self._release_text(finished)
            for request in finished:
                self._finish(self._live.pop(id(request)))

    def _admit(self, block: bool) -> None:
        """Move queued jobs into free slots (blocking for the first one only when nothing runs)."""
        while len(self._live) < self.n_slots:
            job = self.queue.take(block=block and not self._live)
            if job is None:
                return
            self.metrics.queue_wait.observe(job.queue_s)
            try:
                self._open(job)
            except APIError as err:
                self._refuse(job, err)
            except HeteroSpecError as err:
                self._refuse(job, APIError(400, str(err)))
            except Exception:
                log.exception("request %s: opening failed", job.request_id)
                self._refuse(job, internal_error())
            block = False

    def _refuse(self, job: Job, err: APIError) -> None:
        self.queue.done(job)
        job.post(Failed(err))

    def _open(self, job: Job) -> None:
        """Tokenize and check the work, tell the handler it started, and put it in the engine."""
        work: Work = job.spec
        if job.cancelled.is_set():
            raise APIError(499, "The client closed the request.", code="client_closed")
        target = self.engine.target
        tokens = prompt_tokens(target, work)
        n_ctx = target.n_ctx
        if len(tokens) >= n_ctx or (work.max_tokens is not None and len(tokens) + work.max_tokens > n_ctx):
            raise APIError(400, f"This model's maximum context length is {n_ctx} tokens. However, you requested "
                                f"{len(tokens) + (work.max_tokens or 0)} tokens ({len(tokens)} in the prompt, "
                                f"{work.max_tokens or 0} for the completion). Please reduce the prompt or the "
                                f"completion length.", param="max_tokens" if work.max_tokens else "messages",
                           code="context_length_exceeded")
        request = Request(tokens, work.max_tokens or n_ctx, sampling=work.sampling, tag=job)
        live = Live(job, request, TextAssembler(target.piece, work.stop), RunStats(prompt_tokens=len(tokens)),
                    time.perf_counter())
        self.engine.submit(request)
        self._live[id(request)] = live
        job.post(Started(len(tokens)))

    def _release_text(self, finished: list[Request]) -> None:
        """New tokens of every live request become text; stop strings end their request."""
        now = time.perf_counter()
        target = self.engine.target
        for live in self._live.values():
            req = live.request
            new = req.out[live.seen:]
            if not new:
                continue
            first = live.seen == 0  # the prefill's token, then one round per step (the bonus counted)
            if first:
                live.stats.prefill_s = now - live.opened_at
            if len(new) > first:
                live.stats.observe(Round(req.drafted - live.drafted, req.accepted - live.accepted, len(new) - first,
                                         0.0, 0.0, 0.0, 0, 0, source="lookup" if req.drafted > live.drafted else "draft"))
            live.drafted, live.accepted = req.drafted, req.accepted
            live.seen = len(req.out)
            live.stats.new_tokens = len(req.out)
            live.stats.wall_s = now - live.opened_at
            piece = live.text.feed([t for t in new if not target.is_eog(t)])
            if piece:
                live.ttft = live.ttft if live.ttft is not None else now - live.job.submitted_at
                self._push(live, piece, now)
            if live.text.stopped and not req.done:
                live.stop_reason = "stop_string"
                req.cancelled = True  # the engine frees the slot at the start of the next step

    def _push(self, live: Live, piece: str, now: float) -> None:
        live.pieces.append(piece)
        live.unsent += 1
        if live.job.spec.stream and now - live.last_post >= STREAM_FLUSH_S:
            live.job.post(Delta("".join(live.pieces[-live.unsent:])))
            live.unsent, live.last_post = 0, now

    def _finish(self, live: Live) -> None:
        req, job = live.request, live.job
        tail = live.text.finish()
        if tail:
            live.pieces.append(tail)
            live.unsent += 1
        if job.spec.stream and live.unsent:
            job.post(Delta("".join(live.pieces[-live.unsent:])))
        stats = live.stats
        stats.stop_reason = live.stop_reason or req.stop_reason or ""
        if live.stop_reason and req.stop_reason == "cancelled":
            req.stop_reason = live.stop_reason
        stats.wall_s = time.perf_counter() - live.opened_at
        ttft = live.ttft if live.ttft is not None else time.perf_counter() - job.submitted_at
        self.metrics.ttft.observe(ttft)
        self.metrics.observe_generation(stats)
        self.queue.done(job)
        self._service_s = 0.8 * self._service_s + 0.2 * (time.perf_counter() - (job.started_at or live.opened_at))
        job.post(Finished("".join(live.pieces), stats.prompt_tokens, len(req.out),
                          FINISH_REASONS.get(stats.stop_reason), stats, job.queue_s, ttft))

    def _observe(self, record: StepRecord) -> None:
        m = self.metrics
        m.step_rows.observe(record.rows)
        m.rows.labels("prompt").inc(record.prompt_rows)
        m.rows.labels("plain").inc(record.plain_rows)
        m.rows.labels("draft").inc(record.draft_rows)
        m.rows.labels("pad").inc(record.pad_rows)
        m.accepted_rows.inc(record.accepted)
        m.reused_prompt.inc(record.reused)
        m.restored_prompt.inc(record.restored)
        if self.engine.prompt_cache is not None:
            m.prompt_cache_bytes.set(self.engine.prompt_cache.bytes)
        m.decode_steps.inc()

    def _fail_all(self) -> None:
        """After an unexpected failure of a step: every live request gets a 500 and every slot starts cold."""
        for live in self._live.values():
            self.queue.done(live.job)
            live.job.post(Failed(internal_error()))
        self._live.clear()
        self.engine.abandon()  # (a new Engine here had dropped the draft model for the server's remaining life)


def prompt_tokens(target, work: Work) -> list[int]:
    """The prompt ids of ``work`` as ``HeteroSpec`` makes them: a chat through the GGUF's template (its
    special tokens parsed, no extra BOS), a text with BOS, token ids as given."""
    if work.kind == "chat":
        messages = work.prompt
        if not messages or not str(messages[-1].get("content", "")).strip():
            raise HeteroSpecError("empty prompt")
        text = render_chat(target.chat_template, messages, bos_token=target.bos_token, eos_token=target.eos_token)
        tokens = target.tokenize(text, add_special=False, parse_special=True)
    elif isinstance(work.prompt, str):
        if not work.prompt.strip():
            raise HeteroSpecError("empty prompt")
        tokens = target.tokenize(work.prompt, add_special=True, parse_special=True)
    else:
        bad = [t for t in work.prompt if not 0 <= t < target.n_vocab]
        if bad:
            raise APIError(400, f"token id {bad[0]} is outside the vocabulary of {target.n_vocab}", param="prompt",
                           code="invalid_value")
        tokens = [int(t) for t in work.prompt]
    if not tokens:
        raise HeteroSpecError("empty prompt")
    return tokens
