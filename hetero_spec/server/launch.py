"""``hetero-spec serve``: load the model once, then run the app under uvicorn until Ctrl-C / SIGTERM."""
from __future__ import annotations

import asyncio
import logging
import socket
import sys
import threading

import uvicorn

from ..errors import HeteroSpecError
from .app import create_app
from .config import EngineConfig, ServerConfig

log = logging.getLogger("hetero_spec.server")
LOG_FORMAT = "%(asctime)s %(levelname)s %(message)s"
CUT_WAIT_S = 1.0  # after a second Ctrl-C, how long cut requests get to end (a decode round, and their log line)


class ListeningServer(uvicorn.Server):
    """uvicorn's server, plus the bound port (``--port 0`` picks a free one) and an event once it
    accepts connections: what a test or an embedding program waits on instead of sleeping."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.ready = threading.Event()
        self.port: int | None = None

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        servers = getattr(self, "servers", [])
        if self.started and servers:
            self.port = servers[0].sockets[0].getsockname()[1]
            host = self.config.host if ":" not in self.config.host else f"[{self.config.host}]"
            log.info("listening on http://%s:%d", host, self.port)
            self.ready.set()

    def run(self, sockets=None) -> None:
        uvicorn_log = logging.getLogger("uvicorn.error")
        uvicorn_log.addFilter(self._quiet_when_stopping)
        try:
            super().run(sockets)  # the loop's last tasks are cancelled, and logged, inside this call
        finally:
            uvicorn_log.removeFilter(self._quiet_when_stopping)

    def handle_exit(self, sig: int, frame) -> None:
        """A second Ctrl-C stops at once, as uvicorn's force exit, but first closes the connections in flight
        and gives their handlers up to ``CUT_WAIT_S`` to end: each sees its client leave, cancels its
        generation and logs its line, and the model is freed in order. Abandoned instead, they would be
        cancelled as the loop closes (tracebacks), and on Python 3.12+ uvicorn's last wait (``wait_closed``)
        would wait for them. The work runs on the event loop, not inside the signal handler."""
        forced = self.force_exit
        super().handle_exit(sig, frame)
        if self.force_exit and not forced:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:  # no loop runs: nothing is being served
                return
            self.force_exit = False  # set again by _cut_connections, once the handlers have had their moment
            loop.call_soon_threadsafe(lambda: setattr(self, "_cutting", loop.create_task(self._cut_connections())))

    async def _cut_connections(self) -> None:
        connections = list(self.server_state.connections)
        log.info("stopping now: %d connection(s) cut", len(connections))
        for conn in connections:
            transport = getattr(conn, "transport", None)
            if transport is not None:
                transport.close()
        if self.server_state.tasks:
            await asyncio.wait(list(self.server_state.tasks), timeout=CUT_WAIT_S)
        self.force_exit = True

    def _quiet_when_stopping(self, record: logging.LogRecord) -> bool:
        """While shutting down, drop the tracebacks of the cancellations it causes: a request cut by a second
        Ctrl-C or by the graceful wait's timeout (uvicorn logs it with ``exc_info``), and the lifespan task
        (starlette hands its traceback over as text)."""
        if not self.should_exit:
            return True
        exc = record.exc_info[1] if record.exc_info else None
        return not (isinstance(exc, asyncio.CancelledError) or record.getMessage().rstrip().endswith("CancelledError"))


def configure_logging(level: int = logging.INFO) -> None:
    """The request log (one line per request) on stderr, beside uvicorn's own start/stop lines."""
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(LOG_FORMAT))
        log.addHandler(handler)
    log.setLevel(level)
    log.propagate = False


def bind(server: ServerConfig) -> socket.socket:
    """The server's address, taken before the model loads: a wrong ``--host`` or a port in use is one line
    at once, not after the load.  Bound, not listening: a client that connects while the model loads is
    refused, as before, instead of waiting in the backlog (uvicorn listens once it serves)."""
    family = socket.AF_INET6 if ":" in server.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a restart need not wait out TIME_WAIT
    try:
        sock.bind((server.host, server.port))
    except (OSError, OverflowError) as exc:
        sock.close()
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise HeteroSpecError(f"cannot listen on {server.host}:{server.port}: {why}") from None
    return sock


