"""Hidden states of intermediate blocks through llama.cpp's eval callback (``cb_eval``).

WHY: multi-layer fusion (EAGLE-3 style) wants the residual stream after chosen blocks, which
llama.cpp never returns through its public getters.  The scheduler's eval callback is
asked, for every graph node, whether we want to see it; we say yes to ``l_out-<i>`` (the
residual stream after block i, ``[n_tokens, n_embd]`` float32) and copy it when computed.
Observing nodes splits the graph there but does not change any arithmetic, so the final
hidden states stay what ``LlamaTarget`` returns (a test checks it bitwise).

The same callback also serves plain feature export: with ``skip_head`` it copies
the final-norm hidden state and answers "stop" after it, so the scheduler
never runs the LM head.  With pooling NONE llama.cpp would otherwise multiply every row by
the [n_vocab, n_embd] head, which export does not need (unless it keeps top-k log-probs).

The callback needs three ggml functions (tensor name, size, copy-out) from ``libggml-base``,
which llama-cpp-python ships beside ``libllama``; they are declared here rather than in
``_ffi`` only because that module belongs to the runtime.
"""
from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Callable

import numpy as np

from ..config import DEFAULT_KV_TYPE
from ..errors import TargetError
from . import _ffi
from ._ffi import C, BatchHandle, ModelHandle, raise_if_interrupted


def _libggml() -> ctypes.CDLL:
    lib_dir = Path(C.__file__).parent / "lib"
    for name in ("libggml-base.so", "libggml-base.dylib", "ggml-base.dll"):
        if (lib_dir / name).exists():
            lib = ctypes.CDLL(str(lib_dir / name))
            break
    else:
        raise TargetError(f"libggml-base not found beside libllama in {lib_dir}; --layers is unavailable")
    lib.ggml_get_name.argtypes, lib.ggml_get_name.restype = [ctypes.c_void_p], ctypes.c_char_p
    lib.ggml_nbytes.argtypes, lib.ggml_nbytes.restype = [ctypes.c_void_p], ctypes.c_size_t
    lib.ggml_backend_tensor_get.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]
    lib.ggml_backend_tensor_get.restype = None
    return lib


# llama.cpp's names for the final-norm hidden state: ``result_norm``, renamed ``result_embd_pooled``
# when pooling NONE passes the same tensor through
RESULT_NORM = (b"result_norm", b"result_embd_pooled")
FINAL = -1  # its key among the captured tensors


class _TensorHead(ctypes.Structure):
    """The stable head of ``struct ggml_tensor``: type, buffer, ne[4] (ggml.h)."""

    _fields_ = [("type", ctypes.c_int), ("buffer", ctypes.c_void_p), ("ne", ctypes.c_int64 * 4)]


