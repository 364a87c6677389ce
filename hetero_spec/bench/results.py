"""What a bench run produces, as plain data: one record per (method, prompt), and the run.

Kept apart from the harness (which makes them) and the report (which renders them) so that
imports flow one way: harness -> results <- report, projection.  ``load_bench_json`` reads a
written bench.json back, which is how projections replay an earlier run.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from ..errors import HeteroSpecError
from ..records import Round

# The per-round fields kept in bench.json, one list per round in this order (compact: a
# prompt of 128 tokens has up to 128 rounds, and a run has hundreds of prompts).
ROUND_FIELDS = ("drafted", "accepted", "emitted", "draft_s", "verify_s", "overhead_s", "source", "shadow", "levels",
                "draft_rows")


def round_row(r: Round) -> list[Any]:
    """One Round as a compact list in ``ROUND_FIELDS`` order (times rounded to microseconds)."""
    return [r.drafted, r.accepted, r.emitted, round(r.draft_s, 6), round(r.verify_s, 6), round(r.overhead_s, 6),
            r.source, r.shadow, r.levels, r.draft_rows]


@dataclass
class PromptRecord:
    method: str
    dataset: str
    index: int
    prompt_tokens: int
    new_tokens: int
    wall_s: float
    tokens_per_s: float
    speedup: float  # over the baseline on this prompt
    equal: bool  # same output as the baseline (ids where the API gives them, else text)
    text: str = ""
    same_text_as: list[str] = field(default_factory=list)  # the other methods that wrote the same text
    prefill_s: float | None = None
    stats: dict[str, Any] | None = None  # RunStats.to_dict() of hetero-spec runs
    accepted: list[int] = field(default_factory=list)  # accepted drafts per drafted round
    rounds: list[list[Any]] = field(default_factory=list)  # every Round, as ROUND_FIELDS rows
    engine: dict[str, Any] | None = None  # what an external engine (llama-server) reported itself
    compared_by: str = "tokens"  # "tokens" (ids) or "text": how ``equal`` was decided


@dataclass
class BenchResult:
    meta: dict[str, Any]
    records: list[PromptRecord]
    projections: list[dict[str, Any]] = field(default_factory=list)  # projection.project_result rows


def load_bench_json(path: str | Path) -> BenchResult:
    """A bench.json written by ``report.write_bench``, back as a BenchResult (summary recomputed on demand)."""
    try:
        data = json.loads(Path(path).read_text())
        known = {f.name for f in fields(PromptRecord)}
        records = [PromptRecord(**{k: v for k, v in p.items() if k in known}) for p in data["prompts"]]
        return BenchResult(data["meta"], records, data.get("projections", []))
    except FileNotFoundError:
        raise HeteroSpecError(f"no bench.json at {path}") from None
    except (ValueError, KeyError, TypeError) as exc:
        raise HeteroSpecError(f"{path} is not a bench.json written by hetero-spec bench ({exc})") from None


__all__ = ["PromptRecord", "BenchResult", "ROUND_FIELDS", "round_row", "load_bench_json"]
