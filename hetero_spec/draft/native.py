"""The CPU draft's greedy chain as one native call (``native_step.cpp``), built for this CPU at first use.

WHY: a torch draft step on the CPU is about 250 kernel calls around 9 matrix-vector products, and on a
2-core machine their dispatch (2-4 us each), not the 9 MB of int8 weights, set the step's 1.5-2 ms
(scripts/bench_draft_step.py).  The native chain runs k steps and their head argmaxes in one call; a greedy
tree's real rows (``NativeChain.read``), each of its levels (``NativeChain.nodes``) and each level's head ranking
(``NativeChain.head_topk``) are a call each, for the same reason (scripts/bench_tree_draft.py).  Its head,
half of those bytes, is int4 (its best 16 rows rescored in float): right after a target decode the weights
come from memory, where bytes cost most (docs/bench.md, "The draft step").

Built with the system's C++ compiler (``g++``, or ``$CXX``) and OpenMP, for the host CPU
(``-march=native``; ``HETERO_SPEC_NATIVE_MARCH`` picks another target, which is how the tests cover the
generic AVX2 build on an AVX-512 host), once per source, compiler and CPU, into the user cache.  Without
a compiler, or with ``HETERO_SPEC_NATIVE_DRAFT=0``, the draft keeps its torch step.

>>> lib = load_library()                       # None: no compiler, or turned off
>>> chain = NativeChain(lib, model, cache, denoise, threads=2)   # model: the float DraftModel
>>> ids, written = chain.run(rows, tokens, p0, k, extra=None, d2t=d2t)   # rows: the target's [m, input_size]
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch

from .. import atomic_file
from ..cpu_features import cpu_info
from ..config import DenoiseConfig
from .huge_pages import HugePageArena
from .int8 import HEAD

SOURCE = Path(__file__).with_name("native_step.cpp")
MAX_RESCORE = 64  # native_step.cpp's top-row buffer
# the head's best rows rescored in float, by head precision: on the shipped draft's held-out features the float
# argmax was among the int8 head's best 4 and the int4 head's best 16 on every one of about 900 steps
RESCORE = {8: 8, 4: 16}


class _QMat(ctypes.Structure):
    _fields_ = [("w", ctypes.c_void_p), ("scale", ctypes.c_void_p), ("bias", ctypes.c_void_p), ("wsum", ctypes.c_void_p),
                ("inv_smooth", ctypes.c_void_p), ("out", ctypes.c_int32), ("in_", ctypes.c_int32), ("act_q", ctypes.c_int32),
                ("bits", ctypes.c_int32)]


class _Block(ctypes.Structure):
    _fields_ = [("attn_norm", ctypes.c_void_p), ("qkv", _QMat), ("o", _QMat), ("gate_up", _QMat), ("down", _QMat),
                ("importance_w", ctypes.c_void_p), ("importance_b", ctypes.c_float), ("ffn_norm", ctypes.c_void_p),
                ("k_cache", ctypes.c_void_p), ("v_cache", ctypes.c_void_p), ("log_gate", ctypes.c_void_p)]


class _Model(ctypes.Structure):
    _fields_ = [(n, ctypes.c_int32) for n in ("hidden", "n_embd", "n_heads", "n_kv", "head_dim", "ffn", "n_blocks",
                                             "max_pos", "fusion", "drafted_is_prenorm")] + [
        ("eps", ctypes.c_float), ("recent_window", ctypes.c_int32), ("has_threshold", ctypes.c_int32),
        ("log_threshold", ctypes.c_float), ("embed", ctypes.c_void_p), ("rope_cos", ctypes.c_void_p),
        ("rope_sin", ctypes.c_void_p), ("tap", _QMat), ("w1", _QMat), ("w2", _QMat), ("wz", _QMat), ("emb_norm", ctypes.c_void_p),
        ("final_norm", ctypes.c_void_p), ("out_proj", _QMat), ("head", _QMat), ("head_f32", ctypes.c_void_p),
        ("rescore", ctypes.c_int32), ("blocks", ctypes.POINTER(_Block)), ("holes", ctypes.c_void_p)]


def _march() -> str:
    return os.environ.get("HETERO_SPEC_NATIVE_MARCH", "native")


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CXX", "g++"))


def library_path(march: str | None = None) -> Path | None:
    """Where the library for this source, compiler, target and CPU is (or would be) cached; None: no compiler."""
    from ..target.gguf_weights import cache_dir  # hetero-spec's cache root (gguf only, no llama.cpp)

    cxx = _compiler()
    if cxx is None:
        return None
    march = march or _march()
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout.splitlines()[:1]
    name, flags = cpu_info()  # -march=native builds for these: another CPU (or VM) gets its own build
    parts = [SOURCE.read_text(), cxx, *version, march, name, *sorted(flags)]
    key = hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]
    return cache_dir() / "native" / f"draft_step-{march}-{key}.so"


def build(march: str | None = None) -> Path | None:
    """Compile the library unless cached (written under a temporary name, then renamed: never half-written)."""
    path = library_path(march)
    if path is None or path.exists():
        return path
    # -fno-math-errno: expf may then be vectorized (the p-min softmax over the head's rows)
    cmd = [_compiler(), "-O3", f"-march={march or _march()}", "-fopenmp", "-fno-math-errno", "-shared", "-fPIC", "-std=c++17",
           str(SOURCE), "-o"]
    try:
        with atomic_file.replacing(path) as tmp:
            subprocess.run([*cmd, str(tmp)], capture_output=True, text=True, check=True)
    except subprocess.CalledProcessError:
        return None
    return path


def load_library(march: str | None = None) -> ctypes.CDLL | None:
    """The built library for ``march`` (default: ``HETERO_SPEC_NATIVE_MARCH``, else the host CPU), or None: no
    compiler, the build failed, or ``HETERO_SPEC_NATIVE_DRAFT=0``."""
    if os.environ.get("HETERO_SPEC_NATIVE_DRAFT", "1") == "0":
        return None
    return _load(march or _march())


@lru_cache(maxsize=None)
def _load(march: str) -> ctypes.CDLL | None:
    path = build(march)
    if path is None:
        return None
    lib = ctypes.CDLL(str(path))
    lib.draft_chain.restype = ctypes.c_int32
    p = ctypes.c_void_p
    i32 = ctypes.c_int32
    lib.draft_chain.argtypes = [ctypes.POINTER(_Model), p, i32, p, p, p, i32, i32, p, i32, p, i32, ctypes.c_float, p,
                                ctypes.POINTER(i32)]
    lib.draft_rows.restype = ctypes.c_int32
    lib.draft_rows.argtypes = [ctypes.POINTER(_Model), p, i32, p, i32, i32, p, p]
    lib.draft_nodes.restype = ctypes.c_int32
    lib.draft_nodes.argtypes = [ctypes.POINTER(_Model), p, i32, p, i32, p, p, i32, p, p]
    lib.head_topk.restype = ctypes.c_int32
    lib.head_topk.argtypes = [ctypes.POINTER(_Model), p, i32, p, i32, i32, i32, p, p]
    lib.kernel_name.restype = ctypes.c_char_p
    lib.head_logits.restype = None
    lib.head_logits.argtypes = [ctypes.POINTER(_Model), p, p, i32]
    return lib


def kernel_name(lib: ctypes.CDLL) -> str:
    """The integer kernel a build took: ``avx512-vnni``, ``avx2`` or ``generic``."""
    return lib.kernel_name().decode()


def supports(model) -> bool:
    """Whether the native chain covers this draft: dgf or fc fusion on the CPU (eagle3's first block reads
    the fusion's own wide input, which only the torch step has)."""
    return model.cfg.fusion in ("dgf", "fc")


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class NativeChain:
    """The draft's weights as int8 rows with float scales, and the ctypes model over them and the runner's cache.

    ``model``: the float32 DraftModel (before the torch int8 layers replace its linears); ``cache``: the
    runner's DraftCache (float32, written in place, so torch and native steps share it)."""

    def __init__(self, lib: ctypes.CDLL, model, cache, denoise: DenoiseConfig, threads: int,
                 smooth: dict[str, torch.Tensor] | None = None, quantize_activations: bool = True,
                 head_bits: int | None = None, rescore: int | None = None) -> None:
        """``quantize_activations`` False: every layer keeps float activations (slower; the tests' exact reference).
        ``head_bits``: 4 (the default with quantized activations) or 8; ``rescore``: how many of the head's best
        rows are rescored in float (default ``RESCORE[head_bits]``)."""
        self.lib, self.threads = lib, threads
        self._smooth = smooth or {}
        self._act_q = quantize_activations
        cfg = model.cfg
        self._keep: list[torch.Tensor] = []  # everything the native model points at
        # what every step streams (quantized weights, their scales, norms) goes to 2 MB pages: huge_pages.py says why
        linears = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
        self.arena = HugePageArena(linears + model.head.numel() + (4 << 20))
        m = _Model()
        m.hidden, m.n_embd, m.n_heads, m.n_kv, m.head_dim = cfg.hidden_size, cfg.n_embd, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        m.ffn, m.n_blocks, m.max_pos = cfg.ffn_size, cfg.n_blocks, cfg.max_positions
        m.fusion = {"dgf": 0, "fc": 1}[cfg.fusion]
        m.drafted_is_prenorm = int(model.tap_fc is not None)
        m.eps = cfg.rms_eps
        m.recent_window = denoise.recent_window
        m.has_threshold = int(denoise.threshold > 0)
        m.log_threshold = float(np.log(denoise.threshold)) if denoise.threshold > 0 else 0.0
        m.embed = self._f32(model.embed, hot=False)  # a row a step
        m.rope_cos, m.rope_sin = self._f32(model.rope_cos, hot=False), self._f32(model.rope_sin, hot=False)
        if model.tap_fc is not None:  # g = W (f * tap_scale): raw taps carry channels of RMS 1,200, so float rows
            m.tap = self._qw(model.tap_fc.weight, None)
            m.tap.inv_smooth = self._f32(model.tap_scale)
        fusion = model.fusion
        if cfg.fusion == "dgf":
            # w1 reads g (the target's state, outlier channels and all) as float; w2 (a normed embedding) and wz
            # quantize their rows
            m.w1, m.w2, m.wz = self._q(fusion.w1), self._q(fusion.w2, "fusion.w2"), self._q(fusion.wz, "fusion.wz")
            m.emb_norm = self._f32(fusion.emb_norm.weight)
        else:
            m.w1 = self._q(fusion.fc)
        m.final_norm = self._f32(model.norm.weight) if model.norm is not None else None
        if model.out_proj is not None:
            m.out_proj = self._q(model.out_proj, "out_proj")
        self.head_bits = head_bits or (4 if quantize_activations else 8)
        if self.head_bits == 4 and not quantize_activations:
            raise ValueError("an int4 head multiplies quantized activations")
        if self.head_bits == 4:
            m.head = self._q4(model.head)
        else:
            m.head = self._qw(model.head, None, self._smooth.get(HEAD), act_q=self._act_q)
        m.head_f32 = self._f32(model.head, hot=False)  # only the rescored rows are read
        m.rescore = min(rescore or RESCORE[self.head_bits], MAX_RESCORE, model.head.shape[0])
        blocks = (_Block * cfg.n_blocks)()
        for i, blk in enumerate(model.blocks):
            b = blocks[i]
            b.attn_norm = self._f32(blk.attn_norm.weight) if blk.attn_norm is not None else None
            b.qkv, b.o, b.gate_up, b.down = (self._q(getattr(blk, n), f"blocks.{i}.{n}") for n in ("qkv", "o", "gate_up", "down"))
            if blk.importance is not None:
                b.importance_w = self._f32(blk.importance.weight[0])
                b.importance_b = float(blk.importance.bias.detach()[0])
            b.ffn_norm = self._f32(blk.ffn_norm.weight)
        self._blocks, self._model = blocks, m
        self.cache = None
        if cache is not None:
            self.attach(cache)

    def attach(self, cache) -> None:
        """Point the native model at a cache's tensors (float32, contiguous: the runner's own)."""
        for t in [*cache.k, *cache.v, *cache.log_gate, cache.holes]:
            if t.dtype != torch.float32 or not t.is_contiguous():
                raise ValueError("the native draft step needs a contiguous float32 cache")
        for i in range(len(cache.k)):
            b = self._blocks[i]
            b.k_cache, b.v_cache, b.log_gate = cache.k[i].data_ptr(), cache.v[i].data_ptr(), cache.log_gate[i].data_ptr()
        self._model.holes = cache.holes.data_ptr()
        self._model.blocks = ctypes.cast(self._blocks, ctypes.POINTER(_Block))
        self.cache = cache

    def _f32(self, t: torch.Tensor, hot: bool = True) -> int:
        t = t.detach().to(torch.float32).contiguous()
        if hot:
            t = self.arena.place(t)
        self._keep.append(t)
        return t.data_ptr()

    def _qw(self, weight: torch.Tensor, bias: torch.Tensor | None, smooth: torch.Tensor | None = None,
            act_q: bool = False) -> _QMat:
        """Per-output-row symmetric int8 (scale = absmax / 127) of a float weight [out, in].  ``act_q``: the
        activation row is quantized too, after dividing by ``smooth`` [in] (folded into the weight here)."""
        w = weight.detach().float()
        inv_smooth = None
        if act_q and smooth is not None:
            w = w * smooth.float()
            inv_smooth = (1.0 / smooth.float()).contiguous()
        scale = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-12).contiguous()
        q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8).contiguous()
        wsum = q.sum(dim=1, dtype=torch.int32).contiguous()
        q, scale, wsum = (self.arena.place(t) for t in (q, scale, wsum))
        if inv_smooth is not None:
            inv_smooth = self.arena.place(inv_smooth)
        self._keep += [q, scale, wsum] + ([inv_smooth] if inv_smooth is not None else [])
        out = _QMat(q.data_ptr(), scale.data_ptr(), None, wsum.data_ptr(), _ptr(inv_smooth), w.shape[0], w.shape[1],
                    int(act_q))
        if bias is not None:
            out.bias = self._f32(bias)
        return out

    def _q4(self, weight: torch.Tensor) -> _QMat:
        """Per-output-row symmetric int4 (scale = absmax / 7), packed as ``dot_q4`` in native_step.cpp reads it:
        the row padded with zeros to blocks of 64, block b's byte i holding weights 64b+i (low nibble) and
        64b+32+i (high), each plus 8.  Activations are quantized, without SmoothQuant's scales: folded into the
        weights they widen a row's range, and at 16 levels that lost the float argmax on 1% of steps."""
        w = weight.detach().float()
        out, n = w.shape
        scale = (w.abs().amax(dim=1) / 7.0).clamp_min(1e-12).contiguous()
        q = (torch.round(w / scale[:, None]).clamp(-8, 7) + 8).to(torch.uint8)
        blocks = (n + 63) // 64
        q = torch.nn.functional.pad(q, (0, blocks * 64 - n), value=8).reshape(out, blocks, 2, 32)
        packed = self.arena.place((q[:, :, 0] | (q[:, :, 1] << 4)).contiguous())  # [out, blocks, 32]
        scale = self.arena.place(scale)
        self._keep += [packed, scale]
        return _QMat(packed.data_ptr(), scale.data_ptr(), None, None, None, out, n, 1, 4)

    def read(self, rows: torch.Tensor, tokens: np.ndarray, p0: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Read the target's real rows [m, input_size] float32 (and the token after each) into cells p0..p0+m-1;
        returns the last one's state: x [hidden] (pre-norm) and its predicted feature [n_embd].  A tree round's
        root (``DraftRunner.propose_tree``): the same cells ``run`` writes for its real rows."""
        rows = rows.contiguous()
        tokens = np.ascontiguousarray(tokens, dtype=np.int64)
        x = torch.empty(self._model.hidden, dtype=torch.float32)
        feat = torch.empty(self._model.n_embd, dtype=torch.float32)
        written = self.lib.draft_rows(ctypes.byref(self._model), rows.data_ptr(), rows.shape[0], tokens.ctypes.data, p0,
                                      self.threads, x.data_ptr(), feat.data_ptr())
        if written < 0:
            raise ValueError("draft context is full")
        return x, feat

    def nodes(self, g: torch.Tensor, tokens: np.ndarray, p0: int, positions: np.ndarray, visible: np.ndarray
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """One level of a greedy tree: its nodes' g [T, feature_size] float32 (their parents' drafted input) and
        tokens [T], at RoPE ``positions`` [T], into cells p0..p0+T-1, node i attending to the cells ``visible``
        [T, p0 + T] (bool) marks.  Returns every node's x [T, hidden] (pre-norm) and feature [T, n_embd]."""
        g = g.detach().to(torch.float32).contiguous()
        T = g.shape[0]
        tokens = np.ascontiguousarray(tokens, dtype=np.int64)
        positions = np.ascontiguousarray(positions, dtype=np.int32)
        visible = np.ascontiguousarray(visible, dtype=np.uint8)
        if tokens.shape != (T,) or positions.shape != (T,) or visible.shape != (T, p0 + T):
            raise ValueError("a tree level needs a token, a position and a row of visible cells per node")
        x = torch.empty(T, self._model.hidden, dtype=torch.float32)
        feat = torch.empty(T, self._model.n_embd, dtype=torch.float32)
        written = self.lib.draft_nodes(ctypes.byref(self._model), g.data_ptr(), T, tokens.ctypes.data, p0,
                                       positions.ctypes.data, visible.ctypes.data, self.threads, x.data_ptr(),
                                       feat.data_ptr())
        if written < 0:
            raise ValueError("draft context is full")
        return x, feat

    def head_topk(self, feats: torch.Tensor, k: int, extra: torch.Tensor | None) -> tuple[np.ndarray, np.ndarray]:
        """A greedy tree level's ranking: for each feature of ``feats`` [B, n_embd], its ``k`` best head rows (the
        context head's ``extra`` [n, n_embd] rows numbered after the head's), best first, [B, k'] int64, and their
        probabilities over every row, [B, k'] float64 (k' = k, or fewer where there are fewer rows).  The head's
        best rows are rescored in float, as ``run``'s chain does, so the first row is the chain's token."""
        feats = feats.detach().to(torch.float32).contiguous()
        B = feats.shape[0]
        rows = np.empty((B, k), dtype=np.int32)
        probs = np.empty((B, k), dtype=np.float32)
        n_extra = 0 if extra is None else extra.shape[0]
        if extra is not None:
            extra = extra.detach().to(torch.float32).contiguous()
        kk = self.lib.head_topk(ctypes.byref(self._model), feats.data_ptr(), B,
                                None if extra is None else extra.data_ptr(), n_extra, k, self.threads,
                                rows.ctypes.data, probs.ctypes.data)
        if kk < 0:
            raise ValueError(f"the native head ranks at most {MAX_RESCORE} rows, not {k}")
        return rows[:, :kk].astype(np.int64), probs[:, :kk].astype(np.float64)

    def head_logits(self, feat: torch.Tensor) -> torch.Tensor:
        """The head's int4 or int8 logits of one feature [n_embd], before rescoring (the tests' view of the kernel)."""
        feat = feat.detach().float().contiguous()
        out = torch.empty(self._model.head.out, dtype=torch.float32)
        self.lib.head_logits(ctypes.byref(self._model), feat.data_ptr(), out.data_ptr(), self.threads)
        return out

    def _q(self, linear: torch.nn.Linear, name: str | None = None) -> _QMat:
        """A linear layer; named layers (those torch quantizes too) get quantized activations."""
        return self._qw(linear.weight, linear.bias, self._smooth.get(name), act_q=name is not None and self._act_q)

    def run(self, rows: torch.Tensor | None, tokens: np.ndarray | None, p0: int, k: int, extra: torch.Tensor | None,
            d2t: torch.Tensor, p_min: float = 0.0, x0: torch.Tensor | None = None,
            feat0: torch.Tensor | None = None) -> tuple[list[int], int]:
        """Up to k greedy target ids, and how many cache cells from p0 were written.

        ``rows`` [m, input_size] float32: the target's real rows at p0.. (its taps, or its features) with
        ``tokens`` [m] int64 the token after each; or None, with ``x0`` [hidden] (pre-norm) and ``feat0``
        [n_embd] the state of the position before p0.  ``extra`` [n, n_embd] float32: the context head's added
        rows; ``d2t`` int64: head row -> target id over both parts.  ``p_min`` > 0: the chain stops before a
        proposal whose probability is below it."""
        out = np.empty(k, dtype=np.int64)
        n_out = ctypes.c_int32(0)
        n_extra = 0 if extra is None else extra.shape[0]
        if rows is not None:
            rows = rows.contiguous()
            tokens = np.ascontiguousarray(tokens, dtype=np.int64)
            args = (rows.data_ptr(), rows.shape[0], tokens.ctypes.data, None, None)
        else:
            x0, feat0 = x0.contiguous(), feat0.contiguous()
            args = (None, 0, None, x0.data_ptr(), feat0.data_ptr())
        written = self.lib.draft_chain(ctypes.byref(self._model), *args, p0, k,
                                       None if extra is None else extra.data_ptr(), n_extra, d2t.data_ptr(),
                                       self.threads, float(p_min), out.ctypes.data, ctypes.byref(n_out))
        if written < 0:
            raise ValueError("draft context is full")
        return out[: n_out.value].tolist(), written
