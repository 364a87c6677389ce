"""Wires a llama.cpp target, a torch draft and the round loop into one object for apps.

>>> hs = HeteroSpec("SmolLM2-135M-Instruct.Q4_0.gguf", "drafts/smollm2-darter.safetensors")
>>> out = hs.chat([{"role": "user", "content": "Name three primes."}], max_new_tokens=64)
>>> out.text, out.stats.mean_accepted_length
>>> for piece in hs.generate("Once upon a time", stream=True):
...     print(piece, end="")
"""
from __future__ import annotations

import sys
import threading
import time
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable, Iterator

from .chat_template import render_chat
from .config import (DEFAULT_KV_TYPE, MIN_CTX, DenoiseConfig, SamplingConfig, SpecConfig, TreeSpec, check_threads,
                     parse_draft_len)
from .errors import ContextFull, HeteroSpecError, TargetError
from .inputs import check_messages, check_type, count, stop_strings, token_ids
from .records import RunStats
from .spec.orchestrator import generate_tokens
from .spec.policy import AutoPolicy, FixedPolicy, Shape
from .spec.suffix import SuffixCache
from .target.invariance import Invariance
from .target.llama_target import LlamaTarget, TargetOptions
from .target.sequences import SequenceTarget
from .text_stream import TextAssembler

if TYPE_CHECKING:
    from .calibration import CostCurve

# Rows timed by the first-use calibration: every width a round of auto's may verify (its deepest suffix chain
# and the root), then two wider ones.  WHY every width: where the matrix kernels work in 4-row tiles (llama.cpp's
# repacked Q4_0 on x86) t(n) is not smooth: on one Xeon 16 rows cost 5.3 t(1) and 17 rows 6.1, so a curve
# interpolated from 13 and 17 priced 16 rows above 17, and auto verified 17-row rounds.
QUICK_ROWS = (*range(1, 18), 24, 32)
QUICK_FOCUS = (1, 2, 3, 4, 5)  # ... nine times each, not three: auto's plain-or-chain choice rests on them
AUTO_MAX_CHAIN = 8  # longest chain auto considers (t(n) on a CPU makes longer ones lose)
AUTO_LOOKUP_DEPTH = 4  # longest prompt-lookup chain auto considers
AUTO_SUFFIX_DEPTH = 16  # deepest suffix-structure chain auto considers (spec/suffix.py; priced per round)
# Below this many exact rows a model's load says so (with --exact): chains of under three drafts keep
# little of speculation's gain.
FEW_EXACT_ROWS = 4


class ExactnessWarning(UserWarning):
    """Verification is capped below what was asked, or a model's rows are exact only in short batches."""


@dataclass
class Completion:
    text: str
    tokens: list[int]  # every generated id, including a final end-of-generation token
    stats: RunStats


@dataclass
class TextStream:
    """Iterator of text pieces; ``stats`` and ``tokens`` fill in as it runs (partial after an interrupt)."""

    _pieces: Iterator[str]
    stats: RunStats
    tokens: list[int] = field(default_factory=list)

    def __iter__(self) -> Iterator[str]:
        return self._pieces

    def close(self) -> None:
        self._pieces.close()  # type: ignore[attr-defined]


