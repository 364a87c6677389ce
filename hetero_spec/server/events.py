"""What the worker thread tells a waiting handler: started, text, and one terminal event."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..records import RunStats
from .errors import APIError


@dataclass(frozen=True)
class Started:
    """The model took the request and tokenized the prompt; the response can commit to a 200."""

    prompt_tokens: int
    terminal: ClassVar[bool] = False


@dataclass(frozen=True)
class Delta:
    """Text released by one round (only for streaming requests)."""

    text: str
    terminal: ClassVar[bool] = False


@dataclass(frozen=True)
class Finished:
    text: str
    prompt_tokens: int
    completion_tokens: int  # every generated id, a final end-of-generation token included
    finish_reason: str | None  # None when the client cancelled
    stats: RunStats
    queue_s: float
    ttft_s: float  # arrival to the first text (to the end, when there was no text)
    terminal: ClassVar[bool] = True


@dataclass(frozen=True)
class Failed:
    error: APIError
    terminal: ClassVar[bool] = True


Event = Started | Delta | Finished | Failed
