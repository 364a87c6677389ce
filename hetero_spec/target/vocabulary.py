"""Text in and out of a GGUF's vocabulary: shared by the single-sequence target and the sequence context."""
from __future__ import annotations

import ctypes

from ..errors import TargetError
from ._ffi import C


class Vocabulary:
    """Tokenize and render pieces through the vocabulary of ``self._model`` (a ``ModelHandle``)."""

    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = True) -> list[int]:
        data = text.encode("utf-8")
        cap = len(data) + 8
        buf = (C.llama_token * cap)()
        n = C.llama_tokenize(self._model.vocab, data, len(data), buf, cap, add_special, parse_special)
        if n < 0:  # buffer too small: llama.cpp returns the negated size it needs
            cap = -n
            buf = (C.llama_token * cap)()
            n = C.llama_tokenize(self._model.vocab, data, len(data), buf, cap, add_special, parse_special)
        if n < 0:
            raise TargetError("tokenization failed")
        return list(buf[:n])

    def piece(self, token: int) -> bytes:
        """The bytes of one token as it appears in generated text (special tokens rendered), cached per id."""
        pieces = self.__dict__.setdefault("_pieces", {})
        cached = pieces.get(token)
        if cached is None:
            buf = ctypes.create_string_buffer(256)
            n = C.llama_token_to_piece(self._model.vocab, token, buf, len(buf), 0, False)
            cached = buf.raw[: max(n, 0)]
            pieces[token] = cached
        return cached

    def detokenize(self, tokens: list[int]) -> str:
        return b"".join(self.piece(t) for t in tokens).decode("utf-8", errors="replace")

    def token_text(self, token: int) -> str:
        return C.llama_vocab_get_text(self._model.vocab, token).decode("utf-8", errors="replace")

    @property
    def bos_token(self) -> str:
        tid = C.llama_vocab_bos(self._model.vocab)
        return self.token_text(tid) if tid >= 0 else ""

    @property
    def eos_token(self) -> str:
        tid = C.llama_vocab_eos(self._model.vocab)
        return self.token_text(tid) if tid >= 0 else ""

    @property
    def chat_template(self) -> str | None:
        return self._model.meta("tokenizer.chat_template")
