"""Checks of what an app hands the Python API, each failing as one ``HeteroSpecError`` that names the argument.

WHY: unchecked, these arguments travel into numpy, ctypes and jinja2, which fail in their own terms (an
"invalid batch" from ``llama_decode`` for a token id past the vocabulary, ``KeyError: -1`` for a dict of
messages) or not at all: a string where a list belongs is iterated as characters, so ``stop="\\n\\n"``
stopped at the first single newline and ``BatchGenerator.generate("Hi!")`` answered three prompts.
"""
from __future__ import annotations

import numbers
from typing import Any, Iterable, Sequence

from .errors import HeteroSpecError


def check_type(name: str, value: Any, kind: type) -> None:
    """``value`` is None or a ``kind``."""
    if value is not None and not isinstance(value, kind):
        raise HeteroSpecError(f"{name} must be a {kind.__name__}, not {type(value).__name__}")


def whole(value: Any) -> bool:
    """An integer and not a bool (numpy integers count): 2.5 tokens is a mistake, not 2."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def count(name: str, value: Any, least: int = 1) -> int:
    """A whole number >= ``least``."""
    if not whole(value) or value < least:
        raise HeteroSpecError(f"{name} must be a whole number >= {least}, not {value!r}")
    return int(value)


def stop_strings(stop: str | Iterable[str] | None) -> tuple[str, ...]:
    """One stop string or several, as the OpenAI API takes them."""
    if stop is None:
        return ()
    if isinstance(stop, str):
        return (stop,)
    if isinstance(stop, (bytes, dict)) or not isinstance(stop, Iterable):
        raise HeteroSpecError(f"stop must be a str or a list of str, not {type(stop).__name__}")
    stop = tuple(stop)
    bad = [s for s in stop if not isinstance(s, str)]
    if bad:
        raise HeteroSpecError(f"stop strings must be str, not {type(bad[0]).__name__} ({bad[0]!r})")
    return stop


def token_ids(prompt: Any, n_vocab: int, name: str = "prompt") -> list[int]:
    """A prompt given as token ids: a sequence of whole numbers in ``[0, n_vocab)``."""
    if isinstance(prompt, (str, bytes, dict)) or not isinstance(prompt, Sequence) and not hasattr(prompt, "tolist"):
        raise HeteroSpecError(f"{name} must be a str or a list of token ids, not {type(prompt).__name__}")
    ids = prompt.tolist() if hasattr(prompt, "tolist") else list(prompt)
    for t in ids:
        if not whole(t):
            raise HeteroSpecError(f"{name}: token ids must be whole numbers, not {t!r}")
        if not 0 <= t < n_vocab:
            raise HeteroSpecError(f"{name}: token id {t} is outside the vocabulary (0..{n_vocab - 1})")
    return [int(t) for t in ids]


def check_messages(messages: Any, name: str = "messages") -> list[dict[str, str]]:
    """A chat: a non-empty list of {"role": str, "content": str} whose last message says something."""
    empty = "empty prompt" if name == "messages" else f"{name}: empty prompt"
    if not isinstance(messages, list) or not messages:
        if isinstance(messages, list):
            raise HeteroSpecError(empty)
        raise HeteroSpecError(f"{name} must be a list of {{'role': ..., 'content': ...}} dicts, "
                              f"not {type(messages).__name__}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise HeteroSpecError(f"{name}[{i}] must be a dict with str 'role' and 'content', not {m!r:.80}")
    if not messages[-1]["content"].strip():
        raise HeteroSpecError(empty)
    return messages
