"""User prompts written by the target itself (Magpie), as a corpus source for `generate-corpus`.

WHY: a draft learns what its target writes, and the prompts decide what that is.  ShareGPT's
prompts are ChatGPT users' and leave whole kinds of request thin, and a user training a draft
for their own model may have no dataset at all.  An instruction-tuned model given its chat
template up to where a user's words start, and nothing else, writes a user's request from its
own instruction distribution (Xu et al., 2024, "Magpie").  Sampled here, filtered, deduplicated,
and written as ShareGPT-style JSONL, which `generate-corpus --source` answers greedily.

Resumable: ``OUT.progress.json`` records the attempts made and the prompts kept; attempt i is
sampled with its own seed, so a resumed run writes what an uninterrupted one would.
"""
from __future__ import annotations

import json
import os
from collections import Counter
from contextlib import closing
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
from tqdm import tqdm

from hetero_spec import atomic_file
from hetero_spec.config import DEFAULT_KV_TYPE, SamplingConfig
from hetero_spec.errors import HeteroSpecError

from .datasets import ChatRenderer
from .decontaminate import _words

_MARK = "\u2063HETERO_SPEC_QUERY\u2063"  # stands for the user's words while the template renders
# where a base model (the plain template) ends a user's turn and starts the next speaker's
PLAIN_STOPS = ("\n\nAssistant:", "\nAssistant:", "\n\nUser:")


class PromptError(HeteroSpecError):
    pass


@dataclass(frozen=True)
class PromptConfig:
    model: Path
    out: Path  # .jsonl
    n: int  # prompts to keep
    seed: int = 0
    temperature: float = 1.0
    top_p: float = 0.95
    max_tokens: int = 128  # a request that does not end by then is dropped ("unfinished")
    system: str = ""  # a system message before the user turn (steers the topic), "" = none
    template: str = "gguf"
    threads: int = 0
    n_seq: int = 16  # requests sampled together (what is written does not depend on it)

    def recipe(self) -> dict:
        """What must match for a resume to continue the same sequence of prompts."""
        d = asdict(self)
        d["model"] = Path(self.model).name
        del d["out"], d["threads"], d["n"], d["n_seq"]
        return d


def query_prefix(renderer: ChatRenderer, system: str = "") -> str:
    """The rendered conversation up to where a user's first words go."""
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": _MARK}]
    text = renderer.render(messages, generation_prompt=False)
    if _MARK not in text:
        raise PromptError("the chat template does not render the user's message verbatim; cannot find where it starts")
    return text[: text.index(_MARK)]


def rejection(text: str, finished: bool, seen: set[str]) -> str | None:
    """Why a sampled request is not kept (None: keep it)."""
    if not finished:
        return "unfinished"
    words = _words(text)
    if len(words) < 3:
        return "short"
    if len(words) >= 12 and len(set(words)) < 0.4 * len(words):
        return "repetitive"
    if " ".join(words) in seen:
        return "duplicate"
    return None


def make_prompts(cfg: PromptConfig, progress: bool = True, max_attempts: int = 0) -> dict:
    """Sample until ``cfg.n`` prompts are kept (or resume towards it); returns the progress record.

    ``max_attempts`` (0: no limit) also stops after that many samples in all, kept or not: a caller with a
    time budget (``make-draft``) must not wait on a model that rarely ends a request (a base model, random
    weights)."""
    out = Path(cfg.out)
    state_path = out.with_name(out.name + ".progress.json")
    state = _resume(cfg, out, state_path)
    seen = {" ".join(_words(json.loads(line)["conversations"][0]["value"]))
            for line in out.read_text().splitlines()} if out.exists() else set()

    def more() -> bool:
        return state["kept"] < cfg.n and not (max_attempts and state["attempts"] >= max_attempts)

    if not more():
        return state
    prefix = request_prefix(cfg)  # a model without a template is refused before the file is touched
    bar = tqdm(total=cfg.n, initial=state["kept"], unit="prompt", disable=not progress, desc="sampling prompts")
    with out.open("a") as fh:
        # every attempt still to come may be in flight; those past the last one used are dropped unread
        draws = sample_requests(cfg, prefix, state["attempts"], max_attempts or None,
                                lambda: 2 * (cfg.n - state["kept"]))
        try:
            for attempt, text, finished in draws:
                why = rejection(text, finished, seen)
                state["attempts"] = attempt + 1
                if why:
                    state["dropped"][why] = state["dropped"].get(why, 0) + 1
                else:
                    seen.add(" ".join(_words(text)))
                    record = {"id": f"self-{cfg.seed}-{attempt}", "conversations": [{"from": "human", "value": text}]}
                    fh.write(json.dumps(record, ensure_ascii=False) + "\n")
                    fh.flush()
                    os.fsync(fh.fileno())
                    state["kept"] += 1
                    bar.update(1)
                _write_state(state_path, state)
                bar.set_postfix(attempts=state["attempts"])
                if not more():
                    break
        finally:
            draws.close()
    bar.close()
    return state


