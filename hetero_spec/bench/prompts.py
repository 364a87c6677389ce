"""Benchmark prompts: the four shipped sets (package data) or a user's JSONL file.

The sets live in ``hetero_spec/bench/data/`` and are read through ``importlib.resources``,
so a clone, an editable install and a wheel all find them without any folder beside the
package (see data/README.md for their sources and licenses).
``$HETERO_SPEC_BENCH_DIR`` points the named sets at another folder of the same files.

>>> load_dataset("gsm8k", 2).prompts[0][:17]
'Darrell and Allen'
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from ..errors import HeteroSpecError

DATASETS = ("mt_bench", "humaneval", "gsm8k", "alpaca")
# Shipped sets the bench runs only when named: translation and summaries of long inputs, where neither
# the draft nor prompt lookup predicts much and auto must still hold plain decoding's speed.
# grounded, multiturn, agentic: where the text repeats what came before (the input, an earlier turn, earlier
# requests' outputs), for the suffix structure (spec/suffix.py); made by scripts/make_suffix_sets.py.
EXTRA_SETS = ("translate", "grounded", "multiturn", "agentic")
ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class Dataset:
    name: str
    prompts: tuple  # first user turns (str), or conversations ending with the user's (a line's ``messages``)


def shipped_text(name: str) -> str:
    """The JSONL text of shipped set ``name`` (one of DATASETS or EXTRA_SETS)."""
    if name not in DATASETS + EXTRA_SETS:
        raise HeteroSpecError(f"unknown dataset {name!r}: use {', '.join(DATASETS + EXTRA_SETS)} or a path to a "
                              "JSONL file")
    env = os.environ.get("HETERO_SPEC_BENCH_DIR")
    if env:
        path = Path(env) / f"{name}.jsonl"
        if not path.is_file():
            raise HeteroSpecError(f"bench prompts not found at {path} (HETERO_SPEC_BENCH_DIR is set)")
        return path.read_text(encoding="utf-8")
    res = resources.files(__package__).joinpath("data", f"{name}.jsonl")
    if not res.is_file():  # a broken install: the wheel was built without its package data
        raise HeteroSpecError(f"shipped prompt set {name}.jsonl is missing from the hetero_spec package; reinstall")
    return res.read_text(encoding="utf-8")


def first_turns(text: str, n: int, where: str) -> list:
    """The first user turn of up to ``n`` non-empty JSONL lines, or the line's ``messages`` (a conversation
    whose last turn is the user's, as a tuple of {"role", "content"}); ``where`` names the source in errors."""
    prompts = []
    for i, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            if "messages" in row:
                prompts.append(_conversation(row["messages"], f"{where}:{i}"))
                if len(prompts) == n:
                    break
                continue
            turns = row["turns"]
            first = turns[0] if isinstance(turns, list) else None
        except (ValueError, KeyError, TypeError, IndexError):
            first = None
        if not isinstance(first, str) or not first.strip():
            raise HeteroSpecError(f"{where}:{i}: expected a JSON object with a non-empty list 'turns' of strings "
                                  "or a list 'messages'")
        prompts.append(first)
        if len(prompts) == n:
            break
    if not prompts:
        raise HeteroSpecError(f"{where} holds no prompts")
    return prompts


def _conversation(messages, where: str) -> tuple[dict[str, str], ...]:
    ok = isinstance(messages, list) and messages and all(
        isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str) for m in messages)
    if not ok or messages[-1]["role"] != "user" or not messages[-1]["content"].strip():
        raise HeteroSpecError(f"{where}: 'messages' must be a list of {{role, content}} ending with a user turn")
    return tuple({"role": m["role"], "content": m["content"]} for m in messages)


def load_dataset(spec: str, n: int) -> Dataset:
    """A shipped set by name, or a JSONL file whose lines carry ``turns`` (a list of user turns)."""
    path = Path(spec)
    if spec in DATASETS + EXTRA_SETS and not path.exists():
        return Dataset(spec, tuple(first_turns(shipped_text(spec), n, f"{spec}.jsonl")))
    if path.is_file():
        return Dataset(path.stem, tuple(first_turns(path.read_text(encoding="utf-8"), n, str(path))))
    raise HeteroSpecError(f"unknown dataset {spec!r}: use {', '.join(DATASETS + EXTRA_SETS)} or a path to a JSONL file")


def bench_prompts(name: str, n: int) -> list[str]:
    """First turns of the first ``n`` prompts of a shipped set (what tests and scripts use)."""
    return list(load_dataset(name, n).prompts)


__all__ = ["DATASETS", "EXTRA_SETS", "Dataset", "load_dataset", "bench_prompts", "shipped_text"]
