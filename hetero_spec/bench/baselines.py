"""The runs a bench compares: baselines on llama.cpp and hetero-spec through its public API.

Every run starts from an empty KV cache (no prefix reuse between prompts, for anyone),
decodes greedily, uses the same threads and micro-batches of 32 rows (the
batch-invariant size, so the same tokens give bit-identical logits on every path), and
returns a ``RunResult``.  Wall time includes the prompt's prefill: that is what a user
waits for, and speculative methods pay extra there (every prompt row is an output).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from ..config import DEFAULT_KV_TYPE, TreeSpec
from ..target.llama_target import kv_type_id
from ..records import Round


@dataclass(frozen=True)
class RunResult:
    text: str  # generated text, end-of-generation tokens not rendered
    new_tokens: int  # generated ids, a final end-of-generation id included
    wall_s: float  # prefill + decode
    tokens: list[int] | None = None  # generated ids where the API exposes them
    prefill_s: float | None = None  # time to the first generated token, where known
    stats: dict[str, Any] | None = None  # RunStats.to_dict() for hetero-spec runs
    rounds: tuple[Round, ...] = ()
    engine: dict[str, Any] | None = None  # an external engine's own report (llama-server timings, drafts)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_s if self.wall_s > 0 else 0.0


class Runner(Protocol):
    def run(self, prompt: list[int], max_new_tokens: int) -> RunResult: ...
    def close(self) -> None: ...


@dataclass(frozen=True)
class BenchTarget:
    """What every run shares: the files, threads and context size."""

    model: Path
    draft: Path | None
    threads: int
    n_ctx: int
    k: int = 3
    draft_device: str = "cpu"
    draft_dtype: str = "auto"
    lookup_tokens: int = 2  # llama-cpp-python's advice for CPU-only machines (10 is its GPU default)
    tree: TreeSpec = TreeSpec()  # the shape of the ``tree`` method (the bounds of ``auto-tree``)
    kv_type: str = DEFAULT_KV_TYPE  # every method's KV cells, so that all compute the same numbers
    llama_draft_model: Path | None = None  # a draft GGUF for llama.cpp-draft (llama.cpp's classic speculation)
    eagle3_gguf: Path | None = None  # an EAGLE-3 draft GGUF for llama.cpp-eagle3
    llama_args: tuple[str, ...] = ()  # extra llama-server arguments for every llama.cpp-* method


class RawRun:
    """Method (1), the baseline: ``RawGreedy``, the plainest loop on the low-level API.

    It runs on hetero-spec's own llama.cpp context (embeddings off, cache cleared), so that
    the two differ only in the loop.  Two identically configured contexts differed by up to
    8% in per-token time (measured on SmolLM2 Q4_0, 2 threads, 14 interleaved repeats: 3.93
    against 4.24 ms), consistently for the life of the contexts, from where their buffers
    happened to land; with separate contexts that draw decided a ratio near 1."""

    def __init__(self, hs) -> None:
        from ..target.raw_loop import RawGreedy

        self.target = hs.target
        self.loop = RawGreedy(hs.target._model, n_ctx=hs.target.n_ctx, n_threads=hs.target.n_threads,
                              ctx=hs.target._ctx)

    def run(self, prompt: list[int], max_new_tokens: int) -> RunResult:
        self.target.reset()  # the loop clears the cells; the target's record of them must agree
        self.target.set_embeddings(False)
        t0 = time.perf_counter()
        out = self.loop.generate(prompt, max_new_tokens)
        wall = time.perf_counter() - t0
        self.target.reset()
        text = self.target.detokenize([t for t in out if not self.target.is_eog(t)])
        return RunResult(text, len(out), wall, tokens=out, prefill_s=self.loop.last_prefill_s)

    def close(self) -> None:
        self.loop.close()


class LlamaCppRun:
    """Methods (2) and (3): llama-cpp-python's high-level ``create_completion``, optionally with
    its built-in prompt-lookup speculation.  Text only: the completion API returns no ids."""

    def __init__(self, bt: BenchTarget, *, prompt_lookup: bool) -> None:
        import llama_cpp
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        from ..target._ffi import ensure_backend
        from ..target.kernels import applied_plan, extra_bufts_off

        ensure_backend()  # the kernel plan in force before Llama loads (it would take AMX where tiles fault)
        draft = LlamaPromptLookupDecoding(num_pred_tokens=bt.lookup_tokens) if prompt_lookup else None
        with extra_bufts_off(applied_plan()):
            self.llm = llama_cpp.Llama(
                str(bt.model), n_ctx=bt.n_ctx, n_batch=32, n_ubatch=32, n_threads=bt.threads,
                n_threads_batch=bt.threads, draft_model=draft, verbose=False,
                # With a draft model, Llama forces logits for every row but sizes its score buffer
                # from this argument: without it, the first speculative eval overflows the buffer.
                logits_all=prompt_lookup,
                # llama-cpp-python disables flash attention by default while llama.cpp (and so the
                # raw baseline) picks it automatically (on, on CPUs): different attention kernels,
                # different logits, different greedy text on about one prompt in four.  Same kernels here.
                flash_attn=True,
                type_k=kv_type_id(bt.kv_type), type_v=kv_type_id(bt.kv_type),
            )

    def run(self, prompt: list[int], max_new_tokens: int) -> RunResult:
        self.llm.reset()  # no prefix reuse from the previous prompt
        t0 = time.perf_counter()
        out = self.llm.create_completion(prompt, max_tokens=max_new_tokens, temperature=0.0, repeat_penalty=1.0)
        wall = time.perf_counter() - t0
        n = int(out["usage"]["completion_tokens"])
        if out["choices"][0].get("finish_reason") == "stop":
            n += 1  # the end-of-generation token it sampled but does not count
        return RunResult(out["choices"][0]["text"], n, wall)

    def close(self) -> None:
        self.llm.close()


class HeteroSpecRun:
    """Methods (4) and later: ``HeteroSpec.generate`` with the given options (draft_len, ...); prompt lookup rather
    than the suffix structure unless ``suffix=True`` (``SuffixRun``), so no method drafts from the answers the
    other methods left in the shared ``HeteroSpec``'s suffix cache."""

    def __init__(self, hs, **options: Any) -> None:
        self.hs = hs
        self.options = {"suffix": False, **options}

    def run(self, prompt: list[int], max_new_tokens: int) -> RunResult:
        self.hs.reset()  # both KV caches: the prompt is prefilled from scratch
        t0 = time.perf_counter()
        out = self.hs.generate(prompt, max_new_tokens=max_new_tokens, **self.options)
        wall = time.perf_counter() - t0
        s = out.stats
        return RunResult(out.text, len(out.tokens), wall, tokens=list(out.tokens), prefill_s=s.prefill_s,
                         stats=s.to_dict(), rounds=tuple(s.rounds))

    def close(self) -> None:  # the HeteroSpec is shared and closed by the harness
        pass


class SuffixRun(HeteroSpecRun):
    """``HeteroSpecRun`` with the suffix structure and a cache of its own: the outputs of the prompts this
    method ran before, as a server's earlier requests.  A prompt's own earlier output (a warm-up, an
    earlier pass of ``--repeats``) is dropped before it runs, or the cache would hold its answer."""

    def __init__(self, hs, **options: Any) -> None:
        from ..spec.suffix import SuffixCache

        self.cache = SuffixCache()
        super().__init__(hs, suffix=True, suffix_cache=self.cache, **options)

    def run(self, prompt: list[int], max_new_tokens: int) -> RunResult:
        from ..spec.suffix import prompt_key

        self.cache.evict(prompt_key(prompt))
        return super().run(prompt, max_new_tokens)
