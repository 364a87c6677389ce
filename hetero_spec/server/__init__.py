"""An OpenAI-compatible HTTP server (``hetero-spec serve``): one ``HeteroSpec``, or N slots of the batched engine.

Needs the ``[server]`` extra (FastAPI, uvicorn, pydantic, prometheus-client); importing this
package does not import them, so the CLI starts without the extra installed.

    app.py        routes and wiring          handlers.py  admission, waiting, streaming
    worker.py     the thread that decodes    queue.py     bounded FIFO with withdrawal
    requests.py   request models             responses.py response and chunk shapes
    middleware.py id, body limit, 500, log   auth.py      bearer key
    metrics.py    Prometheus registry        launch.py    uvicorn entry point
    slot_worker.py  --parallel: the thread that drives the batched engine (hetero_spec/engine)
"""
from __future__ import annotations

from .config import EngineConfig, ServerConfig


def serve(engine: EngineConfig, server: ServerConfig) -> None:
    """Load the model, then serve until interrupted (imports the web stack only now)."""
    try:
        from .launch import serve as _serve
    except ImportError as exc:  # the extra is missing: one clear line from the CLI
        from ..errors import HeteroSpecError

        raise HeteroSpecError(f"the server needs its extra: pip install 'hetero-spec[server]' ({exc})") from None
    _serve(engine, server)


__all__ = ["EngineConfig", "ServerConfig", "serve"]
