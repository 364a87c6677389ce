"""The stages of ``make-draft``: corpus (with its features), training, the held-out check, the report.

Each stage records itself in ``WORK/state.json`` when it is done, and each is resumable inside:
the corpus in chunks of conversations (``converters.corpus``), training from its checkpoint
(``train/loop.py``).  A rerun skips the finished stages and continues the unfinished one.

Under torchrun (``WORLD_SIZE`` > 1) rank 0 makes the corpus while the other ranks wait for it in the
shared work folder; every rank trains (DDP); rank 0 alone checks and reports.
"""
from __future__ import annotations

import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import click

from .. import atomic_file
from ..errors import HeteroSpecError
from .plan import Plan, State, part_kind

N_SEQ = 16  # conversations decoded together (the recipe's --n-seq)
CHAIN = 4  # the chain length the check measures and the trainer's held-out estimate is for
CHECK_TOKENS = 128  # new tokens per check prompt (the bench's default)
CHECK_PROMPTS_PER_SET = 20  # at most, per shipped bench set
MIN_PART_S = 60.0  # a corpus part re-measures the generation rate at least this often
SELF_ATTEMPTS = 3  # samples drawn at most per request asked of the target (SmolLM2 kept about 3 in 4)


@dataclass(frozen=True)
class Paths:
    """Where everything goes: the work folder, and OUT with its report beside it."""

    work: Path
    out: Path

    @property
    def plan(self) -> Path:
        return self.work / "plan.json"

    @property
    def state(self) -> Path:
        return self.work / "state.json"

    @property
    def corpus(self) -> Path:
        return self.work / "corpus"

    @property
    def draft(self) -> Path:  # the trainer's output; OUT.train/ of train() is draft.train/ here
        return self.work / "draft.safetensors"

    @property
    def report_json(self) -> Path:
        return self.out.with_suffix(".report.json")

    @property
    def report_png(self) -> Path:
        return self.out.with_suffix(".report.png")


def say(msg: str) -> None:
    """Stage messages go to stderr beside the progress bars (stdout stays for the summary)."""
    click.echo(msg, err=True)


# ---------------------------------------------------------------------------------------------- corpus
def corpus_stage(plan: Plan, paths: Paths, state: State, progress: bool = True) -> None:
    """The target's own greedy answers, with features and taps from the same decodes: first to ShareGPT
    conversations (two turns, as the shipped recipe; decontaminated against the bench sets), then to
    requests it writes itself (``plan.self_prompts`` of the budget, and whatever a source that ran out left).

    WHY in parts: the budget is time, and how many conversations an hour buys depends on the model and
    the machine.  Each part is a complete ``generate_corpus`` folder: of the source, over the next slice of
    one shuffle (``offset``/``limit``); of the target's own requests, over prompts sampled for it.  The
    first part of each kind is a small probe, each next one is sized from the rate measured so far to
    fill at most a quarter of that kind's budget, and parts stop when it is spent.  A part is recorded
    before it starts, so a rerun resumes that very part."""
    from tqdm import tqdm

    from converters.datasets import load_source, resolve_source

    st = state.stage("corpus")
    parts: list[dict] = st.setdefault("parts", [])
    if st["done"]:
        say(f"corpus: done ({_conversations(parts)} conversations), skipped")
        return
    n_source = len(load_source(resolve_source(plan.source)).conversations)
    budget = plan.budget.corpus_s
    spent = sum(p["seconds"] for p in parts)
    bar = tqdm(total=round(budget), initial=min(round(spent), round(budget)), unit="s", desc="corpus budget",
               dynamic_ncols=True, disable=not progress, position=0)
    try:
        while True:
            if not parts or parts[-1]["done"]:
                part = _next_part(plan, parts, n_source)
                if part is None:
                    break
                parts.append(part)
                state.save()
            part = parts[-1]
            t0 = time.perf_counter()
            try:
                counts = _make_part(plan, paths, part, progress)
            finally:  # an interrupted part's time still counts against the budget
                dt = time.perf_counter() - t0
                part["seconds"] += dt
                spent += dt
                bar.update(min(round(spent), round(budget)) - bar.n)
                state.save()
            part.update(done=True, **counts)
            state.save()
    finally:
        bar.close()
    if not _conversations(parts):
        raise HeteroSpecError(f"the corpus budget ({budget:.0f} s) produced no conversations; give more --hours")
    st.update(done=True, seconds=round(spent, 1))
    state.save()
    own = _conversations([p for p in parts if part_kind(p) == "self"])
    looped = f"; {looped_turns(paths, parts)} turns ended in a loop" if plan.stop_loops else ""
    say(f"corpus: {_conversations(parts)} conversations" + (f" ({own} on requests the model wrote)" if own else "")
        + f", {sum(p.get('tokens', 0) for p in parts)} tokens in {spent / 60:.1f} min{looped}")


