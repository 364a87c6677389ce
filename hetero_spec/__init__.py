"""hetero-spec: a GGUF target on the CPU (llama.cpp) verifying a small PyTorch draft.

Public API: ``HeteroSpec`` (generate / chat), ``BatchGenerator`` (many prompts on the batched engine), their
results, the config records and errors.

The names load on first use (PEP 562): importing the package, as the command line does before it parses
its options, does not import torch and llama.cpp, so ``hetero-spec --help`` or a mistyped option answers at
once, and a Ctrl-C while they load reaches the command line's handler instead of printing a traceback.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__all__ = [
    "HeteroSpec", "Completion", "TextStream", "BatchGenerator", "BatchCompletion", "DenoiseConfig", "DraftConfig", "SpecConfig",
    "SamplingConfig", "TreeSpec", "HeteroSpecError", "ConfigError", "TargetError", "ContextFull", "DraftError", "Round",
    "RunStats",
]
_WHERE = {name: module for module, names in {
    ".api": ("HeteroSpec", "Completion", "TextStream"),
    ".batch": ("BatchGenerator", "BatchCompletion"),
    ".config": ("DenoiseConfig", "DraftConfig", "SpecConfig", "SamplingConfig", "TreeSpec", "ConfigError"),
    ".errors": ("HeteroSpecError", "TargetError", "ContextFull", "DraftError"),
    ".records": ("Round", "RunStats"),
}.items() for name in names}

if TYPE_CHECKING:
    from .api import Completion, HeteroSpec, TextStream
    from .batch import BatchCompletion, BatchGenerator
    from .config import ConfigError, DenoiseConfig, DraftConfig, SamplingConfig, SpecConfig, TreeSpec
    from .errors import ContextFull, DraftError, HeteroSpecError, TargetError
    from .records import Round, RunStats


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'hetero_spec' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # once: later lookups are plain module attributes
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
