"""The one thread that owns the model: loads it, takes jobs in FIFO order, runs each through HeteroSpec, closes it.

Generation runs here, off the event loop, so the loop keeps accepting, queueing and
rejecting requests while a sequence decodes.  The model is also *built* here, never on
the thread that starts the server: llama.cpp's CPU backend runs its matmuls in an OpenMP
parallel region, and libgomp keeps one thread team per calling thread.  A context first
decoded from one thread (a calibration, a draft's int8 check) and then from another left
two teams of busy-waiting workers on the same cores: with 2 threads on a 2-core machine the
server decoded at a third of ``hetero-spec run``'s speed (docs/server.md).  Every token goes through ``HeteroSpec.chat``
or ``HeteroSpec.generate``; the conversation cache inside HeteroSpec is what lets a
conversation's next turn reuse its prefix.  The job's ``cancelled`` flag is handed to the
API, which checks it after every round.
"""
from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Literal, Union

from ..chat_template import TemplateRenderError, render_chat
from ..config import SamplingConfig
from ..errors import ContextFull, HeteroSpecError
from .errors import APIError, internal_error, shutting_down
from .events import Delta, Failed, Finished, Started
from .metrics import Metrics
from .queue import Job, RequestQueue

log = logging.getLogger("hetero_spec.server")

FINISH_REASONS = {"eog": "stop", "stop_string": "stop", "max_tokens": "length", "context_full": "length"}
# A stream gets its first text at once, then at most one chunk per this many seconds.  Each chunk
# wakes the event loop, which then holds the GIL while the worker prepares its next round:
# one chunk per round made streamed decoding 12% slower than non-streamed (2 cores, 1 llama.cpp
# thread, SmolLM2 at ~100 tok/s); 50 ms is below what a reader notices.
STREAM_FLUSH_S = 0.05


@dataclass(frozen=True)
class Work:
    """What a handler asks of the model: a conversation (chat) or a prompt (text or token ids)."""

    kind: Literal["chat", "text"]
    prompt: Union[list[dict[str, str]], str, list[int]]
    max_tokens: int | None  # None: up to the end of the context
    stop: tuple[str, ...]
    sampling: SamplingConfig
    stream: bool


def warn_if_no_chat_fits(target: Any) -> None:
    """Log a warning when ``--ctx`` is shorter than the chat template around a one-word message.

    WHY: such a server starts and answers ``/health``, and then every chat request fails its context check
    with a 400; the one place a user looks for the reason is the start-up log.
    """
    try:
        text = render_chat(target.chat_template, [{"role": "user", "content": "Hi"}],
                           bos_token=target.bos_token, eos_token=target.eos_token)
    except TemplateRenderError:  # no template: chat requests get their own clear error
        return
    needed = len(target.tokenize(text, add_special=False, parse_special=True)) + 1  # and one token of answer
    if needed > target.n_ctx:
        log.warning("--ctx %d is too short for any chat: the chat template around a one-word message takes %d "
                    "tokens, so every chat request will be refused (text completions still fit)",
                    target.n_ctx, needed - 1)


class LoadFailed(HeteroSpecError):
    """The model could not be built on the worker thread; the message is the cause, in one line."""


class ModelThread:
    """A daemon thread that builds a model with ``load``, serves the queue with it, and closes it: every
    llama.cpp call of that model on this one thread (the module docstring says why).  ``wait_ready``
    blocks until ``load`` returned and re-raises its failure as ``LoadFailed``.  Subclasses keep the
    loaded model in ``_opened`` and decode in ``_loop`` until the queue closes."""

    def __init__(self, load: Callable[[], Any], queue: RequestQueue, metrics: Metrics) -> None:
        self._load = load
        self.queue = queue
        self.metrics = metrics
        self._service_s = 1.0  # running mean of a request's time on the model, for Retry-After
        self._ready = threading.Event()
        self._load_error: BaseException | None = None
        self._thread = threading.Thread(target=self._life, name="hetero-spec-worker", daemon=True)

    def start(self) -> None:
        """Start loading (idempotent: the launcher starts it before uvicorn, the app's lifespan again)."""
        if not self._thread.is_alive() and not self._ready.is_set():
            self._thread.start()

    def wait_ready(self, timeout: float | None = None) -> None:
        """Block until the model is loaded; ``LoadFailed`` if loading failed or took longer than ``timeout``."""
        if not self._ready.wait(timeout):
            raise LoadFailed(f"the model did not load within {timeout:g} s")
        if self._load_error is not None:
            err = self._load_error
            detail = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise LoadFailed(detail if isinstance(err, HeteroSpecError) else f"loading the model failed: {detail}")

    def stop(self, timeout: float = 10.0) -> None:
        for job in self.queue.close():
            job.post(Failed(shutting_down()))
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _life(self) -> None:
        """Load, serve until the queue closes, close."""
        try:
            model = self._load()
        except BaseException as exc:  # reported by wait_ready, on the thread that waits
            self._load_error = exc
            log.debug("loading the model failed", exc_info=True)
            self._ready.set()
            return
        try:
            self._opened(model)
        except BaseException as exc:  # as a load failure: reported by wait_ready, the model closed
            self._load_error = exc
            log.debug("starting the model failed", exc_info=True)
            close = getattr(model, "close", None)
            if close is not None:
                close()
            self._ready.set()
            return
        self._ready.set()
        try:
            self._loop()
        finally:
            close = getattr(model, "close", None)
            if close is not None:
                close()

    def _opened(self, model: Any) -> None:
        raise NotImplementedError

    def _loop(self) -> None:
        raise NotImplementedError