class HeteroSpec:
    """A target GGUF on the CPU plus an optional draft; one conversation state (KV reuse across calls)."""

    def __init__(
        self,
        target: str | Path,
        draft: str | Path | None = None,
        *,
        n_ctx: int = 4096,
        threads: int = 0,
        draft_device: str = "auto",
        draft_dtype: str = "auto",
        denoise: DenoiseConfig = DenoiseConfig(),
        kv_type: str = DEFAULT_KV_TYPE,
        exact: bool = False,
        exact_rows: int | None = None,
    ) -> None:
        """``exact``: where ``target``'s rows are not bit-exact up to the widest verification (32 rows), load
        its nearest invariant requantization instead (``target.invariance.exact_requantization``, made once
        and cached).  ``exact_rows``: trust this bound instead of checking the file (None: checked at load,
        cached per file and machine); no verification ever holds more rows than the bound."""
        # One call at a time on an open model: llama.cpp's context is not thread-safe (two threads in one decode
        # abort the process) and ``close`` frees it.  A stream holds the model between its pieces only, so the
        # newest call owns the conversation state: an older stream still open is closed by it (``_turn``).
        self._lock = threading.Lock()
        self._owner: int | None = None  # the thread holding it
        self._closed = self._closing = False
        self._stream: Iterator[str] | None = None  # the open stream's pieces, if one is open
        self._stream_stats: RunStats | None = None
        n_ctx, threads = count("n_ctx", n_ctx, MIN_CTX), check_threads(threads)
        check_type("denoise", denoise, DenoiseConfig)
        if exact_rows is not None:
            exact_rows = count("exact_rows", exact_rows)
        options = TargetOptions(n_ctx=n_ctx, n_threads=threads, embeddings=draft is not None, kv_type=kv_type,
                                taps=draft_taps(draft))
        try:
            self.target = LlamaTarget(target, options)
        except TargetError:
            if options.taps:  # a draft made for another model says so, rather than that this one cannot tap
                _check_draft_fits(target, draft)
            raise
        self.invariance: Invariance | None = None  # the load's check (None when exact_rows was given)
        self._warned: set[str] = set()  # clamped settings already warned about
        try:
            if exact_rows is None:
                self._check_invariance(options, exact)
                exact_rows = self.invariance.exact_rows
        except BaseException:
            self.target.close()
            raise
        self.exact_rows = max(1, min(int(exact_rows), options.n_batch))
        self.draft = None
        self.draft_path = draft
        self._curve = None  # cost curve for auto sizing, loaded or measured on first use
        self._auto: dict[tuple, AutoPolicy] = {}  # acceptance statistics persist across calls
        # Past outputs for the suffix structure: every call's output serves the later ones (earlier turns,
        # other prompts); bounded in tokens, oldest first out (``SuffixCache.save``/``load`` persist it).
        self.suffix_cache = SuffixCache()
        try:
            if draft is not None:
                self.draft = load_runner(self.target, draft, device=draft_device, dtype=draft_dtype, denoise=denoise)
        except BaseException:
            self.target.close()
            raise

    def _check_invariance(self, options: TargetOptions, exact: bool) -> None:
        """How many rows a verification may hold on this file (``target.invariance.check``, cached); with
        ``exact``, swap in the first requantization that holds to the widest verification (the nearest
        types, then Q8_0 throughout).  Where few rows are exact, say so in one line."""
        from .target import invariance as inv

        self.invariance = inv.check(self.target)
        widest = options.n_batch
        if exact and self.invariance.exact_rows < widest:
            src = self.target.path
            for plan in dict.fromkeys([inv.nearest_exact(src), inv.ExactPlan("Q8_0", "Q8_0", "Q8_0")]):
                path = inv.exact_requantization(src, plan)
                self.target.close()
                self.target = LlamaTarget(path, options)
                self.invariance = inv.check(self.target)
                if self.invariance.exact_rows >= widest:
                    break
            if self.invariance.exact_rows < widest:
                warnings.warn(f"--exact: no requantization of {src.name} tried ({plan.describe()} last) is "
                              f"bit-exact beyond {self.invariance.exact_rows} rows on these kernels; "
                              f"speculation stays capped there", ExactnessWarning, stacklevel=3)
        elif self.invariance.exact_rows < FEW_EXACT_ROWS:
            n = self.invariance.exact_rows
            cap = "plain decoding only" if n <= 1 else f"{n - 1} draft{'s' if n > 2 else ''} a round"
            warnings.warn(f"{self.target.path.name}: verification matches plain decoding bit for bit only up to {n} "
                          f"row{'s' if n > 1 else ''} on these kernels, so speculation is capped at {cap}; "
                          f"--exact (exact=True) runs its nearest invariant requantization instead (made once, "
                          f"cached), or keep this file: docs/exactness.md says how often uncapped output left "
                          f"plain decoding's", ExactnessWarning, stacklevel=3)

    @property
    def max_drafts(self) -> int:
        """The most tokens one round may verify beside the last accepted one: ``exact_rows - 1``."""
        return self.exact_rows - 1

    def _clamp(self, cfg: SpecConfig) -> SpecConfig:
        """``cfg`` with a fixed draft length and tree size cut to ``max_drafts`` (one warning per setting); 0
        drafts where even two rows are not exact."""
        cap = self.max_drafts
        if cap <= 0:
            if cfg.draft_len not in (0, "auto"):
                self._warn_clamp(f"draft_len {cfg.draft_len}", "plain decoding")
            return cfg.with_(draft_len=0) if cfg.draft_len != 0 else cfg
        if isinstance(cfg.draft_len, int) and cfg.tree is None and cfg.draft_len > cap:
            self._warn_clamp(f"draft_len {cfg.draft_len}", f"draft_len {cap}")
            cfg = cfg.with_(draft_len=cap)
        tree = cfg.tree
        if tree is not None and cfg.draft_len != 0 and min(tree.total_tokens, tree.depth * tree.top_k) > cap:
            self._warn_clamp(f"a tree of {min(tree.total_tokens, tree.depth * tree.top_k)} tokens",
                             f"{cap} tree tokens")
            cfg = cfg.with_(tree=replace(tree, total_tokens=cap, depth=min(tree.depth, cap)))
        return cfg

    def _warn_clamp(self, asked: str, used: str) -> None:
        if asked not in self._warned:
            self._warned.add(asked)
            warnings.warn(f"{asked} would verify more rows than {self.target.path.name} keeps bit-exact on these "
                          f"kernels ({self.exact_rows}): using {used} (--exact lifts the cap)", ExactnessWarning,
                          stacklevel=4)

    def close(self) -> None:
        """Free the model.  A call running on another thread ends first: a stream's at its next piece, any other
        at its end."""
        if self._owner == threading.get_ident():
            raise HeteroSpecError("close() from inside a call on the same HeteroSpec (a cancel hook?): return from "
                                  "the call first")
        self._closing = True  # a stream read on another thread stops at its next piece
        with self._lock:
            self._end_stream()
            self._closed = True
            self.target.close()

    def _end_stream(self) -> None:
        """Close the open stream's generation while the model is there (its stop reason: interrupted)."""
        if self._stream is not None:
            pieces, stats, self._stream, self._stream_stats = self._stream, self._stream_stats, None, None
            pieces.close()  # type: ignore[attr-defined]
            stats.stop_reason = stats.stop_reason or "interrupted"

    @contextmanager
    def _turn(self, stream: Iterator[str] | None = None, supersede: bool = True) -> Iterator[None]:
        """Hold the model for one call, or for one piece of ``stream``: refused once closed, or while another
        thread holds it.  A new call (``supersede``) first closes an open stream it did not come from; that
        stream's iterator then raises, where it decoded from a moved conversation."""
        if self._closed or self._closing:
            raise HeteroSpecError("this HeteroSpec is closed: it was used after close() or outside its with block")
        if not self._lock.acquire(blocking=False):
            if self._owner == threading.get_ident():
                raise HeteroSpecError("a call on this HeteroSpec from inside one of its own calls (a cancel hook?)")
            raise HeteroSpecError("this HeteroSpec is in a call on another thread: one HeteroSpec serves one caller "
                                  "at a time (for many at once: `hetero-spec serve`, or a BatchGenerator's one call "
                                  "with many prompts)")
        self._owner = threading.get_ident()
        try:
            if self._closed or self._closing:  # closed while this thread waited for the lock
                raise HeteroSpecError("this HeteroSpec is closed")
            if stream is not None and stream is not self._stream:
                raise HeteroSpecError("this stream was closed by a later call on the same HeteroSpec: read a stream "
                                      "to its end, or close it, before the next call")
            if stream is None and supersede:
                self._end_stream()
            yield
        finally:
            self._owner = None
            self._lock.release()

    def reset(self) -> None:
        """Forget the cached conversation (both KV caches); the next call prefills from scratch."""
        with self._turn():
            self.target.reset()
            if self.draft is not None:
                self.draft.reset()

    def __enter__(self) -> "HeteroSpec":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ requests
    def render(self, messages: list[dict[str, str]]) -> str:
        with self._turn(supersede=False):  # reads the template and the vocabulary only
            t = self.target
            return render_chat(t.chat_template, check_messages(messages), bos_token=t.bos_token,
                               eos_token=t.eos_token)

    def chat(self, messages: list[dict[str, str]], *, stream: bool = False, **options) -> Completion | TextStream:
        """Apply the GGUF's chat template, then ``generate`` (special tokens in the template are parsed)."""
        return self.generate(self.render(messages), stream=stream, _templated=True, **options)

    def generate(
        self,
        prompt: str | list[int],
        *,
        max_new_tokens: int = 256,
        draft_len: int | str = "auto",
        stop: str | Iterable[str] | None = (),
        stream: bool = False,
        tree: TreeSpec | None = None,
        sampling: SamplingConfig | None = None,
        draft_p_min: float | None = None,
        lookup: bool = True,
        suffix: bool | None = None,
        suffix_cache: SuffixCache | None = None,
        cancel: Callable[[], bool] | None = None,
        draft_model: bool = True,
        _templated: bool = False,
    ) -> Completion | TextStream:
        """Generate; greedy output is identical to the target alone, sampled output follows its distribution.

        ``stop``: one stop string or several.  ``draft_len``: k drafts per round, 0 = plain decoding, ``"auto"`` = sized every round
        from the machine's cost curve (measured quickly and cached on first use) and the
        running acceptance.  ``tree``: draft an EAGLE-2-style tree instead of a chain (its
        depth is the maximum with ``auto``).  ``sampling``: temperature, top-k/p, min-p, seed.
        ``lookup``: with ``"auto"``, also draft by copying repeated text where that pays (False: no copies
        unless ``suffix=True``).
        ``suffix``: with ``"auto"``, copy trees from the suffix structure over the prompt, the output and past
        outputs (``suffix_cache``, default ``self.suffix_cache``) instead of prompt lookup; None: as ``lookup``.
        Without a draft model ``"auto"`` then needs none: it runs plain rounds and copies.  WHY on beside a draft
        model too: with the shipped darter it runs ahead of prompt lookup where answers restate earlier text, and
        level elsewhere (``docs/suffix.md``).  With ``stream``
        the result is an iterator of text pieces whose ``stats`` fill in.  ``cancel``: asked after
        every round; True ends the generation there (stop reason ``"cancelled"``, no held-back
        tail), so a server whose client left frees the model within one round.  ``draft_model`` False: with
        ``"auto"``, the loaded draft model is left out and only the copy sources draft (lookup-only).
        """
        draft_len = parse_draft_len(draft_len)
        if not draft_model and draft_len != "auto":
            raise HeteroSpecError("leaving the draft model out (draft_model=False) needs draft_len 'auto'")
        check_type("sampling", sampling, SamplingConfig)
        check_type("tree", tree, TreeSpec)
        check_type("suffix_cache", suffix_cache, SuffixCache)
        suffix = lookup if suffix is None else suffix
        copies = draft_len == "auto" and (suffix or lookup)  # sources that need no draft model
        model = self.draft is not None and draft_model
        with self._turn():
            cfg = SpecConfig(max_new_tokens=max_new_tokens, draft_len=draft_len if model or copies else 0,
                             stop=stop_strings(stop), sampling=sampling or SamplingConfig(), tree=tree,
                             draft_p_min=draft_p_min, lookup=lookup, draft_model=draft_model)
            cfg = self._clamp(cfg)
            tokens = self._prompt_tokens(prompt, _templated)
            stats = RunStats(prompt_tokens=len(tokens), kernels=self.target.kernels)
            ts = TextStream(iter(()), stats)
            cache = suffix_cache if suffix_cache is not None else self.suffix_cache
            pieces = self._run(tokens, cfg, ts, cancel, cache if suffix else None)
            if not stream:
                text = "".join(pieces)
                return Completion(text, ts.tokens, stats)
            self._stream, self._stream_stats = pieces, stats
        ts._pieces = self._pieces(pieces)
        return ts

    def _pieces(self, pieces: Iterator[str]) -> Iterator[str]:
        """A stream's pieces, each produced while holding the model (``_turn``)."""
        try:
            while True:
                with self._turn(pieces):
                    piece = next(pieces, None)
                    if piece is None:
                        self._stream = self._stream_stats = None
                        return
                yield piece
        finally:  # closed by its reader (or collected): its generation ends now, if it is still the open one
            if self._stream is pieces and self._lock.acquire(blocking=False):
                try:
                    if not self._closed:
                        self._end_stream()
                finally:
                    self._lock.release()

    def _draft_for(self, cfg: SpecConfig):
        """The draft model a generation with ``cfg`` uses: the loaded one unless ``cfg`` leaves it out (None)."""
        return self.draft if cfg.draft_model else None

    def _policy(self, cfg: SpecConfig, suffix: bool = False):
        """None for the plain chain path; a fixed tree; or auto sizing over chains or trees (without a
        draft model: over the copy sources alone, prompt lookup or the suffix structure)."""
        model = self._draft_for(cfg) is not None
        if cfg.draft_len == 0 or (not model and cfg.draft_len != "auto"):
            return None
        tree = cfg.tree
        if cfg.draft_len != "auto":
            return FixedPolicy(Shape(tree.depth, tree.top_k, tree.total_tokens)) if tree else None
        cap = self.max_drafts  # every source's deepest chain and largest tree stays within the exact rows
        key = (*((tree.top_k, min(tree.total_tokens, cap), tree.depth) if tree else (1, 0, min(AUTO_MAX_CHAIN, cap))),
               min(AUTO_LOOKUP_DEPTH, cap) if cfg.lookup and not suffix else 0,
               min(AUTO_SUFFIX_DEPTH, cap) if suffix else 0)
        if not model:
            key = (1, 0, 0, *key[3:])  # max_depth 0: no draft model
        if key not in self._auto:
            from .draft.checkpoint import read_held_out_acceptance

            prior = read_held_out_acceptance(self.draft_path) if model and self.draft_path is not None else ()
            self._auto[key] = AutoPolicy(self._cost_curve(), width=key[0], total=key[1], max_depth=key[2],
                                         lookup_depth=key[3], suffix_depth=key[4], prior_alphas=prior,
                                         suffix_nodes=min(self.suffix_cache.config.max_nodes, max(1, cap)))
        return self._auto[key]

    def cost_curve(self):
        """This machine's cost curve for target + draft: the cached calibration, else a quick one now.

        Measuring resets the conversation cache; it happens once per machine, model and draft
        file (``hetero_spec.calibration`` caches the JSON)."""
        with self._turn(supersede=self._curve is None):  # measuring moves the conversation; reading does not
            return self._cost_curve()

    def _cost_curve(self):
        if self._curve is None:
            from .calibration import cache_path, load_or_measure, measure, save

            path = cache_path(self.target.path, self.draft_path, self.target.n_threads)
            if path.is_file():
                self._curve = load_or_measure(self.target, self.draft, self.target.path, self.draft_path, quick=True)
            else:
                from tqdm import tqdm

                # three timings a width (nine for the narrowest) keep the first run's wait to seconds
                repeats, focus_repeats = 3, 9
                total = 2 * repeats * len(QUICK_ROWS) + (focus_repeats - repeats) * len(QUICK_FOCUS)
                with tqdm(total=total, desc="calibrating (once)", unit="decode", leave=False, file=sys.stderr) as bar:
                    self._curve = measure(self.target, self.draft, ns=QUICK_ROWS, repeats=repeats, progress=bar.update,
                                          focus=QUICK_FOCUS, focus_repeats=focus_repeats,
                                          model=self.target.path.name + (f" + {Path(self.draft_path).name}"
                                                                         if self.draft_path is not None else ""))
                save(self._curve, path)
        return self._curve

    def _prompt_tokens(self, prompt: str | list[int], templated: bool) -> list[int]:
        if isinstance(prompt, str):
            if not prompt.strip():
                raise HeteroSpecError("empty prompt")
            # A templated prompt already carries BOS where the template wants it.
            tokens = self.target.tokenize(prompt, add_special=not templated, parse_special=True)
        else:
            tokens = token_ids(prompt, self.target.n_vocab)
        if not tokens:
            raise HeteroSpecError("empty prompt")
        if len(tokens) >= self.target.n_ctx:
            raise ContextFull(f"prompt of {len(tokens)} tokens does not fit the context of {self.target.n_ctx} (use --ctx)")
        return tokens

    def _run(self, tokens: list[int], cfg: SpecConfig, ts: TextStream,
             cancel: Callable[[], bool] | None = None, suffix: SuffixCache | None = None) -> Iterator[str]:
        # a first auto run measures the cost curve here (seconds, once per machine): not the request's time
        policy = self._policy(cfg, suffix is not None)
        if isinstance(policy, AutoPolicy):
            policy.new_text()
        t0 = time.perf_counter()
        if suffix is not None and suffix.config.max_nodes > self.max_drafts:
            # a suffix tree has up to ``max_nodes`` nodes: the request reads the cache's config when it starts,
            # so the cap is in force for it only and the caller's cache keeps its own
            saved, suffix.config = suffix.config, replace(suffix.config, max_nodes=max(1, self.max_drafts))
            try:
                yield from self._run_steps(tokens, cfg, ts, cancel, suffix, policy, t0)
            finally:
                suffix.config = saved
            return
        yield from self._run_steps(tokens, cfg, ts, cancel, suffix, policy, t0)

    def _run_steps(self, tokens: list[int], cfg: SpecConfig, ts: TextStream, cancel: Callable[[], bool] | None,
                   suffix: SuffixCache | None, policy, t0: float) -> Iterator[str]:
        stats, target = ts.stats, self.target
        text = TextAssembler(target.piece, cfg.stop)
        steps = generate_tokens(target, self._draft_for(cfg), tokens, max_new_tokens=cfg.max_new_tokens,
                                draft_len=1 if cfg.draft_len == "auto" else cfg.draft_len,
                                sampling=cfg.sampling, policy=policy, p_min=cfg.p_min, suffix=suffix)
        try:
            for step in steps:
                if step.round is None and not stats.rounds and not ts.tokens:
                    stats.prefill_s = time.perf_counter() - t0
                if step.round is not None:
                    stats.observe(step.round)
                ts.tokens.extend(step.tokens)
                stats.new_tokens = len(ts.tokens)
                visible = [t for t in step.tokens if not target.is_eog(t)]
                piece = text.feed(visible)
                stats.wall_s = time.perf_counter() - t0
                if text.stopped:
                    stats.stop_reason = "stop_string"
                elif step.stop_reason:
                    stats.stop_reason = step.stop_reason
                if piece:
                    yield piece
                if text.stopped:
                    break
                if cancel is not None and cancel():
                    stats.stop_reason = "cancelled"
                    return
            tail = text.finish()
            if tail:
                yield tail
        except GeneratorExit:
            stats.stop_reason = stats.stop_reason or "interrupted"
            raise
        finally:
            steps.close()
            stats.wall_s = time.perf_counter() - t0


