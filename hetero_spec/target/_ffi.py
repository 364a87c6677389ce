"""The one importer of llama-cpp-python's raw bindings.

Three layers at the C boundary: this module (raw calls, version pin, return codes to
exceptions), the owners below (explicit close order: batch and context before the
model), and ``LlamaTarget`` on top.
"""
from __future__ import annotations

import ctypes
import os
import re
import sys
import threading
from pathlib import Path

import llama_cpp
import llama_cpp.llama_cpp as C

from ..errors import TargetError

PINNED_VERSION = "0.3.36"
if llama_cpp.__version__ != PINNED_VERSION:  # the ctypes structs mirror one llama.h
    raise ImportError(
        f"hetero-spec needs llama-cpp-python=={PINNED_VERSION} (found {llama_cpp.__version__}); "
        "its low-level structs follow llama.h of that release"
    )


_DECODE_CODES = {
    1: "no KV cache slot for the batch (context full)",
    2: "decode aborted",
    -1: "invalid batch",
}

_backend_lock = threading.Lock()
_backend_ready = False
_log_callback = None  # keep a reference: llama.cpp holds the raw function pointer
_log_capture = threading.local()  # .lines: list while a model loads on this thread, else absent
_interrupted = threading.Event()  # Ctrl-C caught inside the log callback (raise_if_interrupted)
_BUFFER_LINE = re.compile(r"(\S+) model buffer size =\s*([0-9.]+) MiB")


def ensure_backend(verbose: bool = False) -> None:
    """Initialise llama.cpp once per process: first put the kernel plan in force (``kernels.py``:
    it must precede llama.cpp's first choice of buffer types), then route its log through a
    callback that keeps the weight-buffer lines of a load and, unless verbose, drops the rest."""
    global _backend_ready, _log_callback
    from .kernels import apply_kernel_plan

    with _backend_lock:
        if _backend_ready:
            return
        apply_kernel_plan()
        echo = verbose or os.environ.get("HETERO_SPEC_LLAMA_LOG") is not None

        @C.llama_log_callback
        def _log(level, text, user_data):  # noqa: ARG001
            try:
                lines = getattr(_log_capture, "lines", None)
                if lines is not None and text:
                    lines.append(text.decode("utf-8", errors="replace"))
                if echo and text:
                    sys.stderr.write(text.decode("utf-8", errors="replace"))
            except KeyboardInterrupt:  # ctypes would print it as ignored and drop it: re-raised after the call
                _interrupted.set()

        _log_callback = _log
        C.llama_log_set(_log_callback, ctypes.c_void_p(0))
        C.llama_backend_init()
        _backend_ready = True


def raise_if_interrupted(free=None) -> None:
    """Re-raise a Ctrl-C that landed in the log callback during the llama.cpp call just made (a model load
    or a context creation logs a lot), after ``free``ing what that call returned: without this the load
    went on and the run finished as if no key had been pressed."""
    if _interrupted.is_set():
        _interrupted.clear()
        if free is not None:
            free()
        raise KeyboardInterrupt


def _weight_buffers(log_lines: list[str]) -> dict[str, float]:
    """``{buffer type: MiB}`` of a model's weights, from llama.cpp's own load log (``CPU_REPACK``,
    ``AMX``, ``CPU_Mapped``, ``CPU``): the kernels its matmuls will run, as llama.cpp chose them."""
    out: dict[str, float] = {}
    for m in _BUFFER_LINE.finditer("".join(log_lines)):
        out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
    return out


def check_decode(rc: int) -> None:
    if rc != 0:
        raise TargetError(f"llama_decode failed ({rc}): {_DECODE_CODES.get(rc, 'internal error')}")


def check_gguf_header(path: Path) -> None:
    """Fail fast with a clear message before llama.cpp aborts or prints pages of log."""
    if not path.is_file():
        raise TargetError(f"model file not found: {path}")
    with path.open("rb") as fh:
        magic = fh.read(4)
    if magic != b"GGUF":
        raise TargetError(f"{path} is not a GGUF file (bad magic {magic!r})")