def looped_turns(paths: Paths, parts: list[dict]) -> int:
    """Answer turns the corpus ended in a repetition loop (``generate-corpus --stop-loops``), as each part's
    manifest counts them (a part with nothing to answer has none)."""
    import json

    manifests = (paths.corpus / p["dir"] / "manifest.json" for p in parts)
    return sum(json.loads(m.read_text())["counts"].get("stopped_in_loop", 0) for m in manifests if m.is_file())


def _next_part(plan: Plan, parts: list[dict], n_source: int) -> dict | None:
    """The next part: of the source while its share of the budget lasts, then of the target's own requests
    for the rest (when ``plan.self_prompts`` gives them a share, or the source ran out of conversations before
    its share was spent); None when the corpus is complete."""
    source = [p for p in parts if part_kind(p) == "source"]
    own = [p for p in parts if part_kind(p) == "self"]
    budget = plan.budget.corpus_s
    if not own:
        left_s = budget * (1 - plan.self_prompts) - _seconds(source)
        part = _next_source_part(plan, source, left_s, n_source)
        ran_out = bool(source) and source[-1]["offset"] + source[-1]["limit"] >= n_source and left_s > 0
        if part is not None or not (plan.self_prompts or ran_out):
            return part
    return _next_self_part(own, budget - _seconds(parts), budget - _seconds(source), len(parts))


def _seconds(parts: list[dict]) -> float:
    return sum(p["seconds"] for p in parts)


def _sized(parts: list[dict], counted: str, remaining_s: float, quarter_s: float) -> int:
    """How many to ask of the next part: the rate of ``counted`` per second so far, over at most a quarter of
    the kind's budget (and at least ``MIN_PART_S``), within what remains."""
    rate = sum(p[counted] for p in parts) / max(1e-6, _seconds(parts))
    return int(rate * min(remaining_s, max(MIN_PART_S, quarter_s)))


def _next_source_part(plan: Plan, parts: list[dict], remaining_s: float, n_source: int) -> dict | None:
    """The next slice of the source's shuffle, sized to the rate measured so far; None when its budget, the
    source or ``max_conversations`` is spent.  (Source parts come first, so ``len(parts)`` numbers the next.)"""
    offset = parts[-1]["offset"] + parts[-1]["limit"] if parts else 0
    left = n_source - offset
    if plan.max_conversations:
        left = min(left, plan.max_conversations - offset)
    if left <= 0 or remaining_s <= 0:
        return None
    if not parts:
        size = 2 * N_SEQ  # a probe: enough rows decoded together to measure the bulk rate
    else:
        size = _sized(parts, "limit", remaining_s, plan.budget.corpus_s * (1 - plan.self_prompts) / 4)
        if size < N_SEQ // 2:  # less than half a batch fits: the source's share ends here
            return None
    return dict(dir=f"part-{len(parts):03d}", offset=offset, limit=min(size, left), done=False, seconds=0.0)


def _next_self_part(parts: list[dict], remaining_s: float, kind_s: float, index: int) -> dict | None:
    """The next batch of requests the target writes itself, ``kind_s`` being the time the source left them; the
    first (a probe) always runs, so that a budget the source overran still measures the kind.  None when the
    budget is spent, or when the last part kept no request (the model does not write any it ends in time)."""
    if parts and not parts[-1].get("conversations"):
        return None
    if not parts:
        size = 2 * N_SEQ
    else:
        size = _sized(parts, "conversations", remaining_s, kind_s / 4)
        if size < N_SEQ // 2:
            return None
    return dict(dir=f"part-{index:03d}", kind="self", seed=len(parts), limit=size, done=False, seconds=0.0)


