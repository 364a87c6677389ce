"""Side-by-side speed runs: every method on every prompt, interleaved prompt by prompt.

Interleaving (and rotating which method goes first) makes slow drift of a shared machine
fall on all methods alike; speedups are medians of per-prompt ratios against the raw
baseline measured moments before or after on the same prompt.

Methods are a registry: a name maps to a builder that makes a ``Runner`` from the
shared ``BenchContext``.  Adding a hetero-spec variant is one entry, e.g.

    register(Method("wide-tree", "hetero-spec tree, 3 children", lambda c: c.hetero_run(
        draft_len=1, tree=TreeSpec(16, 4, 3)), needs_draft=True, speculative=True))
"""
from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from ..errors import HeteroSpecError
from .baselines import BenchTarget, HeteroSpecRun, LlamaCppRun, RawRun, RunResult, Runner

BASELINE = "raw"
DATASETS = ("mt_bench", "humaneval", "gsm8k", "alpaca")
DEFAULT_METHODS = ("raw", "llama-cpp", "prompt-lookup", "chain")


def bench_dir() -> Path:
    """The shipped prompt sets: ``$HETERO_SPEC_BENCH_DIR`` or ../shared/data/bench beside the checkout."""
    env = os.environ.get("HETERO_SPEC_BENCH_DIR")
    return Path(env) if env else Path(__file__).resolve().parents[3] / "shared" / "data" / "bench"


# ----------------------------------------------------------------------- methods
class BenchContext:
    """Resources shared by the runners, built on first use and closed once."""

    def __init__(self, target: BenchTarget) -> None:
        from ..api import HeteroSpec

        self.target = target
        self.hs = HeteroSpec(target.model, target.draft, n_ctx=target.n_ctx, threads=target.threads,
                             draft_device=target.draft_device, draft_dtype=target.draft_dtype,
                             kv_type=target.kv_type)
        self._closers: list[Callable[[], None]] = []

    def hetero_run(self, **options: Any) -> HeteroSpecRun:
        return HeteroSpecRun(self.hs, **options)

    def own(self, runner: Runner) -> Runner:
        self._closers.append(runner.close)
        return runner

    def close(self) -> None:
        for close in reversed(self._closers):
            close()
        self.hs.close()


@dataclass(frozen=True)
class Method:
    name: str
    description: str
    build: Callable[[BenchContext], Runner]
    needs_draft: bool = False
    speculative: bool = False  # reports accepted lengths and a time split


METHODS: dict[str, Method] = {}


def register(method: Method) -> Method:
    METHODS[method.name] = method
    return method


register(Method("raw", "plain greedy loop on llama.cpp's low-level API (the baseline), on hetero-spec's own context",
                lambda c: c.own(RawRun(c.hs))))
register(Method("llama-cpp", "llama-cpp-python high-level create_completion",
                lambda c: c.own(LlamaCppRun(c.target, prompt_lookup=False))))
register(Method("prompt-lookup", "llama-cpp-python built-in speculation (LlamaPromptLookupDecoding)",
                lambda c: c.own(LlamaCppRun(c.target, prompt_lookup=True))))
register(Method("plain", "hetero-spec without a draft (same runtime, k = 0)",
                lambda c: c.hetero_run(draft_len=0)))
register(Method("chain", "hetero-spec chain drafting, k drafts per round",
                lambda c: c.hetero_run(draft_len=c.target.k), needs_draft=True, speculative=True))
register(Method("auto", "hetero-spec --draft-len auto: draft-model or prompt-lookup chain sized per round from "
                        "the cost curve, measured round costs and acceptance",
                lambda c: c.hetero_run(draft_len="auto"), needs_draft=True, speculative=True))
register(Method("auto-nolookup", "hetero-spec --draft-len auto --no-lookup: the draft model only",
                lambda c: c.hetero_run(draft_len="auto", lookup=False), needs_draft=True, speculative=True))
register(Method("tree", "hetero-spec dynamic tree of a fixed shape (--tree-tokens/-depth/-top-k)",
                lambda c: c.hetero_run(draft_len=1, tree=c.target.tree), needs_draft=True, speculative=True))
register(Method("auto-tree", "hetero-spec dynamic tree sized per round from the cost curve",
                lambda c: c.hetero_run(draft_len="auto", tree=c.target.tree), needs_draft=True, speculative=True))


# ----------------------------------------------------------------------- prompts
@dataclass(frozen=True)
class Dataset:
    name: str
    prompts: tuple[str, ...]  # first user turns


def load_dataset(spec: str, n: int) -> Dataset:
    """A shipped set by name, or a JSONL file whose lines carry ``turns`` (a list of user turns)."""
    path = Path(spec)
    if spec in DATASETS and not path.exists():
        path, name = bench_dir() / f"{spec}.jsonl", spec
        if not path.is_file():
            raise HeteroSpecError(f"bench prompts not found at {path} (set HETERO_SPEC_BENCH_DIR or pass a path)")
    elif path.is_file():
        name = path.stem
    else:
        raise HeteroSpecError(f"unknown dataset {spec!r}: use {', '.join(DATASETS)} or a path to a JSONL file")
    prompts = []
    for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            turns = json.loads(line)["turns"]
            first = turns[0] if isinstance(turns, list) else None
        except (ValueError, KeyError, TypeError, IndexError):
            first = None
        if not isinstance(first, str) or not first.strip():
            raise HeteroSpecError(f"{path}:{i}: expected a JSON object with a non-empty list 'turns' of strings")
        prompts.append(first)
        if len(prompts) == n:
            break
    if not prompts:
        raise HeteroSpecError(f"{path} holds no prompts")
    return Dataset(name, tuple(prompts))