class Worker(ModelThread):
    """Decodes queued jobs one at a time through ``HeteroSpec``; ``stop`` ends it after the current round."""

    def __init__(self, load: Callable[[], Any], queue: RequestQueue, metrics: Metrics, options: dict) -> None:
        super().__init__(load, queue, metrics)
        self.hs: Any = None  # the HeteroSpec, once loaded; used only from the worker thread
        self.options = options  # drafting options from the server config (EngineConfig.generate_options)

    def _opened(self, model: Any) -> None:
        self.hs = model
        warn_if_no_chat_fits(model.target)

    def retry_after(self) -> int:
        """Seconds until what waits now has likely been served (whole seconds, as Retry-After wants),
        so rejected clients come back when there is room instead of all at once."""
        return min(60, max(1, math.ceil(self._service_s * (self.queue.depth + 1))))

    def _loop(self) -> None:
        while (job := self.queue.take()) is not None:
            t0 = time.perf_counter()
            try:
                end = self._serve(job)
            except Exception:  # a bug outside the generation must not end the only decoding thread
                log.exception("request %s: worker error", job.request_id)
                end = Failed(internal_error())
            # the slot is free before anyone hears the request ended (a client may then ask /metrics)
            self.queue.done(job)
            self._service_s = 0.8 * self._service_s + 0.2 * (time.perf_counter() - t0)
            job.post(end)

    def _serve(self, job: Job) -> Finished | Failed:
        """The job's terminal event; expected failures become their 4xx, anything else a generic 500."""
        self.metrics.queue_wait.observe(job.queue_s)
        if job.cancelled.is_set():  # the client left while it waited
            return Failed(APIError(499, "The client closed the request.", code="client_closed"))
        try:
            return self._generate(job)
        except APIError as err:
            return Failed(err)
        except ContextFull as err:
            return Failed(APIError(400, str(err), param="messages", code="context_length_exceeded"))
        except HeteroSpecError as err:  # ConfigError included
            return Failed(APIError(400, str(err)))
        except Exception:
            log.exception("request %s: generation failed", job.request_id)
            self._recover()
            return Failed(internal_error())

    def _generate(self, job: Job) -> Finished:
        work: Work = job.spec
        stream = self._open(work, job.cancelled.is_set)
        job.post(Started(stream.stats.prompt_tokens))
        pieces: list[str] = []
        unsent = 0  # pieces[-unsent:] are not streamed yet
        ttft = None
        last_post = 0.0
        for piece in stream:
            now = time.perf_counter()
            if ttft is None:
                ttft = now - job.submitted_at
            pieces.append(piece)
            unsent += 1
            if work.stream and now - last_post >= STREAM_FLUSH_S:
                job.post(Delta("".join(pieces[-unsent:])))
                unsent, last_post = 0, now
        if work.stream and unsent:
            job.post(Delta("".join(pieces[-unsent:])))
        stats = stream.stats
        ttft = ttft if ttft is not None else time.perf_counter() - job.submitted_at
        self.metrics.ttft.observe(ttft)
        self.metrics.observe_generation(stats)
        return Finished("".join(pieces), stats.prompt_tokens, len(stream.tokens),
                        FINISH_REASONS.get(stats.stop_reason), stats, job.queue_s, ttft)

    def _open(self, work: Work, cancel):
        """The API's stream for this work, after the checks that need the tokenized prompt."""
        n_ctx = self.hs.target.n_ctx
        options = dict(self.options, max_new_tokens=work.max_tokens or n_ctx, stop=work.stop,
                       sampling=work.sampling, cancel=cancel, stream=True)
        if work.kind == "chat":
            stream = self.hs.chat(work.prompt, **options)
        else:
            if isinstance(work.prompt, list):
                bad = [t for t in work.prompt if not 0 <= t < self.hs.target.n_vocab]
                if bad:
                    raise APIError(400, f"token id {bad[0]} is outside the vocabulary of "
                                        f"{self.hs.target.n_vocab}", param="prompt", code="invalid_value")
            stream = self.hs.generate(work.prompt, **options)
        n_prompt = stream.stats.prompt_tokens
        if work.max_tokens is not None and n_prompt + work.max_tokens > n_ctx:
            stream.close()
            raise APIError(400, f"This model's maximum context length is {n_ctx} tokens. However, you requested "
                                f"{n_prompt + work.max_tokens} tokens ({n_prompt} in the prompt, {work.max_tokens} "
                                f"for the completion). Please reduce the prompt or the completion length.",
                           param="max_tokens", code="context_length_exceeded")
        return stream

    def _recover(self) -> None:
        """After an unexpected failure the caches may not describe any text: start the next request cold."""
        try:
            self.hs.reset()
        except Exception:
            log.exception("resetting the model after a failure failed too")
