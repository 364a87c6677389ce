"""The FastAPI application: routes, and the wiring of queue, worker, metrics, auth and middleware.

``create_app`` takes a callable that builds the ``HeteroSpec``; the app's worker thread calls it,
so that the model is loaded, used and closed on that one thread (``worker.py`` says why).  The
lifespan starts the worker and waits until the model is ready; ``launch.serve`` starts it earlier,
so that a model that cannot load is one line on stderr before anything listens.
"""
from __future__ import annotations

import asyncio
import secrets
from contextlib import asynccontextmanager
from typing import Any, Callable, TypeVar

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError

from .auth import bearer_check
from .config import ServerConfig
from .errors import install_error_handlers, validation_error
from .handlers import Gate
from .metrics import Metrics
from .middleware import AccessMiddleware
from .queue import RequestQueue
from .requests import ChatRequest, CompletionRequest
from .responses import Shaper
from .worker import Work, Worker

M = TypeVar("M", bound=BaseModel)


async def parse_body(request: Request, model: type[M]) -> M:
    """JSON whatever the Content-Type says (curl -d sends form-urlencoded), validated strictly."""
    raw = await request.body()
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        raise validation_error(exc.errors()) from None


def create_app(load: Callable[[], Any], server: ServerConfig, options: dict | None = None,
               slots: int = 1) -> FastAPI:
    """The OpenAI-compatible app around the ``HeteroSpec`` that ``load()`` builds on the worker thread
    (``app.state.worker.hs`` once ready); ``options`` are its drafting options
    (``EngineConfig.generate_options()``: draft_len, tree, draft_p_min, lookup, suffix).

    ``slots`` > 1: ``load()`` builds a ``SlotModel`` (a ``SequenceTarget`` of that many sequences, and the
    slots' drafts with a draft file) instead, and requests decode together in the batched engine
    (``slot_worker.py``; plain rows, copy drafts unless ``options["lookup"]`` is False, the draft model's
    chains up to ``options["draft_len"]`` deep, none of either when it is 0, as ``--no-draft`` makes it)."""
    queue = RequestQueue(server.max_queue, slots)
    metrics = Metrics(queue_depth=lambda: queue.depth, busy=lambda: queue.busy, slots=slots)
    if slots > 1:
        from ..engine import Drafting
        from .slot_worker import DRAFT_DEPTH, LOOKUP_DEPTH, SlotWorker

        opts = options or {}
        draft_len = opts.get("draft_len", "auto")
        lookup = opts.get("lookup", True) and draft_len != 0  # --no-draft: plain rows only
        depth = DRAFT_DEPTH if draft_len == "auto" else int(draft_len)  # a draft model's chain, at most (priced)
        worker = SlotWorker(load, queue, metrics, slots, Drafting(lookup_depth=LOOKUP_DEPTH if lookup else 0,
                                                                  draft_depth=depth))
    else:
        worker = Worker(load, queue, metrics, options or {})
    gate = Gate(queue, worker, server)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        worker.start()
        await asyncio.to_thread(worker.wait_ready)
        try:
            yield
        finally:
            await asyncio.to_thread(worker.stop)  # the loop keeps delivering while the last round ends

    app = FastAPI(title="hetero-spec", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.worker = worker
    install_error_handlers(app)
    app.add_middleware(AccessMiddleware, metrics=metrics, queue=queue, max_body_bytes=server.max_body_bytes)
    auth = [Depends(bearer_check(server.api_key))]

    @app.get("/health")
    async def health() -> JSONResponse:
        """Liveness without a key: 503 once the decoding thread is gone (nothing would be served)."""
        ok = worker.alive
        body = {"status": "ok" if ok else "error", "model": server.model_id, "queue_depth": queue.depth,
                "busy": queue.busy > 0}
        if slots > 1:
            body["slots"] = worker.slots()
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/v1/models", dependencies=auth)
    async def models() -> dict:
        return {"object": "list", "data": [{"id": server.model_id, "object": "model", "created": 0,
                                            "owned_by": "hetero-spec"}]}

    @app.get("/metrics", dependencies=auth)
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=metrics.content_type)

    @app.post("/v1/chat/completions", dependencies=auth)
    async def chat_completions(request: Request) -> Response:
        body = await parse_body(request, ChatRequest)
        work = Work("chat", [m.as_template_message() for m in body.messages], body.token_limit,
                    body.stop_strings(), body.sampling(secrets.randbits(32)), body.stream)
        shaper = Shaper("chat", f"chatcmpl-{request.state.request_id}", server.model_id)
        return await gate.respond(request, body, work, shaper)

    @app.post("/v1/completions", dependencies=auth)
    async def completions(request: Request) -> Response:
        body = await parse_body(request, CompletionRequest)
        work = Work("text", body.prompt, body.token_limit, body.stop_strings(), body.sampling(secrets.randbits(32)),
                    body.stream)
        shaper = Shaper("text", f"cmpl-{request.state.request_id}", server.model_id)
        return await gate.respond(request, body, work, shaper)

    return app

