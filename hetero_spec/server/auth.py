"""``--api-key``: every endpoint but ``/health`` wants ``Authorization: Bearer <key>``."""
from __future__ import annotations

import hmac
from typing import Awaitable, Callable

from fastapi import Request

from .errors import APIError


def bearer_check(api_key: str | None) -> Callable[[Request], Awaitable[None]]:
    """A FastAPI dependency; without a key it lets everyone in (the default binds to loopback only)."""
    expected = api_key.encode() if api_key else None

    async def check(request: Request) -> None:
        if expected is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        # compare_digest: the time taken does not tell how much of a guessed key was right
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), expected):
            message = ("Incorrect API key provided." if token.strip() else
                       "You didn't provide an API key: send it as 'Authorization: Bearer <key>'.")
            raise APIError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    return check
