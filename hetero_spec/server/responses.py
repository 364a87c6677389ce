"""OpenAI response and stream-chunk shapes for chat and text completions, plus server-sent events.

The extra ``hetero_spec`` object carries the speculative-decoding statistics of the request;
OpenAI clients ignore fields they do not know.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Literal

from .events import Finished

SSE_DONE = "data: [DONE]\n\n"


def sse(payload: dict) -> str:
    """One server-sent event; compact JSON keeps the per-round overhead small."""
    return f"data: {json.dumps(payload, separators=(',', ':'), ensure_ascii=False)}\n\n"


def usage(fin: Finished) -> dict:
    return {"prompt_tokens": fin.prompt_tokens, "completion_tokens": fin.completion_tokens,
            "total_tokens": fin.prompt_tokens + fin.completion_tokens}


def hetero_spec_stats(fin: Finished) -> dict:
    """Rounds, acceptance and timings of one request (mean accepted length counts the bonus token)."""
    s = fin.stats
    return {
        "rounds": len(s.rounds),
        "mean_accepted_length": s.mean_accepted_length,
        "drafted_tokens": int(s.total("drafted")),
        "accepted_tokens": int(s.total("accepted")),
        "lookup_rounds": sum(r.source == "lookup" for r in s.rounds),
        "suffix_rounds": sum(r.source == "suffix" for r in s.rounds),
        "tokens_per_s": s.tokens_per_s,
        "prefill_s": s.prefill_s,
        "decode_s": max(0.0, s.wall_s - s.prefill_s),
        "queue_s": fin.queue_s,
        "time_to_first_token_s": fin.ttft_s,
        "stop_reason": s.stop_reason,
    }


@dataclass
class Shaper:
    """Builds the bodies of one request: ``chat.completion`` or ``text_completion`` and their chunks."""

    kind: Literal["chat", "text"]
    id: str
    model: str
    created: int = field(default_factory=lambda: int(time.time()))

    def _head(self, suffix: str = "") -> dict:
        obj = "chat.completion" if self.kind == "chat" else "text_completion"
        return {"id": self.id, "object": obj + suffix, "created": self.created, "model": self.model}

    def _choice(self, text: str | None, finish: str | None, role: bool = False, delta: bool = False) -> dict:
        if self.kind == "text":
            return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        message = {"role": "assistant", "content": text} if role or not delta else ({"content": text} if text else {})
        return {"index": 0, ("delta" if delta else "message"): message, "logprobs": None, "finish_reason": finish}

    def full(self, fin: Finished) -> dict:
        return {**self._head(), "choices": [self._choice(fin.text, fin.finish_reason)], "usage": usage(fin),
                "hetero_spec": hetero_spec_stats(fin)}

    def chunk(self, text: str | None, *, first: bool = False, fin: Finished | None = None,
              include_usage: bool = False) -> dict:
        """A stream chunk: the first carries the role (chat), the last the finish reason and stats."""
        suffix = ".chunk" if self.kind == "chat" else ""
        body = {**self._head(suffix), "choices": [self._choice(text, fin.finish_reason if fin else None,
                                                               role=first, delta=True)]}
        if fin is not None:
            body["hetero_spec"] = hetero_spec_stats(fin)
        if include_usage:
            body["usage"] = None  # OpenAI: null on every chunk but the final usage chunk
        return body

    def usage_chunk(self, fin: Finished) -> dict:
        suffix = ".chunk" if self.kind == "chat" else ""
        return {**self._head(suffix), "choices": [], "usage": usage(fin)}