def request_prefix(cfg: PromptConfig) -> list[int]:
    """The token ids every request is sampled after: the rendered conversation up to a user's first words."""
    from hetero_spec.target.llama_target import LlamaTarget, TargetOptions

    with LlamaTarget(cfg.model, TargetOptions(n_ctx=256, n_threads=1, embeddings=False)) as vocab:
        renderer = ChatRenderer.for_target(vocab, cfg.template)
        return renderer.tokenize(query_prefix(renderer, cfg.system))


def sample_requests(cfg: PromptConfig, prefix: list[int], first: int, stop: int | None, ahead: Callable[[], int]
                    ) -> Iterator[tuple[int, str, bool]]:
    """(attempt, request text, whether it ended) for attempts ``first``, ``first + 1``, ... (up to ``stop``),
    in that order, each sampled after ``prefix``, ``cfg.n_seq`` at a time on the batched engine.

    WHY the engine: a sample is one sequence's row per decode, and a decode reads the weights once for all
    its rows, so several requests sample for little more than one.  Attempt i draws from its own seeded
    generator and its rows give the logits they would alone (the engine's exactness: at most the file's
    exact rows a micro-batch, a KV stream per sequence), so what it writes does not depend on ``n_seq``, and
    a resumed run draws what an uninterrupted one would.  Every attempt starts from the same prefix, which
    the slots keep from the one before.  At most ``ahead()`` attempts (at least ``n_seq``) are in flight
    beyond those handed back; closing the iterator drops the rest."""
    from hetero_spec.engine import Engine, Request
    from hetero_spec.target.invariance import exact_micro_batch
    from hetero_spec.target.llama_target import BATCH_INVARIANT_ROWS
    from hetero_spec.target.sequences import SequenceOptions, SequenceTarget

    stops = PLAIN_STOPS if cfg.template == "plain" else ()
    rows = min(exact_micro_batch(cfg.model, threads=cfg.threads, kv_type=DEFAULT_KV_TYPE), BATCH_INVARIANT_ROWS)
    options = SequenceOptions(n_seq=cfg.n_seq, seq_ctx=max(16, len(prefix) + cfg.max_tokens + 1),
                              n_threads=cfg.threads, kv_type=DEFAULT_KV_TYPE, max_rows=rows)
    with SequenceTarget(cfg.model, options) as target:
        nxt, want = first, first  # the next attempt to submit, and to hand back (those between are in flight)

        def attempts() -> Iterator[Request | None]:
            nonlocal nxt
            while stop is None or nxt < stop:
                if nxt - want >= max(cfg.n_seq, ahead()):
                    yield None  # enough in flight: ask again after the next step
                    continue
                seed = int(np.random.SeedSequence([cfg.seed, nxt]).generate_state(1)[0])
                yield Request(list(prefix), cfg.max_tokens, tag=nxt, sampling=SamplingConfig(
                    temperature=cfg.temperature, top_p=cfg.top_p, seed=seed))
                nxt += 1

        engine = Engine(target, max_waiting=cfg.n_seq)
        done: dict[int, Request] = {}
        with closing(engine.run(attempts())) as steps:  # closed early, the attempts in flight are dropped
            for _, finished in steps:
                for req in finished:
                    done[req.tag] = req
                if stops:  # a base model's request ends where its next speaker starts
                    for slot in engine.scheduler.active:
                        if any(s in target.detokenize(slot.request.out) for s in stops):
                            slot.request.cancelled = True
                while want in done:
                    req = done.pop(want)
                    text = target.detokenize([t for t in req.out if not target.is_eog(t)])
                    cut = min((text.index(s) for s in stops if s in text), default=-1)
                    yield want, (text[:cut] if cut >= 0 else text).strip(), cut >= 0 or req.stop_reason == "eog"
                    want += 1


def _resume(cfg: PromptConfig, out: Path, state_path: Path) -> dict:
    """The saved progress (the JSONL cut back to the prompts it records), or a fresh start."""
    if not state_path.exists():
        if out.exists() and out.stat().st_size:
            raise PromptError(f"{out} exists without {state_path.name}; choose a new file or remove it")
        return {"recipe": cfg.recipe(), "attempts": 0, "kept": 0, "dropped": {}}
    state = json.loads(state_path.read_text())
    if state.get("recipe") != cfg.recipe():
        diff = sorted(k for k in cfg.recipe() if state.get("recipe", {}).get(k) != cfg.recipe()[k])
        raise PromptError(f"{out} was sampled with other settings ({', '.join(diff)}); use a new file to change them")
    lines = out.read_text().splitlines(keepends=True) if out.exists() else []
    if len(lines) < state["kept"]:
        raise PromptError(f"{out} holds {len(lines)} prompts but its progress file records {state['kept']}")
    if len(lines) > state["kept"] or (lines and not lines[-1].endswith("\n")):
        atomic_file.write_text(out, "".join(lines[: state["kept"]]))  # a line written just before the progress file: redone
    return state


def _write_state(path: Path, state: dict) -> None:
    atomic_file.write_text(path, json.dumps(state, indent=1))


def summary_line(out: Path, state: dict) -> str:
    dropped = Counter(state["dropped"])
    why = ", ".join(f"{k} {v}" for k, v in sorted(dropped.items())) or "none"
    return (f"{out}: {state['kept']} prompts from {state['attempts']} samples (dropped: {why}); "
            f"answer them with: hetero-spec generate-corpus MODEL DIR --source {out} --turns 1")