# Real rows for the int8 check of a CPU draft: prose, code and arithmetic, about 150 tokens.  Synthetic
# inputs miss the target features' outlier channels, which are what int8 activations get wrong.
CALIBRATION_TEXT = (
    "The old lighthouse keeper climbed the spiral stairs every evening to light the lamp. Ships passing the "
    "rocky coast relied on its beam to find the harbour safely. One stormy night the lamp flickered and went "
    "out.\ndef fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n"
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did she sell altogether? In May she sold 48 / 2 = 24 clips, so 48 + 24 = 72 in all.")


def calibrate(
    model: str | Path,
    draft: str | Path | None = None,
    *,
    threads: int = 0,
    quick: bool = False,
    repeats: int | None = None,
    out: str | Path | None = None,
    draft_device: str = "cpu",
    progress: Callable[[int], None] | None = None,
) -> tuple["CostCurve", Path]:
    """Load the target (and draft), measure, save the JSON where ``load_or_measure`` looks (or ``out``)."""
    from .calibration import MAX_ROWS, PREFIX_TOKENS, describe_files, cache_path, measure, save

    with HeteroSpec(model, draft, n_ctx=PREFIX_TOKENS + 2 * MAX_ROWS, threads=threads, draft_device=draft_device) as hs:
        curve = measure(hs.target, hs.draft, quick=quick, repeats=repeats, progress=progress,
                        model=describe_files(model, draft))
        path = Path(out) if out is not None else cache_path(model, draft, hs.target.n_threads)
    return curve, save(curve, path)


def draft_taps(path: str | Path | None) -> tuple[int, ...]:
    """The target blocks whose input the draft file reads (EAGLE-3 fusion), which the target's context
    must be told before it decodes anything; () without a draft or taps."""
    if path is None:
        return ()
    from .draft.checkpoint import read_config

    return read_config(path).taps


def _check_draft_fits(target: str | Path, draft: str | Path) -> None:
    """Raise ``DraftError`` if ``draft`` was made for a model other than ``target`` (opened without taps)."""
    from .draft.checkpoint import load_draft

    with LlamaTarget(target, TargetOptions(n_ctx=MIN_CTX, n_threads=1, embeddings=False)) as plain:
        load_draft(draft, plain.fingerprint)


def load_runner(target: LlamaTarget | SequenceTarget, path: str | Path, *, device: str, dtype: str,
                denoise: DenoiseConfig):
    """Load a draft file against this target (one sequence, or the batched engine's): check the fingerprint,
    borrow embedding and head; a CPU draft's int8 weights are calibrated on the target's features of
    ``CALIBRATION_TEXT``."""
    import torch

    from . import int8_cache
    from .draft.checkpoint import load_draft
    from .draft.runner import DraftRunner
    from .target.gguf_weights import load_target_weights

    model = load_draft(path, target.fingerprint)
    weights = load_target_weights(target.path)
    model.attach_target_weights(torch.from_numpy(_writable(weights.embedding)), torch.from_numpy(_writable(weights.head)))
    rows = cached = None
    if dtype.startswith("int8") or (dtype == "auto" and not str(device).startswith("cuda")):
        cached = int8_cache.load(target.path, path)
        if cached is None:
            ids = target.tokenize(CALIBRATION_TEXT)
            rows = _calibration_rows(target, ids)
    # the draft runs while the target's threads wait: it may use as many (one shared OpenMP pool, see DraftRunner)
    runner = DraftRunner(model, device=device, dtype=dtype, denoise=denoise, calibration=rows, int8_calibration=cached,
                         cpu_threads=target.n_threads)
    if rows is not None and runner.int8_calibration is not None and len(rows[1]) == len(ids) - 1:
        int8_cache.save(target.path, path, runner.int8_calibration)  # not a context's cut of the text (below)
    return runner


def _calibration_rows(target: LlamaTarget | SequenceTarget, ids: list[int]):
    """(features [n-1, n_embd], next tokens [n-1]) of ``ids`` (CALIBRATION_TEXT); leaves the target's cache
    empty.  A context shorter than the text (``--ctx 64``) calibrates on the part that fits, and that
    calibration is not cached for longer contexts."""
    if isinstance(target, SequenceTarget):  # sequence 0, in decodes of at most batch_rows rows
        import numpy as np

        from .target.sequences import Row

        ids = ids[: target.seq_ctx]
        step = target.options.batch_rows
        feats = []
        for start in range(0, len(ids), step):
            chunk = ids[start:start + step]
            target.decode([Row(0, t, start + i, i == len(chunk) - 1) for i, t in enumerate(chunk)])  # features: every row
            feats.append(target.features())
        target.clear(0)
        return np.concatenate(feats)[:-1], ids[1:]
    ids = ids[: target.n_ctx]
    was = target.embeddings
    target.reset()  # a cached prefix would return the new rows only
    target.set_embeddings(True)
    try:
        hidden, _ = target.prefill(ids)
    finally:
        target.reset()
        target.set_embeddings(was)
    return hidden[:-1].copy(), ids[1:]


def _writable(arr):
    import numpy as np

    return np.array(arr, dtype=np.float32, copy=True) if not arr.flags.writeable else arr


__all__ = ["HeteroSpec", "Completion", "TextStream", "HeteroSpecError"]
