"""One batched engine for many sequences: slots in one llama.cpp context, one ``llama_decode`` per step.

    slots.py      Slot: one request's sequence (its llama.cpp seq id, prompt, answer, sampling state, kept cells)
    scheduler.py  FIFO admission with a bound and prefix affinity, and the layout of a step's rows
    cost.py       what a step costs by its rows and how often drafts are accepted: speculation priced on the batch
    drafts.py     SlotDrafts: a draft model's weights once, a KV cache and context rows per slot
    step.py       Engine: one step = build the rows -> one llama_decode -> accept each slot's tokens
    prompt_cache.py  free slots' cells kept in host memory, put back for a later prompt that starts alike
    answers.py    AnswerGenerator: answers with every row's hidden state (export-features --regenerate)

The engine runs plain rows, prompt chunks and draft rows (greedy and sampled requests): copies from suffix
matches and, with a draft model, its chains for every slot; every greedy answer equals the same
prompt decoded alone (tested), whatever else shares the steps, and a seeded sampled one is the same drafted
or not.
"""
from __future__ import annotations

from .scheduler import QueueFull, Scheduler
from .slots import Request, Slot
from .cost import Acceptance, StepCost
from .step import Drafting, Engine, StepRecord

__all__ = ["Acceptance", "StepCost", "Drafting", "Engine", "QueueFull", "Request", "Scheduler", "Slot", "StepRecord"]