# ---------------------------------------------------------------------- the run
@dataclass(frozen=True)
class BenchConfig:
    target: BenchTarget
    datasets: tuple[str, ...] = ("mt_bench", "humaneval")
    methods: tuple[str, ...] = DEFAULT_METHODS
    n_prompts: int = 8
    max_new_tokens: int = 128
    warmup: bool = True

    def __post_init__(self) -> None:
        unknown = [m for m in self.methods if m not in METHODS]
        if unknown:
            raise HeteroSpecError(f"unknown method {unknown[0]!r}: choose from {', '.join(METHODS)}")
        if self.target.draft is None and any(METHODS[m].needs_draft for m in self.methods):
            need = [m for m in self.methods if METHODS[m].needs_draft]
            raise HeteroSpecError(f"method {need[0]} needs a DRAFT file")
        if self.n_prompts < 1 or self.max_new_tokens < 1:
            raise HeteroSpecError("--n-prompts and --max-new-tokens must be at least 1")


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
    stats: dict[str, Any] | None = None
    accepted: list[int] = field(default_factory=list)  # accepted drafts per round


@dataclass
class BenchResult:
    meta: dict[str, Any]
    records: list[PromptRecord]

    def to_dict(self) -> dict[str, Any]:
        from .report import summarize

        return {"meta": self.meta, "summary": summarize(self), "prompts": [asdict(r) for r in self.records]}


def run_bench(cfg: BenchConfig, progress: Callable[[str], None] | None = None) -> BenchResult:
    """Every method on every prompt; ``progress`` is called with the method name after each run."""
    from ..target.llama_target import default_threads

    datasets = [load_dataset(d, cfg.n_prompts) for d in cfg.datasets]
    methods = [BASELINE] + [m for m in cfg.methods if m != BASELINE]
    ctx = BenchContext(cfg.target)
    try:
        meta = _meta(cfg, ctx, methods, threads=cfg.target.threads or default_threads())
        runners = {m: METHODS[m].build(ctx) for m in methods}
        prompts = [(d.name, i, _prompt_ids(ctx, text)) for d in datasets for i, text in enumerate(d.prompts)]
        longest = max(len(ids) for _, _, ids in prompts)
        if longest + cfg.max_new_tokens + 8 > cfg.target.n_ctx:
            raise HeteroSpecError(f"a prompt of {longest} tokens plus {cfg.max_new_tokens} new ones does not fit "
                                  f"the context of {cfg.target.n_ctx} (use --ctx)")
        if cfg.warmup:  # first calls pay one-off costs (allocations, torch kernels, page faults)
            for m in methods:
                runners[m].run(prompts[0][2], 4)
        records: list[PromptRecord] = []
        for j, (dname, i, ids) in enumerate(prompts):
            order = methods[j % len(methods):] + methods[: j % len(methods)]  # rotate who goes first
            results: dict[str, RunResult] = {}
            for m in order:
                results[m] = runners[m].run(ids, cfg.max_new_tokens)
                if progress:
                    progress(m)
            records += _records(results, dname, i, len(ids))
    finally:
        ctx.close()
    return BenchResult(meta, records)


def _prompt_ids(ctx: BenchContext, text: str) -> list[int]:
    hs = ctx.hs
    return hs.target.tokenize(hs.render([{"role": "user", "content": text}]), add_special=False, parse_special=True)


def _records(results: dict[str, RunResult], dataset: str, index: int, n_prompt: int) -> list[PromptRecord]:
    base = results[BASELINE]
    out = []
    for m, r in results.items():
        equal = (r.tokens == base.tokens) if r.tokens is not None else (r.text == base.text)
        out.append(PromptRecord(
            method=m, dataset=dataset, index=index, prompt_tokens=n_prompt, new_tokens=r.new_tokens,
            wall_s=r.wall_s, tokens_per_s=r.tokens_per_s,
            speedup=r.tokens_per_s / base.tokens_per_s if base.tokens_per_s > 0 else 0.0,
            equal=bool(equal), text=r.text,
            same_text_as=[o for o, ro in results.items() if o != m and ro.text == r.text], prefill_s=r.prefill_s, stats=r.stats,
            accepted=[rd.accepted for rd in r.rounds if rd.drafted > 0],
        ))
    return out


def _meta(cfg: BenchConfig, ctx: BenchContext, methods: list[str], threads: int) -> dict[str, Any]:
    from ..calibration import machine_id
    from .cost_equivalent import cost_equivalent_label

    t = cfg.target
    return {
        "model": t.model.name,
        "model_bytes": t.model.stat().st_size,
        "target_label": cost_equivalent_label(ctx.hs.target._model.meta) or "real model",
        "draft": t.draft.name if t.draft else None,
        "machine": machine_id(threads),
        "threads": threads,
        "k": t.k,
        "kv_type": t.kv_type,
        "tree": asdict(t.tree),
        "prompt_lookup_tokens": t.lookup_tokens,
        "max_new_tokens": cfg.max_new_tokens,
        "n_prompts": cfg.n_prompts,
        "datasets": list(cfg.datasets),
        "methods": {m: METHODS[m].description for m in methods},
        "speculative": [m for m in methods if METHODS[m].speculative],
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "timing": "wall time per prompt including prefill; speedup = median over prompts of tok/s ratio to raw",
    }


__all__ = ["METHODS", "Method", "register", "BenchConfig", "BenchContext", "run_bench", "load_dataset",
           "BenchResult", "PromptRecord", "DATASETS"]