class _LayerInputs:
    """llama.cpp's per-layer hidden-state output (``llama_set_embeddings_layer_inp`` /
    ``llama_get_embeddings_layer_inp``, llama-ext.h: what its own EAGLE-3 path reads from the target).

    WHY by mangled name: llama-ext.h declares them without ``extern "C"`` and llama-cpp-python
    binds none of them, so the symbols carry Itanium C++ mangling (Linux, macOS).  Where they
    are missing, callers fall back to the eval callback (``layer_taps.py``)."""

    SET = "_Z30llama_set_embeddings_layer_inpP13llama_contextjb"
    GET = "_Z30llama_get_embeddings_layer_inpP13llama_contextj"

    def __init__(self) -> None:
        lib = C._lib
        self.set = getattr(lib, self.SET)
        self.set.argtypes, self.set.restype = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_bool], None
        self.get = getattr(lib, self.GET)
        self.get.argtypes, self.get.restype = [ctypes.c_void_p, ctypes.c_uint32], ctypes.POINTER(ctypes.c_float)


_layer_inputs: "_LayerInputs | None | bool" = False


def layer_inputs() -> "_LayerInputs | None":
    """The layer-input API of this libllama, or None where it is not exported."""
    global _layer_inputs
    if _layer_inputs is False:
        try:
            _layer_inputs = _LayerInputs()
        except AttributeError:
            _layer_inputs = None
    return _layer_inputs


# Architectures whose llama.cpp graph records each block's input (``t_layer_inp``); on others asking
# for it aborts the process, so callers must check first.
LAYER_INPUT_ARCHS = frozenset({"llama", "qwen3", "qwen3moe", "qwen35", "qwen35moe", "qwen3next", "gemma4", "lfm2",
                               "nemotron_h", "gpt-oss", "minimax-m2"})


class Closed(TargetError):
    """A llama.cpp object used after ``close``."""


def _closed(what: str):
    raise Closed(f"the {what} is closed: it was used after close() or outside its with block")


class _Freeable:
    """A llama.cpp object's owner whose pointer ``close`` frees: a freed pointer handed to llama.cpp is a
    segfault of the whole process, so ``ptr`` and what hangs off it (``_live``) raise ``Closed`` instead (an
    object used after its ``close``, such as a lazy stream iterated after its ``with`` block)."""

    _ptr = None
    _what = "object"

    @property
    def ptr(self):
        return self._ptr or _closed(self._what)

    def _live(self, value):
        return value if self._ptr else _closed(self._what)


class ModelHandle(_Freeable):
    """Owns a ``llama_model``; must outlive every context made from it."""

    _vocab = None
    _what = "model"

    def __init__(self, path: Path, *, vocab_only: bool = False) -> None:
        check_gguf_header(path)
        ensure_backend()
        from .kernels import apply_kernel_plan

        self.kernel_plan = apply_kernel_plan()
        params = C.llama_model_default_params()
        params.n_gpu_layers = 0  # the target runs on the CPU by design
        params.vocab_only = vocab_only
        params.use_extra_bufts = self.kernel_plan.extra_bufts
        _log_capture.lines = []
        try:
            self._ptr = C.llama_model_load_from_file(str(path).encode(), params)
            self.weight_buffers = _weight_buffers(_log_capture.lines)  # {buffer type: MiB}
        finally:
            del _log_capture.lines
        raise_if_interrupted(self.close)
        if not self._ptr:
            raise TargetError(f"llama.cpp could not load {path} (corrupt, truncated or unsupported GGUF)")
        self._vocab = C.llama_model_get_vocab(self._ptr)
        self._eog: dict[int, bool] = {}

    @property
    def vocab(self):
        return self._live(self._vocab)

    def is_eog(self, token: int) -> bool:
        """Whether ``token`` ends a generation, remembered per id: asked for every emitted token, and
        a ctypes call right after a decode cost about 4 us (cache-cold) against a dict lookup."""
        known = self._eog.get(token)
        if known is None:
            known = self._eog[token] = bool(C.llama_vocab_is_eog(self.vocab, token))
        return known

    @property
    def kernels(self) -> str:
        """One line: the weight buffer types llama.cpp chose and the plan behind them, for ``--verbose``
        and the run's stats, e.g. ``CPU_REPACK 52 MiB + CPU_Mapped 20 MiB; no-amx (AMX tiles fault ...)``."""
        used = " + ".join(f"{name} {mib:.0f} MiB" for name, mib in sorted(self.weight_buffers.items()))
        return f"{used or 'no weights'}; {self.kernel_plan.describe()}"

    def meta(self, key: str) -> str | None:
        buf = ctypes.create_string_buffer(1 << 16)
        n = C.llama_model_meta_val_str(self.ptr, key.encode(), buf, len(buf))
        return None if n < 0 else buf.value.decode("utf-8", errors="replace")

    def close(self) -> None:
        if self._ptr:
            C.llama_model_free(self._ptr)
            self._ptr = None


