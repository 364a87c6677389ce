"""Side-by-side speed runs: every method on every prompt, interleaved prompt by prompt.

Interleaving (and rotating which method goes first) makes slow drift of a shared machine
fall on all methods alike; speedups are medians of per-prompt ratios against the raw
baseline measured moments before or after on the same prompt.

Methods are a registry: a name maps to a builder that makes a ``Runner`` from the
shared ``BenchContext``.  Adding a hetero-spec variant is one entry, e.g.

    register(Method("wide-tree", "hetero-spec tree, 3 children", lambda c: c.hetero_run(
        draft_len=1, tree=TreeSpec(16, 4, 3)), needs_draft=True, speculative=True))

Fixed trees are named by shape, ``tree-t{tokens}-d{depth}-k{top_k}`` (``tree-t2-d2-k2``), so that one
interleaved run can compare tree shapes as ``chain-k1`` .. ``chain-k8`` compare chain lengths.
"""
from __future__ import annotations

import json
import re
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable

from ..config import TreeSpec
from ..errors import HeteroSpecError
from .baselines import BenchTarget, HeteroSpecRun, LlamaCppRun, RawRun, RunResult, Runner, SuffixRun
from .llama_server import LlamaServerRun, MethodUnavailable, ServerMethod
from .prompts import DATASETS, Dataset, load_dataset
from .results import BenchResult, PromptRecord, round_row

BASELINE = "raw"
DEFAULT_METHODS = ("raw", "llama-cpp", "prompt-lookup", "chain")


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

    def llama_server_run(self, method: ServerMethod) -> LlamaServerRun:
        """llama.cpp's own speculation on a llama-server with this bench's target, threads and KV cells."""
        from ..target.llama_target import kv_type_id

        t = self.hs.target
        # Where the model cannot hold quantized cells, the target fell back to F16: so does the server.
        kv = self.target.kv_type if kv_type_id(self.target.kv_type, t._model) == kv_type_id(self.target.kv_type) else "f16"
        return self.own(LlamaServerRun(self.target, method, kv,
                                       lambda ids: t.detokenize([i for i in ids if not t.is_eog(i)])))

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
for _k in range(1, 9):  # a fixed chain length each, so one interleaved run can sweep k (--methods chain-k1,chain-k2,...)
    register(Method(f"chain-k{_k}", f"hetero-spec chain drafting, {_k} drafts per round",
                    lambda c, k=_k: c.hetero_run(draft_len=k), needs_draft=True, speculative=True))
register(Method("auto", "hetero-spec --draft-len auto --no-suffix: draft-model or prompt-lookup chain sized per "
                        "round from the cost curve, measured round costs and acceptance",
                lambda c: c.hetero_run(draft_len="auto"), needs_draft=True, speculative=True))
register(Method("auto-suffix", "hetero-spec --draft-len auto (run's default): the draft model (if any) and trees "
                               "from the suffix structure over the prompt, the output and this method's earlier outputs",
                lambda c: c.own(SuffixRun(c.hs, draft_len="auto")), speculative=True))
register(Method("auto-lookup", "hetero-spec --draft-len auto with the draft model left out: prompt-lookup chains "
                               "only (the runtime's lookup-only, beside the draft in the same run)",
                lambda c: c.hetero_run(draft_len="auto", draft_model=False), speculative=True))
register(Method("auto-nolookup", "hetero-spec --draft-len auto --no-lookup: the draft model only",
                lambda c: c.hetero_run(draft_len="auto", lookup=False), needs_draft=True, speculative=True))
register(Method("tree", "hetero-spec dynamic tree of a fixed shape (--tree-tokens/-depth/-top-k)",
                lambda c: c.hetero_run(draft_len=1, tree=c.target.tree), needs_draft=True, speculative=True))
TREE_NAME = re.compile(r"tree-t(\d+)-d(\d+)-k(\d+)")


