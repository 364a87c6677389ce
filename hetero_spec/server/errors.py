"""OpenAI-style error bodies, and the handlers that turn every failure into one.

Clients (the ``openai`` package, editors, agents) parse ``{"error": {message, type, param,
code}}`` and branch on the status; a traceback in a body helps nobody and leaks paths.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

INVALID = "invalid_request_error"
SERVER = "server_error"
GENERIC_500 = "The server had an error while processing your request."


@dataclass(eq=False)  # exceptions stay hashable: tracebacks and task groups keep them in sets
class APIError(Exception):
    """An error with its HTTP status; raised anywhere in the server, rendered by ``error_response``."""

    status: int
    message: str
    type: str = INVALID
    param: str | None = None
    code: str | None = None
    headers: dict[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        return f"{self.status} {self.message}"

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def internal_error() -> APIError:
    """The only body an unexpected failure gets; the details go to the log."""
    return APIError(500, GENERIC_500, type=SERVER, code="internal_error")


def shutting_down() -> APIError:
    """A request the server stops before answering: queued, running, or cut when the graceful wait ran out."""
    return APIError(503, "The server is shutting down.", type=SERVER, code="shutting_down")


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers or None)


_HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}


def validation_error(errors: list) -> APIError:
    """Pydantic's first complaint as one sentence; ``param`` is the field path (``messages.0.role``)."""
    first = (list(errors) or [{}])[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    kind = first.get("type", "")
    if kind == "json_invalid":
        return APIError(400, "We could not parse the JSON body of your request.", code="invalid_json")
    where = ".".join(loc)
    if kind == "missing":
        return APIError(400, f"Missing required parameter: '{where}'.", param=where or None,
                        code="missing_required_parameter")
    if kind in ("model_type", "model_attributes_type") and not where:
        return APIError(400, "The request body must be a JSON object.", code="invalid_type")
    msg = first.get("msg", "invalid value")
    return APIError(400, f"Invalid value for '{where}': {msg}." if where else f"{msg}.", param=where or None,
                    code="invalid_value")


def install_error_handlers(app: FastAPI) -> None:
    """APIError, validation (400) and routing errors (404/405) as OpenAI bodies.  Anything else is
    caught by the access middleware, which logs it and sends a generic 500."""

    @app.exception_handler(APIError)
    async def _api(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(validation_error(exc.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            message = f"Unknown endpoint {request.method} {request.url.path}."
        elif exc.status_code == 405:
            message = f"Method {request.method} is not allowed on {request.url.path}."
        else:
            message = str(exc.detail)
        kind = INVALID if exc.status_code < 500 else SERVER
        return error_response(APIError(exc.status_code, message, type=kind, code=_HTTP_CODES.get(exc.status_code),
                                       headers=dict(exc.headers or {})))
