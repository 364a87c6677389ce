"""Re-quantize a GGUF with llama.cpp's own quantizer (``llama_model_quantize``).

WHY: on a CPU the tensor format decides whether speculation pays off. With embeddings on,
every verified row pays for the LM head, and a tied Q8_0 head costs about 1.4 ms a row
on SmolLM2; an all-Q4_0 file (head included) makes t(1) and t(k+1)/t(1) much smaller.
The output is written to a temporary name and renamed, so a file that exists is whole.
"""
from __future__ import annotations

import ctypes
import warnings
from dataclasses import dataclass
from pathlib import Path

from .. import atomic_file
from ..errors import TargetError
from ._ffi import C, check_gguf_header, ensure_backend, raise_if_interrupted


class QuantizeError(TargetError):
    pass


# Names users type (as llama-quantize spells them) -> llama_ftype.  Built once from the binding.
FTYPES: dict[str, int] = {
    name[len("LLAMA_FTYPE_MOSTLY_"):]: getattr(C, name)
    for name in dir(C)
    if name.startswith("LLAMA_FTYPE_MOSTLY_")
}
FTYPES["F32"] = C.LLAMA_FTYPE_ALL_F32
# Tensor types for --token-embedding-type / --output-tensor-type -> ggml_type.
TENSOR_TYPES: dict[str, int] = {
    name[len("GGML_TYPE_"):]: getattr(C, name)
    for name in dir(C)
    if name.startswith("GGML_TYPE_") and name != "GGML_TYPE_COUNT"
}
TENSOR_TYPES.setdefault("BF16", 30)  # GGML_TYPE_BF16: ggml has it, the binding does not name it
_FLOAT_FILE_TYPES = {0, 1, 32}  # general.file_type of ALL_F32, MOSTLY_F16, MOSTLY_BF16


@dataclass(frozen=True)
class QuantizeOptions:
    type: str = "Q4_0"
    token_embedding_type: str | None = None  # None = llama.cpp's choice for the file type
    output_tensor_type: str | None = None
    threads: int = 0  # 0 = all cores
    pure: bool = False  # every tensor gets `type` (llama.cpp otherwise keeps some at higher precision)


def _lookup(table: dict[str, int], name: str, what: str) -> int:
    key = name.upper().replace("-", "_")
    if key not in table:
        raise QuantizeError(f"unknown {what} {name!r}; choose one of: {', '.join(sorted(table))}")
    return table[key]


def is_requantization(path: Path) -> bool:
    """True when the source already holds quantized tensors (quality loss compounds)."""
    try:
        from gguf import GGUFReader

        field = GGUFReader(path, "r").fields.get("general.file_type")
        return field is not None and int(field.parts[field.data[0]][0]) not in _FLOAT_FILE_TYPES
    except Exception:  # unreadable metadata: let llama.cpp judge the file
        return True


def quantize(src: str | Path, dst: str | Path, options: QuantizeOptions = QuantizeOptions()) -> Path:
    """Write ``dst``: ``src`` quantized to ``options.type``; returns the output path."""
    src, dst = Path(src), Path(dst)
    check_gguf_header(src)
    if src.resolve() == dst.resolve():
        raise QuantizeError("the output must differ from the input")
    params = C.llama_model_quantize_default_params()
    params.ftype = _lookup(FTYPES, options.type, "quantization type")
    if options.token_embedding_type:
        params.token_embedding_type = _lookup(TENSOR_TYPES, options.token_embedding_type, "tensor type")
    if options.output_tensor_type:
        params.output_tensor_type = _lookup(TENSOR_TYPES, options.output_tensor_type, "tensor type")
    params.nthread = options.threads
    params.allow_requantize = True
    params.pure = options.pure
    if is_requantization(src):
        warnings.warn(f"{src.name} is already quantized; re-quantizing compounds the rounding error",
                      UserWarning, stacklevel=2)
    ensure_backend()
    with atomic_file.replacing(dst) as tmp:
        rc = C.llama_model_quantize(str(src).encode(), str(tmp).encode(), ctypes.byref(params))
        raise_if_interrupted()  # a Ctrl-C during its per-tensor log lines; the temporary goes with it
        if rc != 0:
            raise QuantizeError(f"llama.cpp could not quantize {src} to {options.type} (code {rc}; "
                                "corrupt file or unsupported type)")
    return dst
