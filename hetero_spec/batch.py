"""Many prompts in, texts out: the batched engine behind ``serve --parallel``, for offline jobs in apps.

``HeteroSpec`` holds one conversation and decodes one sequence at a time; a job that labels ten
thousand rows wants every step to carry several of them instead (a decode reads the weights once for
all its rows), with the same answers it would get one by one.

>>> with BatchGenerator("SmolLM2-135M-Instruct.Q4_0.gguf", slots=4) as bg:
...     outs = bg.chat([[{"role": "user", "content": q}] for q in questions], max_new_tokens=64)
>>> outs[0].text, outs[0].stop_reason

With a draft file, the draft model drafts for every slot (``engine/drafts.py``), as deep as
pays on the whole batch.
"""
from __future__ import annotations

import threading
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from .chat_template import render_chat
from .config import DEFAULT_CACHE_RAM_MIB, DEFAULT_KV_TYPE, MIN_CTX, SamplingConfig, check_threads
from .engine import Drafting, Engine, Request
from .engine.prompt_cache import PromptCache
from .errors import HeteroSpecError
from .inputs import check_messages, count, token_ids
from .target.invariance import exact_micro_batch
from .target.llama_target import BATCH_INVARIANT_ROWS
from .target.sequences import SequenceOptions

COPY_DEPTH = 16  # longest copy-draft chain a slot verifies in a step (as the server's)
DRAFT_DEPTH = 4  # longest draft-model chain (as the server's)


@dataclass
class BatchCompletion:
    """One prompt's answer: its text, token ids (a final end-of-generation id included), why it stopped,
    and how many draft rows were verified for it and accepted."""

    text: str
    tokens: list[int]
    stop_reason: str
    drafted: int
    accepted: int


class BatchGenerator:
    """A GGUF target with ``slots`` sequences in one context; ``generate``/``chat`` answer lists of prompts.

    Greedy answers are bit for bit those of decoding each prompt alone (``tests/integration/test_engine.py``);
    ``drafts``: copy drafts (suffix matches over the prompt, the answer and earlier answers of the job) and,
    with a draft file, the draft model's chains, priced on the batch; a seeded sampled answer draws the
    same tokens as alone."""

    def __init__(self, model: str | Path, draft: str | Path | None = None, *, slots: int = 4, n_ctx: int = 4096,
                 threads: int = 0, kv_type: str = DEFAULT_KV_TYPE, drafts: bool = True, draft_device: str = "auto",
                 draft_dtype: str = "auto", cache_ram_mib: int = DEFAULT_CACHE_RAM_MIB) -> None:
        """``draft``: a draft file for ``model`` (its chains verified beside the copies); ``drafts`` False: no
        draft rows of any kind; ``cache_ram_mib``: host memory for the cells of past prompts and answers, put back
        for a later prompt that starts alike (the next turns of many conversations; ``engine/prompt_cache.py``;
        0: off)."""
        from .engine.drafts import open_slots

        slots, n_ctx, threads = count("slots", slots), count("n_ctx", n_ctx, MIN_CTX), check_threads(threads)
        for path in (model, draft):
            if path is not None and not Path(path).is_file():
                raise HeteroSpecError(f"no such file: {path}")
        draft = draft if drafts else None
        self._lock = threading.Lock()  # one job at a time: two threads in one llama_decode abort the process
        rows = min(exact_micro_batch(model, threads=threads, kv_type=kv_type), BATCH_INVARIANT_ROWS)
        self.target, slot_drafts = open_slots(model, draft, SequenceOptions(
            n_seq=slots, seq_ctx=n_ctx, n_threads=threads, kv_type=kv_type, max_rows=rows),
            device=draft_device, dtype=draft_dtype)
        try:  # the target is closed if anything below fails
            drafting = Drafting(lookup_depth=COPY_DEPTH if drafts else 0, draft_depth=DRAFT_DEPTH if draft else 0)
            self.engine = Engine(self.target, max_waiting=slots, drafting=drafting, draft=slot_drafts,
                                 prompt_cache=PromptCache(cache_ram_mib << 20) if cache_ram_mib else None)
            if drafts:  # the step prices kept for this machine, model and layout, or measured once (seconds)
                self.engine.calibrate(cached=True)
        except BaseException:
            self.target.close()
            raise

    def close(self) -> None:
        self.target.close()

    def __enter__(self) -> "BatchGenerator":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def chat(self, conversations: list[list[dict[str, str]]], **options) -> list[BatchCompletion]:
        """Each conversation through the GGUF's chat template, answered as ``generate`` does."""
        t = self.target
        if not isinstance(conversations, list):
            raise HeteroSpecError(f"conversations must be a list of conversations, not {type(conversations).__name__}")
        texts = [render_chat(t.chat_template, check_messages(msgs, f"conversations[{i}]"), bos_token=t.bos_token,
                             eos_token=t.eos_token) for i, msgs in enumerate(conversations)]
        return self.generate([t.tokenize(text, add_special=False, parse_special=True) for text in texts], **options)

    def generate(self, prompts: list[str] | list[list[int]], *, max_new_tokens: int = 256, temperature: float = 0.0,
                 seed: int = 0, progress: bool = True) -> list[BatchCompletion]:
        """Answers in prompt order; text prompts get a BOS, token-id prompts go in as given.  Prompts enter the
        slots as they free up, oldest first; a progress bar counts finished prompts.  Every prompt is checked
        before any is decoded; after an error or a Ctrl-C mid-job the generator is ready for the next call."""
        t = self.target
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, (list, tuple)):
            raise HeteroSpecError(f"prompts must be a list of prompts (for one, [prompt]), not {type(prompts).__name__}")
        ids = [t.tokenize(p, add_special=True, parse_special=True) if isinstance(p, str)
               else token_ids(p, t.n_vocab, f"prompt {i}") for i, p in enumerate(prompts)]
        for i, p in enumerate(ids):
            if not p or len(p) >= t.seq_ctx:
                raise HeteroSpecError(f"prompt {i} has {len(p)} tokens; a slot holds 1..{t.seq_ctx - 1}")
        max_new_tokens = count("max_new_tokens", max_new_tokens)
        sampling = SamplingConfig(temperature=temperature, seed=seed)
        requests = [Request(p, max_new_tokens, sampling=sampling, tag=i) for i, p in enumerate(ids)]
        if not self._lock.acquire(blocking=False):
            raise HeteroSpecError("this BatchGenerator is running a job on another thread: one job at a time (a job "
                                  "takes any number of prompts)")
        try:  # a job that fails or is interrupted drops its requests (Engine.run), so the next job starts clean
            with tqdm(total=len(requests), desc="prompts", unit="prompt", disable=not progress) as bar, \
                    closing(self.engine.run(requests)) as steps:
                for _, finished in steps:
                    bar.update(len(finished))
        finally:
            self._lock.release()
        return [BatchCompletion(t.detokenize([x for x in r.out if not t.is_eog(x)]), r.out, r.stop_reason or "",
                                r.drafted, r.accepted) for r in requests]