def method_named(name: str) -> Method | None:
    """A registered method, or a fixed tree named by its shape (``TREE_NAME``); None if neither."""
    if name in METHODS:
        return METHODS[name]
    shape = TREE_NAME.fullmatch(name)
    if shape is None:
        return None
    spec = TreeSpec(*(int(g) for g in shape.groups()))  # a shape out of range is refused like --tree-tokens
    return Method(name, f"hetero-spec dynamic tree of {spec.total_tokens} tokens, depth {spec.depth}, "
                        f"top-k {spec.top_k}", lambda c: c.hetero_run(draft_len=1, tree=spec),
                  needs_draft=True, speculative=True)


register(Method("auto-tree", "hetero-spec dynamic tree sized per round from the cost curve",
                lambda c: c.hetero_run(draft_len="auto", tree=c.target.tree), needs_draft=True, speculative=True))

# llama.cpp's own speculative decoding (scripts/build_llama_cpp.sh builds the server).  The n-gram
# method runs llama.cpp's ngram-simple at its own defaults (a 12-token match drafts up to 48 tokens);
# the draft methods draft --k tokens per round, like ``chain``.  --llama-args adds or overrides flags.
LLAMA_NGRAM = ServerMethod(("--spec-type", "ngram-simple"))
LLAMA_NGRAM_MOD = ServerMethod(("--spec-type", "ngram-mod"))
LLAMA_NGRAM_CACHE = ServerMethod(("--spec-type", "ngram-cache"))
LLAMA_DRAFT = ServerMethod(("--spec-type", "draft-simple"), needs="llama_draft_model")
LLAMA_EAGLE3 = ServerMethod(("--spec-type", "draft-eagle3"), needs="eagle3_gguf")
register(Method("llama-server", "llama-server without speculation (llama.cpp's own plain decoding)",
                lambda c: c.llama_server_run(ServerMethod(()))))
register(Method("llama.cpp-ngram", "llama-server --spec-type ngram-simple (n-gram lookup in the context)",
                lambda c: c.llama_server_run(LLAMA_NGRAM)))
register(Method("llama.cpp-ngram-mod", "llama-server --spec-type ngram-mod (a rolling n-gram hash shared across "
                                       "requests)", lambda c: c.llama_server_run(LLAMA_NGRAM_MOD)))
register(Method("llama.cpp-ngram-cache", "llama-server --spec-type ngram-cache (n-gram statistics of the context "
                                         "and of earlier generations)", lambda c: c.llama_server_run(LLAMA_NGRAM_CACHE)))
register(Method("llama.cpp-draft", "llama-server --spec-type draft-simple -md --llama-draft-model (a small draft GGUF)",
                lambda c: c.llama_server_run(LLAMA_DRAFT)))
register(Method("llama.cpp-eagle3", "llama-server --spec-type draft-eagle3 -md --eagle3-gguf (an EAGLE-3 draft GGUF)",
                lambda c: c.llama_server_run(LLAMA_EAGLE3)))


# ---------------------------------------------------------------------- the run
@dataclass(frozen=True)
class BenchConfig:
    target: BenchTarget
    datasets: tuple[str, ...] = ("mt_bench", "humaneval")
    methods: tuple[str, ...] = DEFAULT_METHODS
    n_prompts: int = 8
    max_new_tokens: int = 128
    warmup: bool = True
    # "gguf": prompts rendered with the model's chat template; "plain": as raw text in the plain
    # template's turns (hetero_spec.chat_template.plain_prompt), for base models without a template
    template: str = "gguf"
    # time one quick calibration pass after every prompt; their per-n medians are this run's own
    # cost curve (meta["calibration"], what ``--project this-run`` projects with)
    calibrate: bool = False
    # passes over every prompt, each in the mirror order of the last (A B, then B A); each record keeps
    # its method's fastest run.  The shared VM slows runs by up to 2x at random for seconds at a time
    # (seen: auto's plain rounds took 0.55-2.2x raw's time per token on the same prompt), which no
    # order cancels; a slow spell only adds time, so the fastest run is the least disturbed one, and
    # whole passes put a prompt's runs minutes apart, out of one spell.
    repeats: int = 1

    def __post_init__(self) -> None:
        if self.template not in ("gguf", "plain"):
            raise HeteroSpecError(f"unknown template {self.template!r} (use gguf or plain)")
        unknown = [m for m in self.methods if method_named(m) is None]
        if unknown:
            raise HeteroSpecError(f"unknown method {unknown[0]!r}: choose from {', '.join(METHODS)}, "
                                  "or a tree shape as tree-t{tokens}-d{depth}-k{top_k}")
        if self.target.draft is None and any(method_named(m).needs_draft for m in self.methods):
            need = [m for m in self.methods if method_named(m).needs_draft]
            raise HeteroSpecError(f"method {need[0]} needs a DRAFT file")
        if self.n_prompts < 1 or self.max_new_tokens < 1 or self.repeats < 1:
            raise HeteroSpecError("--n-prompts, --max-new-tokens and --repeats must be at least 1")


