"""How many rows one verification may hold and stay bit-identical to plain decoding, checked once per model.

WHY: speculative greedy output equals plain decoding only where a verification of n rows gives each row
the same logits, bit for bit, as n one-row decodes.  llama.cpp's CPU matmuls pick kernels by the row
count, and which ones depends on the tensor types in the file and on the kernel path (repacked or
not, ``kernels.py``): all-Q4_0/Q5_0/Q8_0 files hold to 32 rows, llama-quantize's Q4_0 (a Q6_K head) to
7, a repacked Q4_K_M to 3, float files to 1 (docs/exactness.md).  A user's file is none of the files we
measured, so the runtime measures it: decode a fixed prompt, then n = 2..N rows in one call against
one-row decodes of the same tokens; the largest n before the first difference is ``exact_rows``, and
the policy never verifies more rows than that (``api.HeteroSpec``).  A few seconds on a 135M model,
milliseconds on the tiny ones, and cached per file, CPU, kernel plan, llama.cpp build and thread count,
like the kernel probe.

``--exact`` (``exact_requantization``): the nearest requantization whose rows are invariant to the
runtime's widest verification, made once and cached next to the other derived models.
"""
from __future__ import annotations

import hashlib
import json
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from .. import atomic_file

if TYPE_CHECKING:
    from .llama_target import LlamaTarget

CHECK_VERSION = 1  # bump when the procedure changes: the cache key
# Plain text that every tokenizer splits into many tokens; its first tokens are the prompt, the next the rows.
CHECK_TEXT = ("The farmer sold sixteen eggs at the market on Tuesday, kept three for breakfast, baked muffins with"
              " four more and gave the rest away to neighbours who asked politely for them every single morning"
              " of the long and busy week ahead, and then the answer is forty two because nine times seven is"
              " sixty three, minus twenty one.  def fib(n): return n if n < 2 else fib(n - 1) + fib(n - 2)")
PROMPT_TOKENS = 8  # rows decoded before the check: enough for attention to have a past
RETRY_WINDOWS = 8  # more windows for each row count below the first difference


@dataclass(frozen=True)
class Invariance:
    """The outcome of one check: rows 1..``exact_rows`` are bit-identical to one-row decodes."""

    exact_rows: int  # largest n such that every n' <= n verifies like n' one-row decodes
    checked_rows: int  # the widest verification checked (exact_rows == checked_rows: no difference found)
    kernels: str  # the weight buffers and kernel plan it ran on (``LlamaTarget.kernels``)
    seconds: float  # how long the check took when it ran
    cached: bool = False  # read from the cache, not measured in this process

    @property
    def first_failing(self) -> int | None:
        return self.exact_rows + 1 if self.exact_rows < self.checked_rows else None

    def describe(self) -> str:
        if self.first_failing is None:
            return f"rows bit-identical to plain decoding up to {self.checked_rows} (all checked)"
        return f"rows bit-identical to plain decoding up to {self.exact_rows}, not at {self.first_failing}"


