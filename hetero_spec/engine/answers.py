"""Answers with the target's hidden states, for training corpora: many prompts through the batched engine.

WHY here: regenerating a corpus (``export-features --regenerate``) is the engine's job (several prompts
per ``llama_decode``, prompt chunks riding beside generating rows), plus the features of every row the
draft will train on.  The engine keeps each request's kept rows (``Request.keep_features``), and the
answer's last token, which generation never decodes, gets one decode of its own when the answer ends.
Every row is bit-identical to ``LlamaTarget``'s prefill of the same text (at most 32 rows a micro-batch,
q8_0 cells, a KV stream per sequence; ``tests/integration/test_converters.py`` checks it).
"""
from __future__ import annotations

from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Sequence

import numpy as np

from ..config import DEFAULT_KV_TYPE, SamplingConfig
from ..errors import TargetError
from ..target.llama_target import BATCH_INVARIANT_ROWS
from ..target.sequences import Row, SequenceOptions, SequenceTarget
from .slots import Request
from .step import Engine


@dataclass(frozen=True)
class GenerateOptions:
    n_seq: int = 8  # sequences decoded together
    max_new_tokens: int = 256
    seq_ctx: int = 2048  # KV cells per sequence (prompt + answer)
    temperature: float = 0.0  # 0 = greedy; else plain temperature sampling (no top-k, top-p or min-p)
    seed: int = 0  # with the prompt's key, the seed of its own random stream
    max_rows: int = BATCH_INVARIANT_ROWS  # rows per micro-batch
    n_threads: int = 0
    hidden: bool = False  # also return every row's final-norm hidden state
    kv_type: str = DEFAULT_KV_TYPE  # as LlamaTarget's, so that regenerated answers equal its greedy ones


class AnswerGenerator:
    """A model in a multi-sequence context; ``generate`` streams (key, answer ids, hidden states or None).

    >>> with AnswerGenerator("model.gguf", GenerateOptions(n_seq=8, hidden=True)) as gen:
    ...     for key, answer, hidden in gen.generate([(0, prompt_ids), (1, other_ids)]):
    ...         ...   # hidden: [len(prompt) + len(answer), n_embd] float32
    """

    def __init__(self, path: str | Path, options: GenerateOptions = GenerateOptions()) -> None:
        self.options = options
        self.target = SequenceTarget(path, SequenceOptions(
            n_seq=options.n_seq, seq_ctx=options.seq_ctx, n_threads=options.n_threads, kv_type=options.kv_type,
            max_rows=options.max_rows, features=options.hidden))
        self.engine = Engine(self.target, max_waiting=options.n_seq)
        self.is_eog = self.target.is_eog
        self.n_embd = self.target.n_embd

    def close(self) -> None:
        self.target.close()

    def __enter__(self) -> "AnswerGenerator":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def generate(self, prompts: Sequence[tuple[int, list[int]]], on_tokens: Callable[[int], None] | None = None
                 ) -> Iterator[tuple[int, list[int], np.ndarray | None]]:
        """prompts: (key, ids) pairs; yields (key, answer ids, hidden) as each finishes (an end-of-generation id
        included).  ``hidden`` is ``[len(ids) + len(answer), n_embd] float32`` with ``options.hidden``, else None.
        ``on_tokens(n)`` is called after every decode with the rows it held (for progress bars)."""
        o = self.options
        for key, ids in prompts:
            if not ids or len(ids) + o.max_new_tokens > o.seq_ctx:
                raise TargetError(f"prompt {key} of {len(ids)} tokens does not fit seq_ctx={o.seq_ctx}")
        requests = [Request(list(ids), o.max_new_tokens, sampling=self._sampling(key), tag=key, keep_features=o.hidden)
                    for key, ids in prompts]
        with closing(self.engine.run(requests)) as steps:  # left early, the requests in flight are dropped
            for record, finished in steps:
                if record is not None and on_tokens is not None:
                    on_tokens(record.rows)
                for req in finished:
                    hidden = self._hidden(req, req.seq) if o.hidden else None
                    yield req.tag, req.out, hidden

    def _sampling(self, key: int) -> SamplingConfig:
        o = self.options
        if o.temperature <= 0:
            return SamplingConfig()
        seed = int(np.random.SeedSequence([o.seed, key]).generate_state(1)[0])  # the prompt's own stream
        return SamplingConfig(temperature=o.temperature, top_k=0, top_p=1.0, min_p=0.0, seed=seed)

    def _hidden(self, req: Request, seq: int) -> np.ndarray:
        """The request's kept rows, then its last token's row, decoded alone where it would have gone."""
        pos = len(req.prompt) + len(req.out) - 1
        self.target.decode([Row(seq, req.out[-1], pos, True)])
        last = self.target.features()
        self.target.keep(seq, pos)
        return np.concatenate(req.features + [last])