def run_bench(cfg: BenchConfig, progress: Callable[[str], None] | None = None,
              planned: Callable[[int], None] | None = None) -> BenchResult:
    """Every method on every prompt; ``progress`` is called with the method name after each run,
    ``planned`` once with the number of runs (methods that cannot run here are not counted)."""
    from ..target.llama_target import default_threads

    datasets = [load_dataset(d, cfg.n_prompts) for d in cfg.datasets]
    methods = [BASELINE] + [m for m in cfg.methods if m != BASELINE]
    ctx = BenchContext(cfg.target)
    try:
        runners, not_run = _build_runners(ctx, methods)
        methods = [m for m in methods if m in runners]
        meta = _meta(cfg, ctx, methods, threads=cfg.target.threads or default_threads())
        meta["not_run"] = not_run
        prompts = [(d.name, i, _prompt_ids(ctx, text, cfg.template)) for d in datasets for i, text in enumerate(d.prompts)]
        if planned:
            planned(len(prompts) * len(methods) * cfg.repeats)
        longest = max(len(ids) for _, _, ids in prompts)
        if longest + cfg.max_new_tokens + 8 > cfg.target.n_ctx:
            raise HeteroSpecError(f"a prompt of {longest} tokens plus {cfg.max_new_tokens} new ones does not fit "
                                  f"the context of {cfg.target.n_ctx} (use --ctx)")
        if cfg.warmup:  # first calls pay one-off costs (allocations, torch kernels, page faults)
            for m in methods:
                runners[m].run(prompts[0][2], 4)
        runs: list[dict[str, list[RunResult]]] = [{m: [] for m in methods} for _ in prompts]
        passes = []
        for r in range(cfg.repeats):  # whole passes over the prompts: a slow spell of the VM lasts seconds
            for j, (_, _, ids) in enumerate(prompts):
                order = methods[j % len(methods):] + methods[: j % len(methods)]  # rotate who goes first
                for m in order if r % 2 == 0 else order[::-1]:
                    runs[j][m].append(runners[m].run(ids, cfg.max_new_tokens))
                    if progress:
                        progress(m)
                if cfg.calibrate:
                    passes.append(_calibration_pass(ctx))
        records = [rec for (dname, i, ids), rs in zip(prompts, runs) for rec in _records(rs, dname, i, len(ids))]
        if passes:
            from ..calibration import merge

            meta["calibration"] = {"passes": len(passes), "curve": json.loads(merge(passes).to_json())}
    finally:
        ctx.close()
    return BenchResult(meta, records)


def _calibration_pass(ctx: BenchContext):
    """One timing of each of the first-use calibration's rows, and the draft's step, on the bench's own
    target and draft (both caches are reset before every run anyway)."""
    from ..api import QUICK_ROWS
    from ..calibration import describe_files, measure

    t = ctx.target
    return measure(ctx.hs.target, ctx.hs.draft, ns=QUICK_ROWS, repeats=1, model=describe_files(t.model, t.draft))


