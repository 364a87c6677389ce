"""The ASGI layer around every request: id, body limit, last-resort 500, metrics and the log line.

A pure ASGI middleware rather than ``@app.middleware("http")``: it sees a streamed response
to its real end (or to the client leaving), so it can write the single log line with the
final outcome and tokens, and make sure a departed client's generation has stopped.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .errors import APIError, error_response, internal_error, shutting_down
from .events import Finished
from .metrics import Metrics
from .queue import RequestQueue

log = logging.getLogger("hetero_spec.server")

ENDPOINTS = {"/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics"}
SETTLE_S = 30.0  # at most this long for a cancelled generation to reach the end of its round


def new_request_id() -> str:
    return uuid.uuid4().hex[:24]


class AccessMiddleware:
    """Per request: ``scope["state"]["request_id"]`` and an ``x-request-id`` header; a 413 for bodies
    over the limit; a generic 500 (details logged) for anything unhandled; then metrics by status
    and one log line: id, method and path, status, prompt+completion tokens and why the generation
    stopped (eog, stop_string, max_tokens, context_full, cancelled), seconds.

    Handlers may set ``state["job"]`` (cancelled here when the response ends, however it ends)
    and ``state["log_status"]`` (the outcome when it differs from the HTTP status, e.g. 499 for a
    stream whose client left)."""

    def __init__(self, app: ASGIApp, *, metrics: Metrics, queue: RequestQueue, max_body_bytes: int) -> None:
        self.app = app
        self.metrics = metrics
        self.queue = queue
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        state = scope.setdefault("state", {})
        rid = state["request_id"] = new_request_id()
        sent: dict[str, int] = {}

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                sent["status"] = message["status"]
                message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", rid.encode())]}
            await send(message)

        try:
            try:
                if self._declared_too_large(scope):
                    await error_response(self._too_large())(scope, receive, send_with_id)
                else:
                    await self.app(scope, self._limited(receive), send_with_id)
            except Exception:
                log.exception("request %s: unhandled error", rid)
                if "status" not in sent:
                    await error_response(internal_error())(scope, receive, send_with_id)
                else:
                    state["log_status"] = 500
            finally:
                await self._settle(state.get("job"))
        except asyncio.CancelledError:  # the server stopped with the request running (its graceful wait ran out)
            state["log_status"] = 503  # whatever the handler had set: the server, not the client, ended it
            self._record(scope, state, 503, time.perf_counter() - t0)
            if "status" not in sent:  # an answer in the API's shape, not uvicorn's plain-text 500
                with contextlib.suppress(Exception):
                    await error_response(shutting_down())(scope, receive, send_with_id)
            raise
        self._record(scope, state, sent.get("status", 500), time.perf_counter() - t0)

    def _too_large(self) -> APIError:
        return APIError(413, f"The request body is larger than the limit of {self.max_body_bytes} bytes.",
                        code="request_too_large")

    def _declared_too_large(self, scope: Scope) -> bool:
        length = Headers(scope=scope).get("content-length", "")
        return length.isdigit() and int(length) > self.max_body_bytes

    def _limited(self, receive: Receive) -> Receive:
        """A chunked body has no declared length: count as it arrives."""
        total = 0

        async def receive_limited() -> Message:
            nonlocal total
            message = await receive()
            if message["type"] == "http.request":
                total += len(message.get("body", b""))
                if total > self.max_body_bytes:
                    raise self._too_large()
            return message

        return receive_limited

    async def _settle(self, job) -> None:
        """The response has ended: a job still queued is withdrawn, a running one is cancelled and
        awaited to the end of its round, so the slot is free and its tokens are known for the log."""
        if job is None:
            return
        job.cancel()
        if self.queue.withdraw(job) or job.started_at is None or job.ended.is_set():
            return  # nothing to wait for (and no yield to the loop before the request is counted)
        try:
            await asyncio.wait_for(job.ended.wait(), SETTLE_S)
        except asyncio.TimeoutError:
            log.warning("request %s: generation did not stop within %.0f s of cancelling", job.request_id, SETTLE_S)

    def _record(self, scope: Scope, state: dict, http_status: int, seconds: float) -> None:
        status = state.get("log_status", http_status)
        path = scope.get("path", "")
        self.metrics.requests.labels(path if path in ENDPOINTS else "other", str(status)).inc()
        job = state.get("job")
        fin = job.result if job is not None and isinstance(job.result, Finished) else None
        tokens = f"{fin.prompt_tokens}+{fin.completion_tokens} stop={fin.stats.stop_reason}" if fin else "-"
        log.info("%s %s %s %s tokens=%s %.3fs", state["request_id"], scope.get("method", ""), path, status, tokens,
                 seconds)