class ContextHandle(_Freeable):
    """Owns a ``llama_context``; closed before its model."""

    _memory = None
    _what = "context"

    def __init__(
        self,
        model: ModelHandle,
        *,
        n_ctx: int,
        n_batch: int,
        n_threads: int,
        embeddings: bool,
        n_seq_max: int = 1,
        kv_unified: bool = False,
        flash_attn: int | None = None,
        kv_type: int | None = None,
        n_ubatch: int = 0,
    ) -> None:
        params = C.llama_context_default_params()
        params.n_ctx = n_ctx
        params.n_batch = n_batch
        params.n_ubatch = n_ubatch or n_batch  # micro-batch: the rows one graph computes at once
        params.n_seq_max = n_seq_max
        params.n_threads = n_threads
        params.n_threads_batch = n_threads
        params.embeddings = embeddings
        params.pooling_type = C.LLAMA_POOLING_TYPE_NONE
        params.kv_unified = kv_unified
        if flash_attn is not None:  # -1 auto, 0 off, 1 on (llama_flash_attn_type)
            params.flash_attn_type = flash_attn
        if kv_type is not None:  # ggml_type of both K and V cells (llama.cpp's default is F16)
            params.type_k = params.type_v = kv_type
        params.no_perf = True
        self._ptr = C.llama_init_from_model(model.ptr, params)
        raise_if_interrupted(self.close)
        if not self._ptr:
            raise TargetError(f"llama.cpp could not create a context of {n_ctx} tokens")
        self._memory = C.llama_get_memory(self._ptr)

    @property
    def memory(self):
        return self._live(self._memory)

    def close(self) -> None:
        if self._ptr:
            C.llama_free(self._ptr)
            self._ptr = None


class Owners:
    """Base of the objects that own a model, a context and a batch: closes them batch, context, then
    model, and closes on ``with``.  Subclasses set ``_model``, ``_ctx`` and ``_batch`` (None until made)."""

    _model: ModelHandle | None = None
    _ctx: "ContextHandle | None" = None
    _batch: "BatchHandle | None" = None

    def close(self) -> None:
        for owner in (self._batch, self._ctx, self._model):
            if owner is not None:
                owner.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def is_eog(self, token: int) -> bool:
        return self._model.is_eog(token)


class BatchHandle:
    """Owns a ``llama_batch`` and exposes its arrays as NumPy views, filled without per-row ctypes calls."""

    def __init__(self, capacity: int, n_seq_max: int = 1) -> None:
        import numpy as np

        self.capacity = capacity
        self.raw = C.llama_batch_init(capacity, 0, n_seq_max)
        self.token = np.ctypeslib.as_array(self.raw.token, shape=(capacity,))
        self.pos = np.ctypeslib.as_array(self.raw.pos, shape=(capacity,))
        self.n_seq_id = np.ctypeslib.as_array(self.raw.n_seq_id, shape=(capacity,))
        self.output = np.ctypeslib.as_array(self.raw.logits, shape=(capacity,))
        self.seq_ids = [
            np.ctypeslib.as_array(self.raw.seq_id[i], shape=(n_seq_max,)) for i in range(capacity)
        ]
        for row in self.seq_ids:  # chain decoding: every row in sequence 0
            row[0] = 0
        self.n_seq_id[:] = 1

    def close(self) -> None:
        if self.raw is not None:
            C.llama_batch_free(self.raw)
            self.raw = None