def _build_runners(ctx: BenchContext, methods: list[str]) -> tuple[dict[str, Runner], dict[str, str]]:
    """A runner per method; a method that cannot run here (a tool not built, a file not given) is
    left out with its reason, which the report prints, instead of failing the whole bench."""
    runners: dict[str, Runner] = {}
    not_run: dict[str, str] = {}
    for m in methods:
        try:
            runners[m] = method_named(m).build(ctx)
        except MethodUnavailable as exc:
            not_run[m] = str(exc)
    return runners, not_run


def _prompt_ids(ctx: BenchContext, text, template: str = "gguf") -> list[int]:
    from ..chat_template import plain_prompt

    hs = ctx.hs
    turn = [{"role": "user", "content": text}] if isinstance(text, str) else list(text)  # or a conversation
    if template == "plain":  # exactly what ``run --raw -p "$(plain prompt)"`` decodes: BOS added as for raw text
        return hs.target.tokenize(plain_prompt(turn), add_special=True, parse_special=True)
    if not hs.target.chat_template:
        raise HeteroSpecError(f"{hs.target.path.name} has no chat template (a base model?); pass --template plain")
    return hs.target.tokenize(hs.render(turn), add_special=False, parse_special=True)


def _records(runs: dict[str, list[RunResult]], dataset: str, index: int, n_prompt: int) -> list[PromptRecord]:
    """A record per method: its fastest run, equal to raw only if every run's output was."""
    results = {m: min(rs, key=lambda r: r.wall_s) for m, rs in runs.items()}
    base = results[BASELINE]
    out = []
    for m, r in results.items():
        equal = all(_same_output(o, b) for o in runs[m] for b in runs[BASELINE])
        out.append(PromptRecord(
            method=m, dataset=dataset, index=index, prompt_tokens=n_prompt, new_tokens=r.new_tokens,
            wall_s=r.wall_s, tokens_per_s=r.tokens_per_s,
            speedup=r.tokens_per_s / base.tokens_per_s if base.tokens_per_s > 0 else 0.0,
            equal=bool(equal), text=r.text,
            same_text_as=[o for o, ro in results.items() if o != m and ro.text == r.text], prefill_s=r.prefill_s,
            stats=r.stats, accepted=[rd.accepted for rd in r.rounds if rd.drafted > 0],
            rounds=[round_row(rd) for rd in r.rounds], engine=r.engine,
            compared_by="tokens" if r.tokens is not None else "text",
        ))
    return out


def _same_output(r: RunResult, base: RunResult) -> bool:
    return (r.tokens == base.tokens) if r.tokens is not None else (r.text == base.text)


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
        "repeats": cfg.repeats,
        "datasets": list(cfg.datasets),
        "template": cfg.template,
        "methods": {m: method_named(m).description for m in methods},
        "speculative": [m for m in methods if method_named(m).speculative],
        "llama_cpp": _llama_meta(t, methods),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "timing": "wall time per prompt including prefill" + (
            f", the fastest of {cfg.repeats} runs (passes in mirrored order)" if cfg.repeats > 1 else "")
            + "; speedup = median over prompts of tok/s ratio to raw",
    }


def _llama_meta(t: BenchTarget, methods: list[str]) -> dict[str, Any] | None:
    """Which llama.cpp build and draft files the llama.cpp-* methods used (None if none ran)."""
    if not any(m.startswith(("llama.cpp", "llama-server")) for m in methods):
        return None
    from .llama_server import tools_dir

    info = tools_dir() / "BUILD_INFO"
    return {"tools": str(tools_dir()), "build": info.read_text().splitlines() if info.is_file() else None,
            "draft_model": t.llama_draft_model.name if t.llama_draft_model else None,
            "eagle3_gguf": t.eagle3_gguf.name if t.eagle3_gguf else None, "extra_args": list(t.llama_args)}


__all__ = ["METHODS", "Method", "register", "BenchConfig", "BenchContext", "run_bench", "load_dataset",
           "BenchResult", "PromptRecord", "DATASETS", "Dataset", "MethodUnavailable"]