def _make_part(plan: Plan, paths: Paths, part: dict, progress: bool) -> dict:
    """Generate one part (resuming it) and return its counts (with, for the model's own requests, the samples
    drawn)."""
    from converters.corpus import CorpusConfig, generate_corpus

    extra: dict = {}
    if part_kind(part) == "self":
        requests, extra["sampled"] = _own_requests(plan, paths.corpus / f"{part['dir']}.prompts", part, progress)
        if requests is None:
            return dict(conversations=0, tokens=0, assistant_tokens=0, **extra)
        which = dict(source=str(requests), turns=1)
    else:
        which = dict(source=plan.source, limit=part["limit"], offset=part["offset"], seed=0, turns=2)
    cfg = CorpusConfig(model=Path(plan.model), out=paths.corpus / part["dir"], **which,
                       max_new_tokens=plan.max_new_tokens, n_seq=N_SEQ, threads=plan.threads,
                       chunk=min(part["limit"], 256), features=True, taps=plan.taps, stop_loops=plan.stop_loops)
    c = generate_corpus(cfg, progress=progress)["counts"]
    return dict(conversations=c["conversations"], tokens=c["tokens"], assistant_tokens=c["assistant_tokens"], **extra)


def _own_requests(plan: Plan, folder: Path, part: dict, progress: bool) -> tuple[Path | None, int]:
    """``part['limit']`` requests written by the target (Magpie, ``converters/self_prompts.py``), split over
    ``SELF_TOPICS``, into one JSONL for ``generate_corpus`` (None when it kept none), and the samples drawn.
    Each topic's file resumes on its own; a request the model does not end within the sampler's token cap is
    dropped, and at most ``SELF_ATTEMPTS`` samples per request asked are drawn."""
    from converters.self_prompts import PromptConfig, make_prompts

    from .plan import SELF_TOPICS

    folder.mkdir(parents=True, exist_ok=True)
    lines: list[str] = []
    sampled = 0
    for t, (topic, share, system) in enumerate(SELF_TOPICS):
        n = max(1, round(part["limit"] * share))
        cfg = PromptConfig(model=Path(plan.model), out=folder / f"{topic}.jsonl", n=n,
                           seed=len(SELF_TOPICS) * part["seed"] + t, system=system, threads=plan.threads)
        sampled += make_prompts(cfg, progress=progress, max_attempts=SELF_ATTEMPTS * n)["attempts"]
        if cfg.out.is_file():
            lines += cfg.out.read_text().splitlines()
    if not lines:
        return None, sampled
    out = folder / "requests.jsonl"
    atomic_file.write_text(out, "".join(line + "\n" for line in lines))
    return out, sampled


def _conversations(parts: list[dict]) -> int:
    return sum(p.get("conversations", 0) for p in parts)


def feature_dirs(paths: Paths, state: State) -> list[Path]:
    """The corpus parts' feature folders (a part whose conversations were all skipped has none)."""
    parts = state.stage("corpus").get("parts", [])
    return [paths.corpus / p["dir"] / "features" for p in parts
            if p.get("conversations") and (paths.corpus / p["dir"] / "features" / "manifest.json").is_file()]


