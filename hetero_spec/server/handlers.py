"""One generation request's life on the event loop: admit, wait for the model, answer or stream.

Everything that can be refused before the model is touched (queue full, wait too long,
client gone) is decided here, before a 200 is committed; the worker's first event
(``Started`` or ``Failed``) decides the rest, so a streaming request that fails validation
in the worker still gets a proper 4xx instead of a broken stream.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from .config import ServerConfig
from .errors import APIError, shutting_down
from .events import Delta, Failed, Finished, Started
from .queue import Job, QueueClosed, QueueFull, RequestQueue
from .requests import GenerationFields
from .responses import SSE_DONE, Shaper, sse
from .worker import Work, Worker

CLIENT_CLOSED = 499  # nginx's status for "the client closed the request"; only ever logged


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


@dataclass
class Gate:
    """Admission and waiting for the one model: the bounded queue, its timeout, disconnects."""

    queue: RequestQueue
    worker: Worker
    config: ServerConfig

    async def respond(self, request: Request, body: GenerationFields, work: Work, shaper: Shaper) -> Response:
        if body.model is not None and body.model != self.config.model_id:
            raise APIError(404, f"The model '{body.model}' does not exist; this server serves "
                                f"'{self.config.model_id}'.", param="model", code="model_not_found")
        job = self._submit(request, work)
        try:
            first = await self._wait_started(request, job)
            if isinstance(first, Failed):
                raise first.error
            if work.stream:
                return StreamingResponse(self._stream(request, job, shaper, body.include_usage),
                                         media_type="text/event-stream",
                                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
            fin = await self._finished(request, job)
        except ClientGone:
            request.state.log_status = CLIENT_CLOSED
            return Response(status_code=CLIENT_CLOSED)
        return JSONResponse(shaper.full(fin))

    def _submit(self, request: Request, work: Work) -> Job:
        job = Job(request.state.request_id, work, asyncio.get_running_loop())
        try:
            self.queue.submit(job)
        except QueueFull:
            raise APIError(429, f"The server is busy: {self.queue.max_waiting} requests are already waiting for "
                                f"the model. Retry after the time in the Retry-After header.",
                           type="requests", code="rate_limit_exceeded",
                           headers={"Retry-After": str(self.worker.retry_after())}) from None
        except QueueClosed:
            raise shutting_down() from None
        request.state.job = job  # the access middleware cancels it when the response ends, however it ends
        return job

    async def _wait_started(self, request: Request, job: Job) -> Started | Failed:
        """The worker's first event; a 503 if the job is still queued after ``queue_timeout``."""
        deadline = job.submitted_at + self.config.queue_timeout
        async with _DisconnectWatch(request) as gone:
            while True:
                timeout = None if job.started_at is not None else max(0.0, deadline - time.perf_counter())
                event = await _first(job.events.get(), gone, timeout)
                if event is not None:
                    return event
                if self.queue.withdraw(job):
                    raise APIError(503, f"The request waited longer than {self.config.queue_timeout:g} s for the "
                                        f"model.", type="server_error", code="queue_timeout",
                                   headers={"Retry-After": str(self.worker.retry_after())})
                # the worker took it just now: wait for its first event without a deadline

    async def _finished(self, request: Request, job: Job) -> Finished:
        async with _DisconnectWatch(request) as gone:
            await _first(job.ended.wait(), gone, None)
        if isinstance(job.result, Failed):
            raise job.result.error
        return job.result

    async def _stream(self, request: Request, job: Job, shaper: Shaper, include_usage: bool) -> AsyncIterator[str]:
        """SSE chunks until ``[DONE]``.  If the client leaves, Starlette cancels this generator and
        the middleware cancels the job: the generation stops at the end of its round."""
        request.state.log_status = CLIENT_CLOSED  # until the last chunk is out
        if shaper.kind == "chat":
            yield sse(shaper.chunk("", first=True, include_usage=include_usage))
        while True:
            event = await job.events.get()
            if isinstance(event, Delta):
                yield sse(shaper.chunk(event.text, include_usage=include_usage))
            elif isinstance(event, Finished):
                yield sse(shaper.chunk(None, fin=event, include_usage=include_usage))
                if include_usage:
                    yield sse(shaper.usage_chunk(event))
                yield SSE_DONE
                request.state.log_status = 200
                return
            elif isinstance(event, Failed):  # after the 200 was committed: an error event, as llama.cpp sends
                yield sse(event.error.body())
                yield SSE_DONE
                request.state.log_status = event.error.status
                return


async def _first(awaitable, gone: asyncio.Future, timeout: float | None):
    """The awaitable's result; None on timeout; ClientGone if the client disconnects first."""
    task = asyncio.ensure_future(awaitable)
    done, _ = await asyncio.wait({task, gone}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    if task in done:
        return task.result()
    task.cancel()  # asyncio.Queue.get is cancel-safe: an event not yet taken stays queued
    if gone in done:
        raise ClientGone()
    return None


class _DisconnectWatch:
    """A task that completes when the client disconnects (the body has been read, so the next ASGI
    message is ``http.disconnect``); it must end before a StreamingResponse starts listening itself."""

    def __init__(self, request: Request) -> None:
        self._request = request
        self._task: asyncio.Task | None = None

    async def _watch(self) -> None:
        while (await self._request.receive())["type"] != "http.disconnect":
            pass

    async def __aenter__(self) -> asyncio.Task:
        self._task = asyncio.ensure_future(self._watch())
        return self._task

    async def __aexit__(self, *exc) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()
