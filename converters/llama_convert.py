"""llama.cpp's own HF -> GGUF converter, run on an exported EAGLE-3 directory.

The converter is the one vendored in the llama-cpp-python sdist we pin (the same llama.cpp commit
as our bindings and as ``scripts/build_llama_cpp.sh``'s binaries), so the GGUF it writes is what
that llama.cpp reads.  It runs in a subprocess with the current Python: it puts its own gguf-py
first on ``sys.path``, which must not leak into this process.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from hetero_spec.errors import HeteroSpecError

from .target_meta import TargetMeta

SRC_ENV = "HETERO_SPEC_LLAMA_CPP_SRC"  # an unpacked llama.cpp tree with convert_hf_to_gguf.py
WRAPPER = Path(__file__).with_name("_convert_with_target_vocab.py")
OUTTYPES = ("f32", "f16", "bf16", "q8_0")


class ConvertError(HeteroSpecError):
    """The converter could not be found or fetched, or it failed; the message says why."""


def _cache_root() -> Path:
    from hetero_spec.target._ffi import PINNED_VERSION

    cache = Path(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")))
    return cache / "hetero-spec" / f"llama.cpp-{PINNED_VERSION}"


def _is_tree(path: Path) -> bool:
    return (path / "convert_hf_to_gguf.py").is_file() and (path / "gguf-py").is_dir()


def find_converter(fetch: bool = True) -> Path:
    """The llama.cpp tree holding convert_hf_to_gguf.py: ``$HETERO_SPEC_LLAMA_CPP_SRC``, else the sdist that
    ``scripts/build_llama_cpp.sh`` unpacked, else (``fetch``) the sdist fetched now with pip."""
    from hetero_spec.target._ffi import PINNED_VERSION

    env = os.environ.get(SRC_ENV)
    if env:
        if not _is_tree(Path(env)):
            raise ConvertError(f"${SRC_ENV}={env} has no convert_hf_to_gguf.py with its gguf-py")
        return Path(env)
    root = _cache_root()
    tree = root / "src" / f"llama_cpp_python-{PINNED_VERSION}" / "vendor" / "llama.cpp"
    if _is_tree(tree):
        return tree
    if not fetch:
        raise ConvertError(f"llama.cpp's converter is not unpacked at {tree}")
    _fetch_sdist(root, PINNED_VERSION)
    if not _is_tree(tree):
        raise ConvertError(f"the llama-cpp-python {PINNED_VERSION} sdist has no convert_hf_to_gguf.py at {tree}")
    return tree


def _fetch_sdist(root: Path, version: str) -> None:
    """pip download the sdist (its vendored llama.cpp is our bindings' commit) and unpack it, once."""
    sdist_dir = root / "sdist"
    archive = sdist_dir / f"llama_cpp_python-{version}.tar.gz"
    if not archive.is_file():
        # the sdist of this package only: with ":all:" pip also builds its build requirements from source to read
        # its metadata (41 s against 4 s from an empty pip cache)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", "llama-cpp-python",
               f"llama-cpp-python=={version}", "-d", str(sdist_dir), "-q"]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0 or not archive.is_file():
            raise ConvertError(f"could not fetch the llama-cpp-python {version} sdist with pip: "
                               f"{_last_line(res.stderr)}")
    (root / "src").mkdir(parents=True, exist_ok=True)
    with tarfile.open(archive) as tar:
        try:
            tar.extractall(root / "src", filter="data")
        except TypeError:  # Python without tarfile extraction filters (before 3.10.12 / 3.11.4)
            tar.extractall(root / "src")


def write_target_dir(meta: TargetMeta, folder: Path) -> Path:
    """The target config the converter reads for an EAGLE-3 draft (vocabulary size, block count and
    hidden size), from the GGUF's metadata; its tokenizer keys come from the GGUF itself (see
    ``_convert_with_target_vocab.py``)."""
    folder.mkdir(parents=True, exist_ok=True)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": meta.n_vocab,
              "num_hidden_layers": meta.n_layer, "hidden_size": meta.n_embd}
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return folder


def convert_to_gguf(hf_dir: Path, target_gguf: Path, meta: TargetMeta, out: Path, outtype: str = "f32",
                    model_name: str | None = None, timeout_s: float = 1800.0) -> Path:
    """Run the vendored converter on ``hf_dir`` (an EAGLE-3 export) into ``out``; returns ``out``."""
    if outtype not in OUTTYPES:
        raise ConvertError(f"unknown --outtype {outtype!r} (use {', '.join(OUTTYPES)})")
    tree = find_converter()
    env = {k: v for k, v in os.environ.items() if k != "NO_LOCAL_GGUF"}  # its own gguf-py, not ours
    with tempfile.TemporaryDirectory(prefix="hetero-spec-target-") as tmp:
        target_dir = write_target_dir(meta, Path(tmp))
        cmd = [sys.executable, str(WRAPPER), str(tree), str(target_gguf), "--",
               str(hf_dir), "--outfile", str(out), "--outtype", outtype, "--target-model-dir", str(target_dir)]
        if model_name:
            cmd += ["--model-name", model_name]
        try:
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
        except subprocess.TimeoutExpired:
            raise ConvertError(f"convert_hf_to_gguf.py did not finish in {timeout_s:.0f} s") from None
    if res.returncode != 0 or not out.is_file():
        raise ConvertError(f"convert_hf_to_gguf.py failed (exit {res.returncode}): {_last_line(res.stderr)}")
    return out


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in (text or "").splitlines() if ln.strip()]
    return lines[-1][:400] if lines else "no output"