# -------------------------------------------------------------------------------------------- training
def train_stage(plan: Plan, paths: Paths, state: State, rank: int, progress: bool = True) -> dict:
    """The shipped darter's recipe (``plan.train``) on every corpus part, for the training budget;
    resumes from ``draft.train/checkpoint.pt``.  Under torchrun every rank runs this (DDP)."""
    from ..train.losses import LossWeights
    from ..train.loop import TrainConfig, train
    from ..train_cli import _target_parts

    st = state.stage("train")
    if st["done"]:
        if rank == 0:
            say(f"training: done ({st['summary']['steps']} steps), skipped")
        return st["summary"]
    dirs = feature_dirs(paths, state)
    options = {**plan.train, "taps": tuple(plan.train["taps"])}
    # the loss weighting lives in the plan since step_decay 0.5 became the recipe's; older plans trained with 0.8
    loss = LossWeights(step_decay=options.pop("step_decay", LossWeights.step_decay))
    cfg = TrainConfig(**options, loss=loss, device=plan.device)
    if rank == 0:
        say(f"training: {cfg.variant}, {len(dirs)} corpus parts, {cfg.time_budget_s / 60:.1f} min on "
            f"{plan.device}" + (f", taps {','.join(map(str, cfg.taps))}" if cfg.taps else ", no taps"))
    fp, emb, head = _target_parts(Path(plan.model))
    summary = train(cfg, dirs, paths.draft, embedding=emb, head=head, fingerprint=fp, resume=True,
                    progress=progress)
    if rank != 0:
        return summary
    if summary.get("stopped_by"):
        raise _Stopped(summary["stopped_by"], summary["steps"])
    st.update(done=True, summary={k: v for k, v in summary.items() if k != "config"})
    state.save()
    return st["summary"]


class _Stopped(Exception):
    """Training was stopped by a signal after saving its checkpoint; the command exits 128 + signal."""

    def __init__(self, signal_name: str, steps: int) -> None:
        super().__init__(signal_name)
        self.signal_name, self.steps = signal_name, steps


# --------------------------------------------------------------------------------------- the check
def check_stage(plan: Plan, paths: Paths, state: State, progress: bool = True) -> dict:
    """The draft as ``run`` runs it, on the shipped bench prompts (which the corpus was decontaminated
    against): a fixed chain of ``CHAIN``, no prompt lookup, greedy; every round's drafted and accepted
    counts per set, round-robin over the sets until the check budget is spent."""
    from tqdm import tqdm

    from ..api import HeteroSpec
    from ..bench.prompts import DATASETS, bench_prompts
    from ..errors import ContextFull

    st = state.stage("check")
    if st["done"]:
        say(f"held-out check: done ({st['prompts']} prompts), skipped")
        return st
    sets = {name: [p for p in bench_prompts(name, CHECK_PROMPTS_PER_SET) if isinstance(p, str)] for name in DATASETS}
    queue = [(name, ps[i]) for i in range(CHECK_PROMPTS_PER_SET) for name, ps in sets.items() if i < len(ps)]
    rounds: dict[str, list[list[int]]] = {name: [] for name in sets}
    budget, t0, done = plan.budget.check_s, time.perf_counter(), 0
    bar = tqdm(total=len(queue), unit="prompt", desc="held-out check", dynamic_ncols=True, disable=not progress)
    with HeteroSpec(plan.model, paths.draft, n_ctx=4096, threads=plan.threads, draft_device=plan.device) as hs:
        for name, prompt in queue:
            elapsed = time.perf_counter() - t0
            if done >= len(sets) and elapsed >= budget:  # every set measured at least once
                break
            hs.reset()
            try:
                c = hs.chat([{"role": "user", "content": prompt}], max_new_tokens=min(CHECK_TOKENS, plan.max_new_tokens),
                            draft_len=CHAIN, lookup=False, suffix=False)
            except ContextFull:
                continue
            rounds[name] += [[r.drafted, r.accepted] for r in c.stats.rounds if r.source == "draft"]
            done += 1
            per_prompt = (time.perf_counter() - t0) / done
            bar.total = min(len(queue), max(done, done + int(max(0.0, budget - (time.perf_counter() - t0)) / per_prompt)))
            bar.update(1)
    bar.close()
    st.update(done=True, prompts=done, rounds=rounds, seconds=round(time.perf_counter() - t0, 1))
    state.save()
    return st


# ------------------------------------------------------------------------------------------ output
def publish(paths: Paths, report: dict) -> None:
    """OUT and its report, each renamed into place whole (the plot was written by ``report.plot``)."""
    import json

    with atomic_file.replacing(paths.out) as tmp:
        shutil.copyfile(paths.draft, tmp)
    atomic_file.write_text(paths.report_json, json.dumps(report, indent=2))
