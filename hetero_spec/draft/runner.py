"""Runs a DraftModel for inference: device and dtype, a position-indexed KV cache, proposals.

The cache is indexed by position (gpt-fast style): rolling back rejected drafts is
setting ``n`` back, never copying.  Cell i holds the block states computed from
(f_i, x_{i+1}); only cells computed from real target features are kept across rounds.
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from ..config import DRAFT_DTYPES, DenoiseConfig, SamplingConfig
from ..spec.sampling import draw_without_replacement, process_logits
from ..errors import DraftError
from ..cpu_features import cpu_has_bf16
from .int8 import (FLOAT_MODULES, HEAD, INT8_MAX_ERROR, INT8_MIN_AGREEMENT, Int8Calibration, Int8Check, RescoredInt8Head,
                   calibrate_int8, int8_available, quantize_linears)
from .context_head import ContextHead
from .model import DraftModel, _attend_one
from . import native
from .static_step import StaticStep


# Real rows the native chain reads itself (draft/native.py); more go through torch's forward first.  The native
# read multiplies each weight row by every row in turn, which beats fbgemm's GEMM up to about 8 rows (scripts/
# bench_draft_step.py's machine: 1.2 against 1.5 ms for 4 rows, level at 8, 4.4 against 3.4 ms at 32).
NATIVE_MAX_ROWS = 6


def resolve_device(spec: str) -> torch.device:
    """``auto`` = CUDA when torch sees it, else CPU; ``cuda[:N]`` fails clearly without CUDA."""
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(spec)
    except RuntimeError:
        raise DraftError(f"unknown draft device {spec!r} (use auto, cpu or cuda[:N])") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise DraftError(f"draft device {spec} requested but torch sees no CUDA device")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise DraftError(f"draft device {spec} does not exist ({torch.cuda.device_count()} CUDA devices)")
    elif dev.type != "cpu":
        raise DraftError(f"unsupported draft device {spec!r} (use auto, cpu or cuda[:N])")
    return dev


FLOAT_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
                "float16": torch.float16, "fp16": torch.float16}


def resolve_dtype(spec: str, device: torch.device) -> tuple[torch.dtype, str | None]:
    """(activation dtype, int8 request: None, "auto", "int8", "int8-full" or "int8-reduced").

    ``auto``: bf16 on CUDA; on a CPU int8 weights if a mode is accurate there (decided after loading)."""
    if spec == "auto":
        if device.type == "cuda":
            return torch.bfloat16, None
        return torch.float32, "auto" if int8_available() else None
    if spec.startswith("int8"):
        if spec not in DRAFT_DTYPES:
            raise DraftError(f"unknown draft dtype {spec!r} (use {', '.join(DRAFT_DTYPES)})")
        if device.type != "cpu" or not int8_available():
            raise DraftError("int8 draft weights need the CPU and torch's fbgemm engine")
        return torch.float32, spec
    if spec not in FLOAT_DTYPES:
        raise DraftError(f"unknown draft dtype {spec!r} (use {', '.join(DRAFT_DTYPES)})")
    return FLOAT_DTYPES[spec], None


def _int8_mode(request: str, check: Int8Check | None) -> str | None:
    """The int8 mode to run (None: float weights), from the request and the measured check."""
    if request == "int8-full":
        return "int8"
    if request == "int8-reduced":
        return "int8-reduced"
    if check.mode is None and request == "int8":
        raise DraftError(f"int8 draft weights are not accurate on this CPU: layer error {check.error_full:.3f} / "
                         f"{check.error_reduced:.3f} (8- / 7-bit activations, bound {INT8_MAX_ERROR}), proposals "
                         f"equal to float on {check.agreement_full:.0%} / {check.agreement_reduced:.0%} of steps "
                         f"(need {INT8_MIN_AGREEMENT:.0%}); use --draft-dtype float32")
    return check.mode


def _calibrate(model: DraftModel, rows: tuple[np.ndarray, np.ndarray] | None, denoise: DenoiseConfig,
               check: bool) -> Int8Calibration:
    """Smoothing scales from the rows and, with ``check``, both int8 modes' per-layer errors and their
    proposals against float's, one draft step per row (the decode path: its one-row kernels are the
    ones that saturate without VNNI)."""
    rows = rows if rows is not None else _synthetic_rows(model)
    smooth, err_full, err_reduced = calibrate_int8(model, lambda: _probe_forward(model, rows), model.head)
    if not check:
        return Int8Calibration(smooth)
    feats, tokens = rows
    runs = {}
    for mode in ("float32", "int8-full", "int8-reduced"):
        # forced modes given the scales measure nothing themselves, so this does not recurse
        # the torch int8 step, whose one-row kernels saturate without VNNI (the native chain is checked by its tests)
        runner = DraftRunner(copy.deepcopy(model), device="cpu", dtype=mode, denoise=denoise,
                             int8_calibration=Int8Calibration(smooth), cpu_threads=torch.get_num_threads(),
                             native_chain=False)
        runs[mode] = np.array([runner.propose(feats[t : t + 1], tokens[t : t + 1], k=1)[0] for t in range(len(tokens))])
    agree = {m: float((runs[m] == runs["float32"]).mean()) for m in ("int8-full", "int8-reduced")}
    return Int8Calibration(smooth, Int8Check(err_full, err_reduced, agree["int8-full"], agree["int8-reduced"]))


def _synthetic_rows(model: DraftModel, n: int = 64) -> tuple[np.ndarray, np.ndarray]:
    """Stand-in calibration rows: a fixed sequence of frequent tokens with unit-RMS embedding rows as
    features (less faithful than real rows: they lack the target features' outlier channels)."""
    gen = torch.Generator().manual_seed(0)
    tokens = model.d2t[torch.randint(len(model.d2t), (n,), generator=gen)]
    feats = torch.nn.functional.rms_norm(model.embed[tokens].float(), (model.embed.shape[1],))
    return feats.repeat(1, max(1, len(model.cfg.taps))).numpy(), tokens.numpy()


def _probe_forward(model: DraftModel, rows: tuple[np.ndarray, np.ndarray]) -> torch.Tensor:
    """A float teacher-forced forward over the calibration rows; returns what the head would read."""
    feats, tokens = rows
    return model(torch.as_tensor(np.asarray(feats, dtype=np.float32))[None],
                 torch.as_tensor(np.asarray(tokens, dtype=np.int64))[None])[0]


@dataclass
class TreeProposal:
    """A drafted tree, parents first; node 0 is the root (the last accepted token, unknown here)."""

    tokens: np.ndarray  # [n] int64 target ids; tokens[0] = -1 (the caller's root)
    parents: np.ndarray  # [n] int64; parents[0] = -1
    q: list  # [n] of processed draft distributions [n_vocab] float64 at nodes with children (sampling), else None
    n_real: int  # cache cells computed from real target rows; roll back to this after verification
    depth_forwards: int = 0  # batched draft forwards run for depths >= 2
    forwarded_rows: int = 0  # the rows of those forwards (a greedy tree forwards only nodes that could grow)


@dataclass
class DraftCache:
    k: list[torch.Tensor]  # per block [1, n_kv, max_pos, hd]
    v: list[torch.Tensor]
    log_gate: list[torch.Tensor]  # per block [max_pos] float32 (zeros without a gate)
    holes: torch.Tensor  # [max_pos] float32 additive bias: -inf on skipped cells (no feature), else 0
    n: int = 0  # cells 0..n-1 are valid


class DraftRunner:
    """Holds a draft on its device and proposes chains of tokens.

    >>> runner = DraftRunner(model, device="cpu")
    >>> runner.propose(features, tokens, k=3)  # features [m, n_embd] float32, tokens [m] -> [k] ids
    >>> runner.rollback(runner.n - 2)
    """

    def __init__(
        self,
        model: DraftModel,
        *,
        device: str = "auto",
        dtype: str = "auto",
        denoise: DenoiseConfig = DenoiseConfig(),
        cpu_threads: int = 1,
        calibration: tuple[np.ndarray, np.ndarray] | None = None,
        int8_calibration: Int8Calibration | None = None,
        context_rows: bool = True,
        native_chain: bool = True,
    ) -> None:
        """``calibration``: real rows (features [n, n_in] float32, next tokens [n]) on which int8 weights are
        smoothed and both int8 modes checked; without them, unit-RMS embedding rows stand in (less
        faithful: they lack the target features' outlier channels).  ``int8_calibration``: the result of
        an earlier such check (``self.int8_calibration``), which skips it.  ``context_rows``: a reduced head
        also scores the target's rows of tokens passed to ``add_context`` (context_head.py)."""
        self.device = resolve_device(device)
        self.dtype, int8_request = resolve_dtype(dtype, self.device)
        if self.device.type == "cpu":
            # The draft runs while the target waits, so it may take the target's threads: torch and llama.cpp's
            # CPU backend share one OpenMP runtime (libgomp.so.1, loaded once per process) and so one thread
            # team, whose workers spin briefly for the next parallel region of either, never beside each other.
            # Measured (scripts/bench_draft_step.py, 2 cores): 2 threads 20-25% faster per step than 1.
            torch.set_num_threads(cpu_threads)
        if model.embed.numel() == 0:
            raise DraftError("draft has no target weights attached (call attach_target_weights)")
        self.weights = str(self.dtype).removeprefix("torch.")  # what the draft runs on: a dtype, "int8" or "int8-reduced"
        self.int8_calibration = None
        if int8_request is not None:
            model = model.float().eval()
            cal = int8_calibration
            if cal is None or (cal.check is None and int8_request in ("auto", "int8")):
                cal = _calibrate(model, calibration, denoise, check=int8_request in ("auto", "int8"))
            self.int8_calibration = cal
            mode = _int8_mode(int8_request, cal.check)
            if mode is None:  # auto, and neither int8 mode is accurate here: the fastest float
                self.dtype = torch.bfloat16 if cpu_has_bf16() else torch.float32
                self.weights = str(self.dtype).removeprefix("torch.")
            else:
                self.weights = mode
        self.model = model.to(device=self.device, dtype=self.dtype).eval()
        self.model.rope_cos = self.model.rope_cos.float()
        self.model.rope_sin = self.model.rope_sin.float()
        self._native: native.NativeChain | None = None  # the greedy chain as one native call (native.py)
        if self.weights.startswith("int8") and native_chain and native.supports(self.model):
            lib = native.load_library()
            if lib is not None:  # built from the float weights, before the torch int8 layers replace them
                self._native = native.NativeChain(lib, self.model, None, denoise, threads=cpu_threads,
                                                  smooth=self.int8_calibration.smooth)
        if self.weights.startswith("int8"):
            reduced, smooth = self.weights == "int8-reduced", self.int8_calibration.smooth
            quantize_linears(self.model, reduced, smooth, weight_only=FLOAT_MODULES)
            base = RescoredInt8Head(self.model.head, reduced, smooth[HEAD])
        else:
            head_t = self.model.head.t()
            base = lambda feat: feat @ head_t  # noqa: E731
        # the head rows, plus the target's rows of tokens seen in the text (add_context)
        self._head = ContextHead(base, self.model.d2t.cpu().numpy(), model.target_head if context_rows else None,
                                 dtype=self.dtype, device=self.device)
        self.cfg = model.cfg
        self.denoise = denoise
        self._log_threshold = math.log(denoise.threshold) if denoise.threshold > 0 else None
        self.cache = self._new_cache()
        self._zeros = torch.zeros(self.cfg.max_positions, device=self.device)
        self._one_row = True  # one-position forwards take ``_forward_one`` (False: the general ``_blocks``)
        # CUDA: a chain's one-position steps replay one captured graph (static_step.py)
        self.cuda_graph = self.device.type == "cuda"
        self._static: StaticStep | None = None  # captured on the first chain
        # CUDA: page-locked staging of the incoming rows and ids, and the event after its last copy
        self._pinned: dict[torch.dtype, tuple[torch.Tensor, torch.cuda.Event]] = {}

    def _new_cache(self) -> DraftCache:
        c, shape = self.cfg, (1, self.cfg.n_kv_heads, self.cfg.max_positions, self.cfg.head_dim)
        make = lambda: torch.zeros(shape, device=self.device, dtype=self.dtype)  # noqa: E731
        return DraftCache(
            k=[make() for _ in range(c.n_blocks)],
            v=[make() for _ in range(c.n_blocks)],
            log_gate=[torch.zeros(c.max_positions, device=self.device) for _ in range(c.n_blocks)],
            holes=torch.zeros(c.max_positions, device=self.device),
        )

    @property
    def step_kind(self) -> str:
        """How a greedy chain runs: ``native <kernel>, int<bits> head`` (one C++ call, native.py) or ``torch``."""
        if self._native is None:
            return "torch"
        return f"native {native.kernel_name(self._native.lib)}, int{self._native.head_bits} head"

    @property
    def int8_check(self) -> Int8Check | None:
        return self.int8_calibration.check if self.int8_calibration is not None else None

    @property
    def n(self) -> int:
        return self.cache.n

    @property
    def max_positions(self) -> int:
        return self.cfg.max_positions

    @property
    def _d2t(self) -> np.ndarray:
        return self._head.d2t  # [n_rows] head row -> target id, including context rows

    def reset(self) -> None:
        self.cache.n = 0
        self._head.clear()

    def rollback(self, n_keep: int) -> None:
        if not 0 <= n_keep <= self.cache.n:
            raise DraftError(f"draft rollback to {n_keep} outside 0..{self.cache.n}")
        self.cache.n = n_keep
        if n_keep == 0:
            self._head.clear()  # nothing of the old text is left to copy from

    def add_context(self, tokens: Sequence[int]) -> int:
        """Tokens of the text (the prompt, accepted tokens): a reduced head gains the target's rows of those
        it lacks, so the draft can propose what the target copies.  Returns the number of rows added."""
        return self._head.add(tokens)

    def skip(self, n: int) -> None:
        """Advance over ``n`` positions whose target features were never computed (a prompt
        prefilled without embeddings): their cells stay out of every later attention."""
        c = self.cache
        if n < 0 or c.n + n > self.cfg.max_positions:
            raise DraftError(f"draft cannot skip {n} positions from {c.n}")
        c.holes[c.n : c.n + n] = float("-inf")
        c.n += n

    @torch.inference_mode()
    def propose(self, features: np.ndarray, tokens: np.ndarray | list[int], k: int) -> list[int]:
        """Consume real rows, then draft ``k`` tokens greedily.

        features [m, n_in] float32: the target's rows (f_i, or its taps) for positions n..n+m-1;
        tokens [m]: x_{i+1}.  The first k-1 proposals are fed back as (the draft's own g, drafted
        token); their cells stay in the cache until the caller rolls back to the real prefix.
        """
        m = len(tokens)
        if m == 0 or k < 1:
            raise DraftError("propose needs at least one real row and k >= 1")
        if self.cache.n + m + k - 1 > self.cfg.max_positions:
            raise DraftError(f"draft context of {self.cfg.max_positions} positions is full")
        if self._native is not None:
            return self._propose_native(features, tokens, k)[0]
        g, toks = self._real(features), self._tokens(tokens)
        x, feat = self._forward_step(g, toks) if m == 1 else self._forward(g, toks)
        x, feat = x[:, -1:], feat[:, -1:]  # [1, 1, hidden], [1, 1, n_embd]
        out: list[torch.Tensor] = []  # [] int64 each, on the device: read back once, after the last step
        for j in range(k):
            tok = self._head.greedy(feat[0])
            out.append(tok)
            if j + 1 < k:
                x, feat = self._forward_step(self.model.drafted_input(x, feat), tok.view(1, 1))
        return torch.stack(out).tolist()  # the round's one synchronisation on a GPU

    def _propose_native(self, features: np.ndarray, tokens: np.ndarray | list[int], k: int,
                        p_min: float = 0.0) -> tuple[list[int], int]:
        """``propose`` through the native chain, the real rows included up to ``NATIVE_MAX_ROWS`` of them (a round's
        accepted tokens).  Returns the proposals (fewer than k where one's probability falls below ``p_min``) and
        the count of cells after the real rows."""
        chain, head = self._attached_native(), self._head
        n_real = self.cache.n + len(tokens)
        if len(tokens) > NATIVE_MAX_ROWS:  # a backlog (a prompt, rows after plain rounds): torch's matrix products
            x, feat = self._forward(self._real(features), self._tokens(tokens))
            ids, written = chain.run(None, None, self.cache.n, k, head._extra, head.d2t_t, p_min, x0=x[0, -1],
                                     feat0=feat[0, -1])
        else:
            ids, written = chain.run(self._host_rows(features, len(tokens)), np.asarray(tokens, dtype=np.int64),
                                     self.cache.n, k, head._extra, head.d2t_t, p_min)
        self.cache.n += written
        return ids, n_real

    def _attached_native(self) -> native.NativeChain:
        """The native step, pointed at this runner's cache (the engine swaps slots' caches in)."""
        if self._native.cache is not self.cache:
            self._native.attach(self.cache)
        return self._native

    def _host_rows(self, features: np.ndarray, m: int) -> torch.Tensor:
        """The target's ``m`` real rows as the native step reads them: [m, input_size] float32 on the host."""
        rows = torch.from_numpy(np.ascontiguousarray(features, dtype=np.float32))
        if rows.shape[-1] != self.cfg.input_size:
            raise DraftError(f"the draft reads rows of {self.cfg.input_size} values per position, got {rows.shape[-1]}")
        return rows.reshape(m, -1)

    def _read_native(self, features: np.ndarray, tokens: np.ndarray | list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """A greedy tree's root: its few real rows (``NATIVE_MAX_ROWS``) read by the native step, as a chain's
        are; x [1, 1, hidden] and feat [1, 1, n_embd] of the last, as ``_forward``'s last row.  WHY: torch's
        forward of a row or two is a few hundred small kernels; with its levels (``_forward_nodes``) and their
        head (``NativeChain.head_topk``) native too, a tree round's drafting costs well under half of torch's
        (scripts/bench_tree_draft.py, docs/bench.md)."""
        x, feat = self._attached_native().read(self._host_rows(features, len(tokens)), np.asarray(tokens, dtype=np.int64),
                                               self.cache.n)
        self.cache.n += len(tokens)
        return x.to(self.dtype)[None, None], feat.to(self.dtype)[None, None]

    def _forward_step(self, g: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One position inside ``propose``: on CUDA the graphed static step (its outputs are buffers that
        the next step overwrites, which a chain never reads again), elsewhere ``_forward``."""
        if self.cuda_graph and self._one_row:
            if self._static is None:
                self._static = StaticStep(self)
            return self._static(g, tokens)
        return self._forward(g, tokens)

    def _real(self, features: np.ndarray) -> torch.Tensor:
        """The target's rows [m, n_in] -> g [1, m, feature_size] on the draft's device."""
        f = self._to_device(np.ascontiguousarray(features, dtype=np.float32)).to(self.dtype)
        if f.shape[-1] != self.cfg.input_size:
            raise DraftError(f"the draft reads rows of {self.cfg.input_size} values per position, got {f.shape[-1]}")
        return self.model.real_input(f[None])

    def _tokens(self, tokens: np.ndarray | list[int]) -> torch.Tensor:
        return self._to_device(np.asarray(tokens, dtype=np.int64))[None]

    def _to_device(self, arr: np.ndarray) -> torch.Tensor:
        """A host array on the draft's device.  On CUDA it goes through pinned (page-locked) host memory with a
        non-blocking copy: the GPU fetches it by DMA while the host goes on queueing the step, and nothing
        waits until the round reads its proposals back."""
        t = torch.from_numpy(arr)
        if self.device.type != "cuda":
            return t
        staged, done = self._pinned.get(t.dtype, (None, None))
        if done is not None:
            done.synchronize()  # the previous copy out of this buffer (done long ago when a round read its proposals)
        if staged is None or staged.numel() < t.numel():
            staged = torch.empty(max(t.numel(), 4096), dtype=t.dtype, pin_memory=True)  # grown, never shrunk
        view = staged[: t.numel()].view(t.shape)
        view.copy_(t)
        out = view.to(self.device, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        self._pinned[t.dtype] = (staged, done)
        return out

    @torch.inference_mode()
    def propose_tree(
        self,
        features: np.ndarray,
        tokens: np.ndarray | list[int],
        *,
        top_k: int,
        total_tokens: int,
        depth: int,
        sampling: SamplingConfig | None = None,
        rng: np.random.Generator | None = None,
        p_min: float = 0.0,
    ) -> TreeProposal:
        """Consume real rows, then grow a tree depth by depth (EAGLE-2 style, one batched forward per depth).

        Each depth ranks the children *slots* of the frontier (slot j of node u scores
        log-prob(u) + log of u's j-th largest probability), keeps the best ``top_k`` slots
        and fills them: greedily with the top tokens, or when sampling by drawing that many
        tokens without replacement from the node's processed distribution q.  Drafting stops
        early when the best probability at the frontier falls below ``p_min`` (llama.cpp's
        draft-p-min).  ``top_k`` = 1 is a chain.  The tree's cells stay in the cache at slots
        after ``n_real`` until the caller rolls back.

        A sampled tree fills its ``total_tokens`` level by level: counts are fixed before the
        draw and nothing drawn is pruned afterwards, which recursive rejection needs to stay
        lossless.  A greedy tree is EAGLE-2's whole recipe: every depth expands ``top_k``
        slots, and the ``total_tokens`` best-scoring nodes of all depths are kept (a child
        never outscores its parent, so the kept set is a tree).  Only nodes ranked in the
        best ``total_tokens`` - 1 so far are forwarded, since no other node's child can be
        kept.  So with 2 tokens and ``top_k`` 2 a round verifies a chain of 2 or two
        siblings, whichever the draft rates likelier, for the forwards of a chain of 2.
        """
        m = len(tokens)
        if m == 0 or top_k < 1 or total_tokens < 1:
            raise DraftError("propose_tree needs at least one real row, top_k >= 1 and total_tokens >= 1")
        if self.cache.n + m + total_tokens > self.cfg.max_positions:
            raise DraftError(f"draft context of {self.cfg.max_positions} positions is full")
        greedy = sampling is None or sampling.greedy
        if not greedy and rng is None:
            raise DraftError("sampling proposals need a random generator")
        native_step = greedy and self._native is not None  # greedy drafting on the CPU: the native step
        if native_step and top_k == 1:  # a greedy chain: the native one (auto's chains)
            ids, n_real = self._propose_native(features, tokens, min(depth, total_tokens), p_min)
            n = len(ids)
            return TreeProposal(np.array([-1, *ids], dtype=np.int64), np.arange(-1, n, dtype=np.int64), [None] * (n + 1),
                                n_real, max(0, n - 1))
        if native_step and m <= NATIVE_MAX_ROWS:
            x, feat = self._read_native(features, tokens)
        else:
            x, feat = self._forward(self._real(features), self._tokens(tokens))
        feats = feat[0, -1:]  # [1, n_embd]: predicted feature after the root
        gs = self.model.drafted_input(x, feat)[0, -1:]  # [1, feature_size]: what the root's children read
        n_real = self.cache.n
        toks, parents, score, qs = [-1], [-1], [0.0], [None]
        slot_of: dict[int, int] = {}  # node -> cache slot of its forwarded cell
        frontier, budget, forwards = [0], total_tokens, 0
        forwarded_rows = 0
        for d in range(1, depth + 1):
            if native_step:  # the head's best rows, rescored, as a chain's step ranks them
                top_i, top_p = self._attached_native().head_topk(feats, top_k, self._head._extra)
                local = None
            else:
                local = self._frontier_probs(feats, sampling, greedy)  # [B, n_head] float64
                top_p, top_i = _topk_rows(local, top_k)  # [B, K] each, probabilities descending
            if top_p[:, 0].max() < p_min:
                break
            slots = top_k if greedy else min(top_k, budget)
            new = self._fill_slots(frontier, local, top_p, top_i, slots, greedy, rng, toks, parents, score, qs)
            if greedy:  # forward only the nodes whose children could still be kept
                ahead = set(_best_nodes(score, total_tokens - 1))
                new = [v for v in new if v in ahead]
            else:
                budget -= len(new)
                if budget <= 0:
                    break
            if d == depth or not new:
                break
            feats, gs = self._forward_nodes(new, toks, parents, slot_of, n_real, d, gs, frontier,
                                            native=native_step)
            frontier = new
            forwards += 1
            forwarded_rows += len(new)
        tokens_, parents_ = np.array(toks, dtype=np.int64), np.array(parents, dtype=np.int64)
        if greedy and len(toks) - 1 > total_tokens:
            keep = np.array([0, *sorted(_best_nodes(score, total_tokens))], dtype=np.int64)
            index_of = np.full(len(toks), -1, dtype=np.int64)
            index_of[keep] = np.arange(len(keep))
            tokens_ = tokens_[keep]
            parents_ = np.where(keep == 0, -1, index_of[parents_[keep]])
            qs = [qs[int(i)] for i in keep]
        return TreeProposal(tokens_, parents_, qs, n_real, forwards, forwarded_rows)

    def _frontier_probs(self, feats: torch.Tensor, sampling: SamplingConfig | None, greedy: bool) -> np.ndarray:
        """feats [B, n_embd] -> per-row draft distribution over the head rows [B, n_head] float64."""
        logits = self._head(feats).float()
        if greedy:  # scores only: the raw distribution ranks the tree
            return torch.softmax(logits, dim=-1).double().cpu().numpy()
        rows = logits.cpu().numpy()
        return np.stack([process_logits(r, sampling) for r in rows])

    def _fill_slots(self, frontier, local, top_p, top_i, n_slots, greedy, rng, toks, parents, score, qs) -> list[int]:
        """Pick the best ``n_slots`` (node, rank) slots, then fill them; returns the new nodes.  ``local``: each
        frontier node's distribution over the head rows, which a sampled tree draws from (greedy trees read only
        ``top_p`` and ``top_i``: None there)."""
        B, K = top_p.shape
        with np.errstate(divide="ignore"):
            slot_score = np.array([score[u] for u in frontier])[:, None] + np.log(top_p)  # [B, K]
        order = np.lexsort((np.tile(np.arange(K), B), -slot_score.ravel()))[:n_slots]
        order = [o for o in order if np.isfinite(slot_score.ravel()[o])]
        counts = np.bincount(np.asarray(order, dtype=np.int64) // K, minlength=B)
        d2t = self._d2t
        new: list[int] = []
        for b, u in enumerate(frontier):
            c = int(counts[b])
            if c == 0:
                continue
            if greedy:
                picks, probs = top_i[b, :c], top_p[b, :c]
            else:
                picks = draw_without_replacement(local[b], c, rng)
                probs = local[b, picks]
                q = np.zeros(self.cfg.n_vocab, dtype=np.float64)
                q[d2t] = local[b]
                qs[u] = q
            for h, prob in zip(picks, probs):
                toks.append(int(d2t[int(h)]))
                parents.append(u)
                score.append(score[u] + float(np.log(prob)))
                qs.append(None)
                new.append(len(toks) - 1)
        return new

    def _forward_nodes(self, new, toks, parents, slot_of, n_real, d, gs, frontier, native: bool = False
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """One batched forward of this depth's nodes (inputs: their parents' rows of ``gs``) with a tree
        mask; returns their predicted features [T, n_embd] and what their children read [T, feature_size].
        ``native``: through the native step (greedy trees), which does in one call what torch's forward of a
        level does in a few hundred kernels (``_read_native`` gives the measured gain)."""
        p0, T = self.cache.n, len(new)
        L = p0 + T
        row_of = {u: i for i, u in enumerate(frontier)}
        f_in = torch.stack([gs[row_of[parents[v]]] for v in new])[None]  # [1, T, feature_size]
        tok_in = torch.as_tensor([toks[v] for v in new], device=self.device)[None]
        visible = torch.zeros(T, L, dtype=torch.bool, device=self.device)
        visible[:, :n_real] = True
        for i, v in enumerate(new):
            slot_of[v] = p0 + i
            a = parents[v]
            while a > 0:
                visible[i, slot_of[a]] = True
                a = parents[a]
            visible[i, p0 + i] = True
        if native:
            x, feat = self._attached_native().nodes(f_in[0], tok_in[0].numpy(), p0, np.full(T, n_real + d - 1),
                                                    visible.numpy())
            self.cache.n = L
            x, feat = x.to(self.dtype)[None], feat.to(self.dtype)[None]
        else:
            rope = torch.full((T,), n_real + d - 1, device=self.device, dtype=torch.long)
            x, feat = self._forward_masked(f_in, tok_in, rope, visible)
        return feat[0], self.model.drafted_input(x, feat)[0]

    def _forward_masked(self, g: torch.Tensor, tokens: torch.Tensor, rope: torch.Tensor, visible: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        """g [1, T, feature_size], tokens [1, T] at RoPE positions rope [T], cells appended at n..n+T-1;
        visible [T, n+T] bool says which cells each row attends to -> (pre-norm [1, T, hidden],
        predicted features [1, T, n_embd])."""
        model, cache = self.model, self.cache
        T, p0 = tokens.shape[1], cache.n
        L = p0 + T
        cos, sin = model.rope_cos[rope], model.rope_sin[rope]
        tree_bias = torch.zeros(T, L, device=self.device).masked_fill_(~visible, float("-inf"))
        return self._blocks(g, tokens, cos, sin, p0, L, tree_bias)

    @torch.inference_mode()
    def prefill(self, features: np.ndarray, tokens: np.ndarray | list[int]) -> None:
        """Consume real rows without proposing (used when a prompt is cached ahead of drafting)."""
        self._forward(self._real(features), self._tokens(tokens))

    def _forward(self, g: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """g [1, T, feature_size], tokens [1, T] at positions n..n+T-1 -> (pre-norm [1, T, hidden],
        predicted features [1, T, n_embd])."""
        model, cache = self.model, self.cache
        T, p0 = tokens.shape[1], cache.n
        if T == 1 and self._one_row:
            return self._forward_one(g, tokens)
        L = p0 + T
        cos, sin = model.rope_cos[p0:L], model.rope_sin[p0:L]
        return self._blocks(g, tokens, cos, sin, p0, L, None)

    def _forward_one(self, g: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``_forward`` of one position, g [1, 1, feature_size], tokens [1, 1]: the same arithmetic as
        ``_blocks`` in about half its torch calls.

        WHY: a draft step on the CPU is a few hundred small kernels, and each torch call costs a few
        microseconds of dispatch before it reads a byte; RoPE on q and k together, one bias per block and
        no batch/transposed views cut the calls without changing a value."""
        model, cache = self.model, self.cache
        p = cache.n
        L = p + 1
        nh, nkv, hd = self.cfg.n_heads, self.cfg.n_kv_heads, self.cfg.head_dim
        half = hd // 2
        x, attn_in = model.fusion(g, model.embed[tokens])
        cos, sin = model.rope_cos[p], model.rope_sin[p]  # [hd] float32
        cache.holes[p] = 0.0  # this cell gets real states now
        for i, blk in enumerate(model.blocks):
            if attn_in is not None:
                xn, attn_in = attn_in, None
            else:
                xn = blk.attn_norm(x) if blk.attn_norm is not None else x
            qkv = blk.qkv(xn).view(nh + 2 * nkv, hd)
            qk = qkv[: nh + nkv]
            qk = (qk * cos + torch.cat((-qk[:, half:], qk[:, :half]), dim=-1) * sin).to(qkv.dtype)  # RoPE, as apply_rope
            cache.k[i][0, :, p] = qk[nh:]
            cache.v[i][0, :, p] = qkv[nh + nkv :]
            gated = blk.importance is not None
            if gated:
                cache.log_gate[i][p] = F.logsigmoid(blk.importance(xn).view(()).float())
            bias = self._bias(cache.log_gate[i][:L], 1, L, gated)
            a = _attend_one(qk[:nh].view(1, nh, 1, hd), cache.k[i][:, :, :L], cache.v[i][:, :, :L], bias)
            x = blk.after_attention(x, a.view(1, 1, nh * hd))
        cache.n = L
        return x, model.feature_out(x)

    def _blocks(self, g: torch.Tensor, tokens: torch.Tensor, cos, sin, p0: int, L: int,
                tree_bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Fuse g [1, T, feature_size] with the tokens' embeddings, run the blocks writing cache cells
        p0..L-1 (causal attention, or the tree's visibility ``tree_bias`` [T, L] when given) ->
        (pre-norm [1, T, hidden], predicted features [1, T, n_embd])."""
        model, cache = self.model, self.cache
        x, attn_in = model.fusion(g, model.embed[tokens])
        T = x.shape[1]
        cache.holes[p0:L] = 0.0  # these cells get real states now
        for i, blk in enumerate(model.blocks):
            q, k, v, log_gate = blk.project(x, cos, sin, attn_in)
            attn_in = None
            cache.k[i][:, :, p0:L] = k
            cache.v[i][:, :, p0:L] = v
            if log_gate is not None:
                cache.log_gate[i][p0:L] = log_gate[0]
            if tree_bias is None:
                bias = self._bias(cache.log_gate[i][:L], T, L, log_gate is not None)
            else:
                bias = (self._bias(cache.log_gate[i][:L], 1, L, log_gate is not None).view(1, L) + tree_bias)[None, None]
            x = blk.finish(x, q, cache.k[i][:, :, :L], cache.v[i][:, :, :L], bias)
        cache.n = L
        return x, model.feature_out(x)

    def _bias(self, log_gate: torch.Tensor, T: int, L: int, gated: bool) -> torch.Tensor:
        """Additive attention bias [1, 1, T, L]: causal, plus log s_j, plus the denoising mask and holes."""
        bias = (log_gate if gated else self._zeros[:L]) + self.cache.holes[:L]
        if gated and self._log_threshold is not None and L > self.denoise.recent_window:
            old = L - self.denoise.recent_window  # keys before this index may be dropped
            bias = bias.clone()
            bias[:old].masked_fill_(bias[:old] < self._log_threshold, float("-inf"))
        if T > 1:
            return (bias + _causal_tail(T, L, self.device))[None, None]
        return bias.view(1, 1, 1, L)


def _best_nodes(score: list[float], n: int) -> list[int]:
    """The ``n`` best-scoring nodes past the root, earlier nodes first among equals.  A child scores its
    parent's log-probability plus a non-positive term and comes later, so the set always holds its parents."""
    return sorted(range(1, len(score)), key=lambda u: (-score[u], u))[:max(0, n)]


def _topk_rows(probs: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """probs [B, H] -> the k largest per row, descending: values [B, k], indices [B, k]."""
    k = min(k, probs.shape[1])
    idx = np.argpartition(-probs, k - 1, axis=1)[:, :k]
    vals = np.take_along_axis(probs, idx, axis=1)
    order = np.argsort(-vals, axis=1, kind="stable")
    return np.take_along_axis(vals, order, axis=1), np.take_along_axis(idx, order, axis=1)


def _causal_tail(T: int, L: int, device: torch.device) -> torch.Tensor:
    """[T, L] mask for the last T query rows of a length-L causal attention."""
    rows = torch.arange(L - T, L, device=device)[:, None]
    cols = torch.arange(L, device=device)[None, :]
    return torch.zeros(T, L, device=device).masked_fill_(cols > rows, float("-inf"))