def measure(target: "LlamaTarget", max_rows: int) -> Invariance:
    """Check verifications of 2..``max_rows`` rows against one-row decodes on ``target`` (its cache is
    emptied before and after).  The one-row decodes run with embeddings off, as plain decoding does; the
    verifications with them on, as speculation does.

    Whether a kernel change shows depends on the values (on a tiny Q4_K_M model one set of tokens showed
    the repacked kernel's difference at 4 rows and another not until 8), so each row count is tried on
    other tokens: ``max_rows`` tokens are decoded one at a time, and n rows are verified over the last n of
    them (the cells before a window are the one-row decodes', as in plain decoding).  Below the first
    difference found, each smaller n is tried again on up to ``RETRY_WINDOWS`` more windows."""
    t0 = time.perf_counter()
    ids = target.tokenize(CHECK_TEXT * 2, add_special=True)  # twice: a big vocabulary's few tokens still fill 40
    prompt = ids[:PROMPT_TOKENS]
    rows = ids[PROMPT_TOKENS:][: max(0, min(max_rows, target.n_ctx - len(prompt)))]
    n_rows, p = len(rows), len(prompt)
    was = target.embeddings
    target.reset()
    try:
        target.set_embeddings(False)
        target.prefill(prompt)
        single = np.stack([target.verify([x])[0][-1].copy() for x in rows]) if rows else np.zeros((0, 0))
        target.set_embeddings(True)

        def same(n: int, start: int) -> bool:
            # offsets only go down, so every cell before ``start`` is still a one-row decode's
            target.rollback(p + start)
            logits, _ = target.verify(rows[start : start + n])
            return bool(np.array_equal(logits, single[start : start + n]))

        first = next((n for n in range(2, n_rows + 1) if not same(n, n_rows - n)), None)
        if first is not None:
            last = n_rows - first  # the lowest offset used so far
            for start in sorted({last * i // RETRY_WINDOWS for i in range(RETRY_WINDOWS + 1)}, reverse=True):
                first = next((n for n in range(2, first) if not same(n, start)), first)
        exact = min(1, n_rows) if first is None and n_rows < 2 else (first - 1 if first is not None else n_rows)
    finally:
        target.reset()
        target.set_embeddings(was)
    return Invariance(exact, n_rows, target.kernels, time.perf_counter() - t0)


def cache_file(target: "LlamaTarget") -> Path:
    """One JSON per model file (path, size, mtime), CPU and llama.cpp build (``kernels.probe_key``), kernel
    plan, thread count and KV cell type."""
    from .gguf_weights import cache_dir
    from .kernels import applied_plan, probe_key

    p = target.path.resolve()
    st = p.stat()
    plan = applied_plan()
    key = "|".join([f"v{CHECK_VERSION}", str(p), str(st.st_size), str(st.st_mtime_ns), probe_key(),
                    plan.mode if plan is not None else "?", f"t{target.n_threads}", target.options.kv_type,
                    f"b{target.options.n_batch}"])
    return cache_dir() / "invariance" / f"{p.stem}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


def check(target: "LlamaTarget", max_rows: int | None = None) -> Invariance:
    """``measure`` once per model file and machine (cached); ``max_rows`` defaults to the target's
    micro-batch (32 rows: the most the runtime ever verifies).  A cached answer that checked fewer rows
    than asked, without finding a difference, is measured again."""
    want = min(max_rows or target.options.n_batch, target.options.n_batch)
    path = cache_file(target)
    try:
        d = json.loads(path.read_text())
        got = Invariance(int(d["exact_rows"]), int(d["checked_rows"]), str(d["kernels"]), float(d["seconds"]), True)
        if got.first_failing is not None or got.checked_rows >= want:
            return got
    except (OSError, ValueError, KeyError, TypeError):
        pass
    result = measure(target, want)
    if result.checked_rows >= min(want, 2):  # a context too small to check is not an answer worth keeping
        d = asdict(result)
        del d["cached"]
        atomic_file.write_text(path, json.dumps(d))
    return result


# ------------------------------------------------------------------------------------ --exact
# The nearest type whose rows stay invariant (docs/exactness.md's table) for each ggml tensor type: the
# invariant ones map to themselves; k-quants and i-quants of up to ~4.5 bits to Q5_0 (Gemma 3 270M's
# Q4_K_M -> Q5_0: KL 0.03 nats against 0.41 for all-Q4_0, at about the same speed); the 5- and 6-bit
# k-quants and the float types to Q8_0.
_NEAREST = {"Q4_0": "Q4_0", "Q4_1": "Q4_1", "Q5_0": "Q5_0", "Q5_1": "Q5_1", "Q8_0": "Q8_0",
            "Q2_K": "Q5_0", "Q3_K": "Q5_0", "Q4_K": "Q5_0", "IQ4_XS": "Q5_0", "IQ4_NL": "Q5_0", "IQ3_S": "Q5_0",
            "IQ3_XXS": "Q5_0", "IQ2_XXS": "Q5_0", "IQ2_XS": "Q5_0", "IQ2_S": "Q5_0", "IQ1_S": "Q5_0",
            "IQ1_M": "Q5_0", "TQ1_0": "Q5_0", "TQ2_0": "Q5_0",
            "Q5_K": "Q8_0", "Q6_K": "Q8_0", "F16": "Q8_0", "BF16": "Q8_0", "F32": "Q8_0"}
_MATRIX_ORDER = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")  # cheapest first


@dataclass(frozen=True)
class ExactPlan:
    """What ``--exact`` writes: a file type for the matrices and types for the head and the embedding."""

    type: str
    output_tensor_type: str
    token_embedding_type: str

    def options(self):
        from .quantize import QuantizeOptions

        return QuantizeOptions(type=self.type, output_tensor_type=self.output_tensor_type,
                               token_embedding_type=self.token_embedding_type)

    def describe(self) -> str:
        return f"{self.type}, head {self.output_tensor_type}, embedding {self.token_embedding_type}"


def tensor_types(path: str | Path) -> dict[str, str]:
    """Each 2-D tensor's ggml type name, read from the GGUF header (no weights loaded)."""
    from gguf import GGUFReader

    return {t.name: t.tensor_type.name for t in GGUFReader(path, "r").tensors if len(t.shape) >= 2}


def nearest_exact(path: str | Path) -> ExactPlan:
    """The invariant requantization closest to ``path``'s types: the matrices' most common type mapped by
    ``_NEAREST``, and the head and the embedding each mapped on their own (llama-quantize keeps a Q6_K
    head even in a Q4_0 file, and a tied head is the embedding)."""
    types = tensor_types(path)
    matrices = [_NEAREST.get(t, "Q8_0") for n, t in types.items() if n not in ("output.weight", "token_embd.weight")]
    counts = {t: matrices.count(t) for t in _MATRIX_ORDER}
    main = max(_MATRIX_ORDER, key=lambda t: (counts[t], -_MATRIX_ORDER.index(t))) if matrices else "Q8_0"
    embd = _NEAREST.get(types.get("token_embd.weight", ""), "Q8_0")
    head = _NEAREST.get(types.get("output.weight", ""), embd)
    return ExactPlan(main, head, embd)


def exact_requantization(src: str | Path, plan: ExactPlan | None = None) -> Path:
    """``src`` requantized by ``plan`` (default ``nearest_exact``), made once (seconds) and cached under the
    cache's ``models/exact/``, keyed by the source's path, size and mtime; written whole or not at all."""
    from .gguf_weights import cache_dir
    from .quantize import quantize

    src = Path(src)
    plan = plan or nearest_exact(src)
    st = src.resolve().stat()
    key = hashlib.sha256(f"{src.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:12]
    out = cache_dir() / "models" / "exact" / (f"{src.stem}.{key}.{plan.type}-{plan.output_tensor_type}-"
                                              f"{plan.token_embedding_type}.gguf")
    if not out.is_file():
        with warnings.catch_warnings():  # requantizing is the point here
            warnings.simplefilter("ignore", UserWarning)
            quantize(src, out, plan.options())
    return out


__all__ = ["Invariance", "measure", "check", "cache_file", "ExactPlan", "nearest_exact", "exact_requantization",
           "tensor_types"]


def exact_micro_batch(path: str | Path, *, threads: int = 0, kv_type: str | None = None) -> int:
    """The most rows one micro-batch of ``path`` may hold on this machine and stay bit-exact (``check``, cached):
    what the batched engine (``target/sequences.py``) sets as its micro-batch, so that a slot's rows give
    the logits they would alone even on a file that is not invariant to 32 rows."""
    from ..config import DEFAULT_KV_TYPE
    from .llama_target import LlamaTarget, TargetOptions

    options = TargetOptions(n_ctx=2048, n_threads=threads, embeddings=False, kv_type=kv_type or DEFAULT_KV_TYPE)
    with LlamaTarget(path, options) as target:
        return max(1, check(target).exact_rows)