def uvicorn_config(app, server: ServerConfig) -> uvicorn.Config:
    # access_log off: the app writes its own line per request, with tokens and the real outcome
    return uvicorn.Config(app, host=server.host, port=server.port, log_level="info", access_log=False,
                          timeout_graceful_shutdown=5, lifespan="on")


def loader(engine: EngineConfig):
    """The callable the worker thread runs to build the model: target, draft and, for ``auto``, the cost
    curve (measured or loaded now, not inside the first request), all on that thread."""

    def load():
        from ..api import HeteroSpec

        hs = HeteroSpec(engine.model, engine.draft, n_ctx=engine.n_ctx, threads=engine.threads,
                        draft_device=engine.draft_device, draft_dtype=engine.draft_dtype, denoise=engine.denoise,
                        kv_type=engine.kv_type)
        try:
            if engine.draft_len == "auto":  # the cost curve prices the suffix structure's rows too
                hs.cost_curve()
        except BaseException:
            hs.close()
            raise
        return hs

    return load


def slot_loader(engine: EngineConfig):
    """The callable the slot worker runs to build its multi-sequence context (``--parallel`` sequences of
    ``--ctx`` cells each) and, with a draft file, the slots' drafts, on that thread."""

    def load():
        from ..engine.drafts import open_slots
        from ..target.invariance import exact_micro_batch
        from ..target.llama_target import BATCH_INVARIANT_ROWS
        from ..target.sequences import SequenceOptions
        from .slot_worker import SlotModel

        rows = exact_micro_batch(engine.model, threads=engine.threads, kv_type=engine.kv_type)
        if rows < BATCH_INVARIANT_ROWS:
            log.warning("%s is bit-exact only up to %d rows a decode on this machine: micro-batches of %d "
                        "(docs/exactness.md)", engine.model.name, rows, rows)
        draft = engine.draft if engine.draft_len != 0 else None
        target, drafts = open_slots(engine.model, draft, SequenceOptions(
            n_seq=engine.parallel, seq_ctx=engine.n_ctx, n_threads=engine.threads, kv_type=engine.kv_type,
            max_rows=min(rows, BATCH_INVARIANT_ROWS)), device=engine.draft_device, dtype=engine.draft_dtype,
            denoise=engine.denoise)
        from ..engine.prompt_cache import PromptCache

        return SlotModel(target, drafts, PromptCache(engine.cache_ram_mib << 20) if engine.cache_ram_mib else None)

    return load


def serve(engine: EngineConfig, server: ServerConfig) -> None:
    """Load ``engine``'s model and draft on the worker thread, then serve until interrupted.

    An address that cannot be bound, and then a load failure (``LoadFailed``), raise a ``HeteroSpecError``
    (one line, non-zero exit); the address is bound first, so its error comes before the load's seconds."""
    configure_logging()
    if not server.loopback_only:
        log.warning("binding to %s: other machines can reach this server%s", server.host,
                    "" if server.api_key else " and no --api-key is set")
    if engine.parallel > 1:
        app = create_app(slot_loader(engine), server, engine.generate_options(), slots=engine.parallel)
    else:
        app = create_app(loader(engine), server, engine.generate_options())
    worker = app.state.worker
    sock = bind(server)  # before the worker starts loading
    worker.start()
    try:
        worker.wait_ready()
        ListeningServer(uvicorn_config(app, server)).run(sockets=[sock])
    except KeyboardInterrupt:  # uvicorn re-raises Ctrl-C after its graceful shutdown: that is the normal stop
        log.info("stopped")
    finally:
        sock.close()
        worker.stop()  # closes the model on its own thread (a no-op after the lifespan stopped it)