class LayerTapTarget:
    """One sequence decoded from scratch, returning final hidden states, logits and chosen block outputs.

    >>> with LayerTapTarget("SmolLM2.gguf", layers=(2, 15)) as t:
    ...     hidden, layers = t.run(ids)   # [T, d], {2: [T, d], 15: [T, d]}
    """

    def __init__(self, path: str | Path, layers: tuple[int, ...], *, n_ctx: int = 2048, n_batch: int = 32,
                 n_threads: int = 0, skip_head: bool = False, kv_type: str = DEFAULT_KV_TYPE) -> None:
        from .llama_target import default_threads, kv_type_id

        self._ggml = _libggml()
        self._model = ModelHandle(Path(path))
        self._ctx = None
        self._batch = None
        self.n_layer = C.llama_model_n_layer(self._model.ptr)
        bad = [i for i in layers if not 0 <= i < self.n_layer]
        if bad:
            self.close()
            raise TargetError(f"--layers {bad} out of range: the model has blocks 0..{self.n_layer - 1}")
        self.layers = tuple(layers)
        self.n_embd = C.llama_model_n_embd(self._model.ptr)
        self.n_vocab = C.llama_vocab_n_tokens(self._model.vocab)
        self.n_batch = n_batch
        self._wanted: dict[bytes, int] = {f"l_out-{i}".encode(): i for i in layers}
        self.skip_head = skip_head
        if skip_head:
            self._wanted.update(dict.fromkeys(RESULT_NORM, FINAL))
        self._captured: dict[int, np.ndarray] = {}
        self._pending_error: BaseException | None = None
        self._callback = C.ggml_backend_sched_eval_callback(self._on_tensor)  # keep a reference
        params = C.llama_context_default_params()
        params.n_ctx, params.n_batch, params.n_ubatch = n_ctx, n_batch, n_batch
        params.n_threads = params.n_threads_batch = n_threads or default_threads()
        params.embeddings = True
        params.pooling_type = C.LLAMA_POOLING_TYPE_NONE
        params.no_perf = True
        params.type_k = params.type_v = kv_type_id(kv_type, self._model)  # as LlamaTarget
        params.cb_eval = self._callback
        params.cb_eval_user_data = None
        self._ctx = C.llama_init_from_model(self._model.ptr, params)
        raise_if_interrupted(self.close)
        if not self._ctx:
            self.close()
            raise TargetError(f"llama.cpp could not create a context of {n_ctx} tokens")
        self._memory = C.llama_get_memory(self._ctx)
        self._batch = BatchHandle(n_batch)

    def _on_tensor(self, tensor, ask, user_data) -> bool:  # noqa: ARG002
        # An exception cannot cross the C frames (ctypes would print and drop it, Ctrl-C
        # included): keep it, stop the graph, and re-raise once llama_decode has returned.
        try:
            return self._observe(tensor, ask)
        except BaseException as exc:  # noqa: BLE001
            self._pending_error = exc
            return False

    def _observe(self, tensor, ask: bool) -> bool:
        name = self._ggml.ggml_get_name(tensor)
        layer = self._wanted.get(name)
        if ask:
            return layer is not None
        if layer is not None:
            head = _TensorHead.from_address(tensor)
            n_embd, n_tok = int(head.ne[0]), int(head.ne[1])
            out = np.empty((n_tok, n_embd), dtype=np.float32)  # ggml ne0 is the row length
            self._ggml.ggml_backend_tensor_get(tensor, out.ctypes.data, 0, out.nbytes)
            self._captured[layer] = out
            if layer == FINAL:
                return False  # the final-norm rows are all we need: stop before the LM head
        return True

    def run(self, ids: list[int], on_logits: Callable[[int, np.ndarray], None] | None = None
            ) -> tuple[np.ndarray, dict[int, np.ndarray]]:
        """hidden ``[T, n_embd] f32`` and {layer: ``[T, n_embd] f32``}.

        ``on_logits(first_row, logits)`` sees each micro-batch's logits ``[n, n_vocab] f32``
        (a view, valid during the call), so a caller never holds ``[T, n_vocab]`` at once;
        it needs the head, so not with ``skip_head``.
        """
        if on_logits is not None and self.skip_head:
            raise TargetError("logits requested from a context that skips the LM head")
        C.llama_memory_clear(self._memory, True)
        T = len(ids)
        hidden = np.empty((T, self.n_embd), dtype=np.float32)
        layers = {i: np.empty((T, self.n_embd), dtype=np.float32) for i in self.layers}
        b = self._batch
        for a in range(0, T, self.n_batch):
            chunk = ids[a : a + self.n_batch]
            n = len(chunk)
            b.token[:n], b.pos[:n], b.output[:n] = chunk, np.arange(a, a + n, dtype=np.int32), 1
            b.raw.n_tokens = n
            self._captured.clear()
            self._pending_error = None
            status = C.llama_decode(self._ctx, b.raw)
            if self._pending_error is not None:
                raise self._pending_error
            _ffi.check_decode(status)
            if self.skip_head:
                if FINAL not in self._captured:
                    raise TargetError("llama.cpp did not expose the final-norm hidden state for this architecture")
                hidden[a : a + n] = self._captured[FINAL]
            else:
                hidden[a : a + n] = np.ctypeslib.as_array(C.llama_get_embeddings(self._ctx), shape=(n, self.n_embd))
            if on_logits is not None:
                on_logits(a, np.ctypeslib.as_array(C.llama_get_logits(self._ctx), shape=(n, self.n_vocab)))
            for i in self.layers:
                if i not in self._captured:
                    raise TargetError(f"llama.cpp did not expose l_out-{i} for this architecture")
                layers[i][a : a + n] = self._captured[i]
        return hidden, layers

    def close(self) -> None:
        if self._batch is not None:
            self._batch.close()
            self._batch = None
        if self._ctx:
            C.llama_free(self._ctx)
            self._ctx = None
        if self._model is not None:
            self._model.close()
            self._model = None

    def __enter__(self) -> "LayerTapTarget":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
